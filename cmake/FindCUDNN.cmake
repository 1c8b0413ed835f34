# FindCUDNN
# ---------
# Finds cuDNN (cudnn.h, libcudnn) and the header-only cudnn-frontend (cudnn_frontend.h)
# that fived's fused attention is written against, and defines the imported target
# CUDNN::cudnn carrying both include folders.
#
# cuDNN: CUDNN_ROOT / CUDNN_HOME (CMake variable, then environment), the CUDA toolkit's
# folders, Python's nvidia-cudnn wheel (site-packages/nvidia/cudnn/{include,lib}), then
# the system paths.
# cudnn-frontend: CUDNN_FRONTEND_ROOT (a folder holding include/cudnn_frontend.h), Python's
# nvidia-cudnn-frontend wheel (it puts include/ in site-packages: `pip install
# nvidia-cudnn-frontend==1.32.0`; the version fived is tested with), then the system paths.
#
# Result variables: CUDNN_FOUND, CUDNN_VERSION, CUDNN_FRONTEND_VERSION, CUDNN_INCLUDE_DIR,
# CUDNN_FRONTEND_INCLUDE_DIR, CUDNN_LIBRARY. Imported target: CUDNN::cudnn.

set(_cudnn_hints "")
set(_cudnn_frontend_hints "")
foreach(_cudnn_var IN ITEMS CUDNN_ROOT CUDNN_HOME)
  if(DEFINED ${_cudnn_var} AND NOT "${${_cudnn_var}}" STREQUAL "")
    list(APPEND _cudnn_hints "${${_cudnn_var}}")
  endif()
  if(DEFINED ENV{${_cudnn_var}} AND NOT "$ENV{${_cudnn_var}}" STREQUAL "")
    list(APPEND _cudnn_hints "$ENV{${_cudnn_var}}")
  endif()
endforeach()
if(DEFINED CUDNN_FRONTEND_ROOT AND NOT "${CUDNN_FRONTEND_ROOT}" STREQUAL "")
  list(APPEND _cudnn_frontend_hints "${CUDNN_FRONTEND_ROOT}")
endif()
if(DEFINED ENV{CUDNN_FRONTEND_ROOT} AND NOT "$ENV{CUDNN_FRONTEND_ROOT}" STREQUAL "")
  list(APPEND _cudnn_frontend_hints "$ENV{CUDNN_FRONTEND_ROOT}")
endif()
if(CUDAToolkit_FOUND)
  list(APPEND _cudnn_hints ${CUDAToolkit_INCLUDE_DIRS}/.. ${CUDAToolkit_LIBRARY_DIR}/..)
endif()

# The Python wheels, found without importing them (their modules load libcudnn).
if(Python3_EXECUTABLE)
  set(_cudnn_python "${Python3_EXECUTABLE}")
else()
  find_program(_cudnn_python NAMES python3 NO_CACHE)
endif()
if(_cudnn_python)
  execute_process(
    COMMAND "${_cudnn_python}" -c
      "import importlib.util as u, os\ndef where(n):\n  try:\n    s = u.find_spec(n)\n  except ImportError:\n    return '-'\n  return list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '-'\nprint(where('nvidia.cudnn'))\nc = where('cudnn')\nprint(os.path.dirname(c) if c != '-' else '-')"
    OUTPUT_VARIABLE _cudnn_python_dirs OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _cudnn_python_rc ERROR_QUIET)
  if(_cudnn_python_rc EQUAL 0)
    string(REPLACE "\n" ";" _cudnn_python_dirs "${_cudnn_python_dirs}")
    list(LENGTH _cudnn_python_dirs _cudnn_n)
    if(_cudnn_n EQUAL 2)
      list(GET _cudnn_python_dirs 0 _cudnn_wheel)
      list(GET _cudnn_python_dirs 1 _cudnn_frontend_wheel)
      if(IS_DIRECTORY "${_cudnn_wheel}")
        list(APPEND _cudnn_hints "${_cudnn_wheel}")
      endif()
      if(IS_DIRECTORY "${_cudnn_frontend_wheel}")
        list(APPEND _cudnn_frontend_hints "${_cudnn_frontend_wheel}")
      endif()
    endif()
  endif()
endif()

find_path(CUDNN_INCLUDE_DIR NAMES cudnn.h HINTS ${_cudnn_hints} PATH_SUFFIXES include DOC "Folder holding cudnn.h")
find_library(CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 NAMES_PER_DIR HINTS ${_cudnn_hints}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu DOC "libcudnn")
find_path(CUDNN_FRONTEND_INCLUDE_DIR NAMES cudnn_frontend.h HINTS ${_cudnn_frontend_hints} PATH_SUFFIXES include
  DOC "Folder holding cudnn_frontend.h (the header-only cudnn-frontend)")

foreach(_cudnn_file IN ITEMS cudnn_version.h cudnn.h)
  if(CUDNN_INCLUDE_DIR AND EXISTS "${CUDNN_INCLUDE_DIR}/${_cudnn_file}" AND NOT CUDNN_VERSION)
    file(STRINGS "${CUDNN_INCLUDE_DIR}/${_cudnn_file}" _cudnn_lines REGEX "^#define[ \t]+CUDNN_(MAJOR|MINOR|PATCHLEVEL)[ \t]+[0-9]+")
    if(_cudnn_lines MATCHES "CUDNN_MAJOR[ \t]+([0-9]+)")
      set(_cudnn_major "${CMAKE_MATCH_1}")
      string(REGEX MATCH "CUDNN_MINOR[ \t]+([0-9]+)" _m "${_cudnn_lines}")
      set(_cudnn_minor "${CMAKE_MATCH_1}")
      string(REGEX MATCH "CUDNN_PATCHLEVEL[ \t]+([0-9]+)" _m "${_cudnn_lines}")
      set(CUDNN_VERSION "${_cudnn_major}.${_cudnn_minor}.${CMAKE_MATCH_1}")
    endif()
  endif()
endforeach()
if(CUDNN_FRONTEND_INCLUDE_DIR AND EXISTS "${CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend_version.h")
  file(STRINGS "${CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend_version.h" _fe_lines
    REGEX "^#define[ \t]+CUDNN_FRONTEND_(MAJOR|MINOR|PATCH)_VERSION[ \t]+[0-9]+")
  set(_fe_parts "")
  foreach(_p IN ITEMS MAJOR MINOR PATCH)
    string(REGEX MATCH "CUDNN_FRONTEND_${_p}_VERSION[ \t]+([0-9]+)" _m "${_fe_lines}")
    list(APPEND _fe_parts "${CMAKE_MATCH_1}")
  endforeach()
  string(REPLACE ";" "." CUDNN_FRONTEND_VERSION "${_fe_parts}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CUDNN
  REQUIRED_VARS CUDNN_LIBRARY CUDNN_INCLUDE_DIR CUDNN_FRONTEND_INCLUDE_DIR
  VERSION_VAR CUDNN_VERSION
  REASON_FAILURE_MESSAGE "cuDNN 9 and the cudnn-frontend headers: set CUDNN_ROOT to cuDNN's folder and CUDNN_FRONTEND_ROOT to a folder holding include/cudnn_frontend.h (or pip install nvidia-cudnn-frontend==1.32.0)")

if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn UNKNOWN IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES
    IMPORTED_LOCATION "${CUDNN_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CUDNN_INCLUDE_DIR};${CUDNN_FRONTEND_INCLUDE_DIR}")
endif()

mark_as_advanced(CUDNN_INCLUDE_DIR CUDNN_LIBRARY CUDNN_FRONTEND_INCLUDE_DIR)
unset(_cudnn_hints)
unset(_cudnn_frontend_hints)
unset(_cudnn_python)
