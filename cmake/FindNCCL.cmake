# FindNCCL
# --------
# Finds NCCL (nccl.h and libnccl) and defines the imported target NCCL::nccl.
#
# NCCL ships in several places and none of them has a CMake package: inside the
# CUDA toolkit's include/lib folders (as on the development machine), under a
# prefix named by NCCL_ROOT / NCCL_HOME, or in Python's nvidia-nccl wheel
# (site-packages/nvidia/nccl/{include,lib}, where only libnccl.so.2 exists).
# Search order: NCCL_ROOT, NCCL_HOME (CMake variable, then environment), the
# CUDA toolkit, the Python wheel, then the system default paths.
#
# Result variables:
#   NCCL_FOUND, NCCL_VERSION (major.minor.patch, read from nccl.h),
#   NCCL_INCLUDE_DIR, NCCL_LIBRARY (cache entries; set them to override).
# Imported target:
#   NCCL::nccl

set(_nccl_hints "")
foreach(_nccl_var IN ITEMS NCCL_ROOT NCCL_HOME)
  if(DEFINED ${_nccl_var} AND NOT "${${_nccl_var}}" STREQUAL "")
    list(APPEND _nccl_hints "${${_nccl_var}}")
  endif()
  if(DEFINED ENV{${_nccl_var}} AND NOT "$ENV{${_nccl_var}}" STREQUAL "")
    list(APPEND _nccl_hints "$ENV{${_nccl_var}}")
  endif()
endforeach()

# The CUDA toolkit's own folders: NCCL is often installed next to cudart.
set(_nccl_include_hints "")
set(_nccl_lib_hints "")
if(CUDAToolkit_FOUND)
  list(APPEND _nccl_include_hints ${CUDAToolkit_INCLUDE_DIRS})
  list(APPEND _nccl_lib_hints ${CUDAToolkit_LIBRARY_DIR})
else()
  list(APPEND _nccl_hints /usr/local/cuda)
endif()

# Python's nvidia-nccl-cu* wheel (pulled in by PyTorch on GPU machines).
if(Python3_EXECUTABLE)
  set(_nccl_python "${Python3_EXECUTABLE}")
else()
  find_program(_nccl_python NAMES python3 NO_CACHE)
endif()
if(_nccl_python)
  execute_process(
    # __path__, not __file__: recent wheels make nvidia.nccl a namespace package.
    COMMAND "${_nccl_python}" -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])"
    OUTPUT_VARIABLE _nccl_python_dir OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _nccl_python_rc ERROR_QUIET)
  if(_nccl_python_rc EQUAL 0 AND IS_DIRECTORY "${_nccl_python_dir}")
    list(APPEND _nccl_hints "${_nccl_python_dir}")
  endif()
endif()

find_path(NCCL_INCLUDE_DIR NAMES nccl.h
  HINTS ${_nccl_hints} ${_nccl_include_hints}
  PATH_SUFFIXES include
  DOC "Folder holding nccl.h")

# The wheel has only the versioned soname. NAMES_PER_DIR: the first folder
# holding either name wins, so the library comes from the same place as the header.
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
  HINTS ${_nccl_hints} ${_nccl_lib_hints}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu
  DOC "libnccl")

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
    REGEX "^#define[ \t]+NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_nccl_part IN ITEMS MAJOR MINOR PATCH)
    set(NCCL_VERSION_${_nccl_part} "")
    foreach(_nccl_line IN LISTS _nccl_version_lines)
      if(_nccl_line MATCHES "^#define[ \t]+NCCL_${_nccl_part}[ \t]+([0-9]+)")
        set(NCCL_VERSION_${_nccl_part} "${CMAKE_MATCH_1}")
      endif()
    endforeach()
  endforeach()
  if(NOT NCCL_VERSION_MAJOR STREQUAL "" AND NOT NCCL_VERSION_MINOR STREQUAL "" AND NOT NCCL_VERSION_PATCH STREQUAL "")
    set(NCCL_VERSION "${NCCL_VERSION_MAJOR}.${NCCL_VERSION_MINOR}.${NCCL_VERSION_PATCH}")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION
  REASON_FAILURE_MESSAGE "set NCCL_ROOT (or NCCL_HOME) to the folder holding include/nccl.h and lib/libnccl.so")

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()

mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
unset(_nccl_hints)
unset(_nccl_include_hints)
unset(_nccl_lib_hints)
unset(_nccl_python)
unset(_nccl_python_dir)
unset(_nccl_python_rc)
unset(_nccl_version_lines)
