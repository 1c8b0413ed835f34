# Helpers for fived's own test suite; included from tests/CMakeLists.txt.
#
#   fived_add_compile_fail_test(NAME <test name> SOURCE <file.cpp> EXPECT <regex>
#                               [CUDA] [FLAGS <compiler flag>...])
#       A CTest that compiles SOURCE (relative to the calling directory) and passes
#       only if the compilation fails AND the compiler's diagnostics match EXPECT.
#       Requiring the match is the point: a test program that fails for an
#       unrelated reason (a typo, a missing include) must not count as "misuse
#       does not compile". CUDA compiles the source as CUDA with nvcc against
#       fived::cuda; without FIVED_HAS_CUDA such a test is not registered.
#       Diagnostics are produced with LC_ALL=C, so quotes are plain ASCII.
#
#   fived_add_header_checks()
#       Every public header under include/fived/ compiles on its own: one
#       generated translation unit per header includes it twice (the second
#       include checks the include guard / #pragma once), built as part of ALL,
#       so a header that is not self-contained breaks the build rather than a test.
#       C++ TUs are built with -Wall -Wextra -Werror -pedantic (GCC/Clang) and only
#       the usage requirements the header needs (below). When FIVED_HAS_CUDA is ON
#       every header is also built with nvcc, linked to fived::cuda as CUDA code
#       would be: all headers must be includable from CUDA code. A header whose own
#       text can differ there, because it is a device or CUDA/NCCL header or tests
#       __CUDACC__, __CUDA_ARCH__ or FIVED_WITH_CUDA, gets a .cu TU of its own. The
#       others are the same text under either compiler, shown self-contained by their
#       C++ TU, and what they include that differs has a .cu TU of its own; so one .cu
#       TU includes them all, the trainer's headers over the CUDA backend among them
#       (nvcc's front end still parses each; about 140 nvcc runs fewer, a dozen of them
#       ~40 s each, since each compiled the whole CUDA backend). All the units are then
#       linked into one program, fived_header_checks_linked: a function or kernel defined in
#       a header without `inline` (or a template) breaks that link, as it would a user's
#       program of two source files. The umbrella target `fived_header_checks` builds all of
#       them. Call it once.
#
#       What a header needs is decided by its name (path relative to include/fived/)
#       and by the system headers it includes itself:
#         device header : a directory component named `cuda` (kernels/cuda/gemm.hpp,
#                         cuda/stream.hpp) or the .cuh extension. Contains device code,
#                         so it is built only as a .cu TU, only when fived::cuda exists.
#         CUDA/NCCL     : a file name with `cuda` or `nccl` as an `_`-separated word
#                         (comm/nccl.hpp, comm/nccl_bootstrap.hpp, device/cuda_event.hpp),
#                         or an #include of <nccl*.h>, <cuda*>, <cublas*>, <curand*>,
#                         <cub/...>, <thrust/...>. Host code over the CUDA runtime / NCCL:
#                         built as C++ with the host compiler and as CUDA, linked to
#                         fived::cuda, only when it exists.
#         MPI           : a file name with `mpi` as an `_`-separated word (comm/mpi.hpp,
#                         comm/mpi_bootstrap.hpp), or an #include of <mpi.h>; linked to
#                         MPI::MPI_CXX, only when it exists.
#         anything else : plain C++20 with fived::fived only (no CUDA, NCCL or MPI include
#                         paths), so a plain header that leaks such a dependency fails.
#       Requirements combine (comm/mpi_bootstrap.hpp includes <mpi.h> and <nccl.h>: it
#       needs fived::cuda and MPI). A header that gets CUDA, NCCL or MPI only through
#       another fived header must say so by its name. Includes are read at configure
#       time: re-run CMake after changing what a header includes. Headers with different
#       requirements go to different object libraries, because usage requirements
#       are per target.

include_guard(GLOBAL)

set(_FIVED_HELPERS_DIR "${CMAKE_CURRENT_LIST_DIR}")
get_filename_component(_FIVED_INCLUDE_DIR "${CMAKE_CURRENT_LIST_DIR}/../include" ABSOLUTE)

# ---- compile-fail tests ----------------------------------------------------------------

function(fived_add_compile_fail_test)
  cmake_parse_arguments(PARSE_ARGV 0 arg "CUDA" "NAME;SOURCE;EXPECT" "FLAGS")
  if(arg_UNPARSED_ARGUMENTS OR NOT arg_NAME OR NOT arg_SOURCE OR "${arg_EXPECT}" STREQUAL "")
    message(FATAL_ERROR "usage: fived_add_compile_fail_test(NAME <name> SOURCE <file> EXPECT <regex> [CUDA] [FLAGS ...])"
                        " (got: ${ARGN})")
  endif()
  get_filename_component(source "${arg_SOURCE}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
  if(NOT EXISTS "${source}")
    message(FATAL_ERROR "fived_add_compile_fail_test(${arg_NAME}): ${source} does not exist")
  endif()

  if(arg_CUDA)
    if(NOT FIVED_HAS_CUDA)
      return()  # nothing to check without nvcc + NCCL
    endif()
    set(lang CUDA)
    set(target fived::cuda)
  else()
    set(lang CXX)
    set(target fived::fived)
  endif()

  # The command line: the project's compiler and flags, strict C++20, and the
  # include paths and definitions of the target a user would link. They are
  # generator expressions, evaluated below by file(GENERATE), so dependencies
  # of the target (CUDA toolkit, NCCL) come along transitively.
  set(work_dir "${CMAKE_CURRENT_BINARY_DIR}/compile_fail")
  set(std "${CMAKE_${lang}20_STANDARD_COMPILE_OPTION}")
  if(NOT std)
    set(std "-std=c++20")
  endif()
  separate_arguments(user_flags NATIVE_COMMAND "${CMAKE_${lang}_FLAGS}")
  set(cmd "${CMAKE_${lang}_COMPILER}" ${user_flags} ${std})
  if(lang STREQUAL "CUDA")
    # nvcc has no -fsyntax-only: compile to a throw-away object instead.
    if(CMAKE_CUDA_HOST_COMPILER)
      list(APPEND cmd -ccbin "${CMAKE_CUDA_HOST_COMPILER}")
    endif()
    list(GET CMAKE_CUDA_ARCHITECTURES 0 arch)
    if(arch MATCHES "^([0-9]+)")
      list(APPEND cmd "-arch=sm_${CMAKE_MATCH_1}")
    endif()
    list(APPEND cmd -x cu -c -o "${work_dir}/${arg_NAME}.o")
  else()
    list(APPEND cmd -fsyntax-only)
  endif()
  set(incs "$<REMOVE_DUPLICATES:$<TARGET_PROPERTY:${target},INTERFACE_INCLUDE_DIRECTORIES>>")
  set(defs "$<TARGET_PROPERTY:${target},INTERFACE_COMPILE_DEFINITIONS>")
  list(APPEND cmd "$<$<BOOL:${incs}>:-I$<JOIN:${incs},;-I>>" "$<$<BOOL:${defs}>:-D$<JOIN:${defs},;-D>>"
       ${arg_FLAGS} "${source}")

  # Parameters travel in a generated file as bracket arguments, so a regex with
  # ';', '\' or quotes reaches the script exactly as written here.
  set(args_file "${work_dir}/${arg_NAME}.cmake")
  file(GENERATE OUTPUT "${args_file}" CONTENT
"# Generated by fived_add_compile_fail_test(${arg_NAME}); read by ExpectCompileFail.cmake.
set(COMPILE_COMMAND [==[${cmd}]==])
set(EXPECT [==[${arg_EXPECT}]==])
")
  add_test(NAME "${arg_NAME}"
           COMMAND "${CMAKE_COMMAND}" "-DARGS_FILE=${args_file}" -P "${_FIVED_HELPERS_DIR}/ExpectCompileFail.cmake")
  set_tests_properties("${arg_NAME}" PROPERTIES LABELS "refused")  # not "compile-...": `ctest -L mpi` would match it
endfunction()

# ---- header self-containment -------------------------------------------------------------

# Sets <out_list> to those of <headers> (paths under include/) whose own text can differ
# when nvcc compiles it: a device or CUDA/NCCL header, or one that tests __CUDACC__,
# __CUDA_ARCH__ or FIVED_WITH_CUDA. A header that only includes such a header is not in
# it: its own text is the same under nvcc, and what it includes has a .cu TU of its own.
function(_fived_cuda_sensitive headers out_list)
  set(sensitive)
  foreach(header IN LISTS headers)
    _fived_header_needs("${header}" needs device)
    if(NOT "cuda" IN_LIST needs)
      file(STRINGS "${_FIVED_INCLUDE_DIR}/${header}" lines REGEX "__CUDACC__|__CUDA_ARCH__|FIVED_WITH_CUDA")
      foreach(line IN LISTS lines)
        if(NOT line MATCHES "^[ \t]*//")
          set(needs cuda)  # tests a CUDA macro
        endif()
      endforeach()
    endif()
    if("cuda" IN_LIST needs)
      list(APPEND sensitive "${header}")
    endif()
  endforeach()
  set(${out_list} "${sensitive}" PARENT_SCOPE)
endfunction()

# Sets <out_needs> to the subset of {cuda, mpi} a header needs and <out_device>
# to TRUE for device headers (see the rule at the top of this file).
function(_fived_header_needs header out_needs out_device)
  get_filename_component(name "${header}" NAME)
  file(STRINGS "${_FIVED_INCLUDE_DIR}/${header}" includes REGEX "^[ \t]*#[ \t]*include[ \t]*<")
  set(needs)
  set(device FALSE)
  if(header MATCHES "(^|/)cuda/" OR name MATCHES "\\.cuh$")
    set(device TRUE)
    list(APPEND needs cuda)
  elseif(name MATCHES "(^|_)(cuda|nccl)(_|\\.)"
         OR includes MATCHES "<(nccl[^>]*\\.h|cuda[^>]*|cublas[^>]*|curand[^>]*|cub/[^>]*|thrust/[^>]*)>")
    list(APPEND needs cuda)
  endif()
  if(name MATCHES "(^|_)mpi(_|\\.)" OR includes MATCHES "<mpi\\.h>")
    list(APPEND needs mpi)
  endif()
  set(${out_needs} "${needs}" PARENT_SCOPE)
  set(${out_device} ${device} PARENT_SCOPE)
endfunction()

# Adds source <tu> to the header-check object library <target> of language <lang>
# (CXX or CUDA), made on first use and linked to the libraries after <tu>.
function(_fived_add_header_check target lang tu)
  if(NOT TARGET "${target}")
    add_library("${target}" OBJECT)
    target_link_libraries("${target}" PRIVATE ${ARGN})
    # Strict ISO C++ (-std=c++20, not gnu++20): the headers must not rely on extensions.
    set_target_properties("${target}" PROPERTIES CXX_EXTENSIONS OFF CUDA_EXTENSIONS OFF)
    if(lang STREQUAL "CXX" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
      target_compile_options("${target}" PRIVATE -Wall -Wextra -Werror -pedantic)
    elseif(lang STREQUAL "CUDA")
      # nvcc's own diagnostics (front end, cross-execution-space calls) are errors,
      # and so are the host compiler's on the code nvcc hands it (what sits behind
      # #ifdef __CUDACC__ is seen only here). No -pedantic: nvcc's generated host
      # code is not ISO C++.
      target_compile_options("${target}" PRIVATE --Werror=all-warnings)
      if(NOT WIN32)  # host compiler is GCC or Clang (MSVC spells warnings differently)
        target_compile_options("${target}" PRIVATE -Xcompiler=-Wall,-Wextra,-Werror)
      endif()
    endif()
    add_dependencies(fived_header_checks "${target}")
    set_property(GLOBAL APPEND PROPERTY _FIVED_HEADER_CHECK_TARGETS "${target}")
  endif()
  target_sources("${target}" PRIVATE "${tu}")
endfunction()

function(fived_add_header_checks)
  file(GLOB_RECURSE headers CONFIGURE_DEPENDS RELATIVE "${_FIVED_INCLUDE_DIR}"
       "${_FIVED_INCLUDE_DIR}/fived/*.hpp" "${_FIVED_INCLUDE_DIR}/fived/*.cuh")
  if(NOT headers)
    message(FATAL_ERROR "fived_add_header_checks: no headers found under ${_FIVED_INCLUDE_DIR}/fived")
  endif()

  add_custom_target(fived_header_checks)
  set(checked 0)
  set(skipped)
  set(plain_under_nvcc)  # headers that share one .cu TU (see the top of this file)
  if(FIVED_HAS_CUDA)
    _fived_cuda_sensitive("${headers}" sensitive)
  endif()
  foreach(header IN LISTS headers)
    _fived_header_needs("${header}" needs device)

    set(libs fived::fived)
    set(missing)
    if("cuda" IN_LIST needs)
      if(FIVED_HAS_CUDA)
        list(APPEND libs fived::cuda)
      else()
        list(APPEND missing fived::cuda)
      endif()
    endif()
    if("mpi" IN_LIST needs)
      if(TARGET MPI::MPI_CXX)
        list(APPEND libs MPI::MPI_CXX)
      else()
        list(APPEND missing MPI::MPI_CXX)
      endif()
    endif()
    if(missing)
      string(JOIN " and " missing ${missing})  # one list element per header
      list(APPEND skipped "${header} (needs ${missing})")
      continue()
    endif()

    set(langs)
    if(NOT device)
      list(APPEND langs CXX)
    endif()
    if(FIVED_HAS_CUDA)
      # A header that needs MPI keeps its own unit too: the shared one links no MPI.
      if(needs OR header IN_LIST sensitive)
        list(APPEND langs CUDA)
      else()
        list(APPEND plain_under_nvcc "${header}")
      endif()
    endif()

    string(REPLACE "/" "__" stem "${header}")
    foreach(lang IN LISTS langs)
      if(lang STREQUAL "CUDA")
        # CUDA code links fived::cuda, so every .cu TU does: that is the setting
        # (FIVED_WITH_CUDA defined) in which all headers must work from CUDA.
        set(ext cu)
        set(lang_needs ${needs})
        list(REMOVE_ITEM lang_needs cuda)
        set(lang_libs ${libs} fived::cuda)
        list(REMOVE_DUPLICATES lang_libs)
      else()
        set(ext cpp)
        set(lang_needs ${needs})
        set(lang_libs ${libs})
      endif()
      # One object library per language and requirement set, e.g. fived_header_checks_cpp_cuda.
      string(JOIN "_" needs_suffix "" ${lang_needs})  # "", "_cuda", "_mpi" or "_cuda_mpi"
      set(target "fived_header_checks_${ext}${needs_suffix}")
      set(tu "${CMAKE_CURRENT_BINARY_DIR}/header_checks/${ext}/${stem}.${ext}")
      # file(CONFIGURE) rewrites only on change, so re-configuring rebuilds nothing.
      file(CONFIGURE OUTPUT "${tu}" @ONLY CONTENT
"// Generated by fived_add_header_checks(): <@header@> must compile on its own.
// Included twice: the second include must be a no-op (#pragma once / include guard).
#include <@header@>
#include <@header@>
")
      _fived_add_header_check("${target}" ${lang} "${tu}" ${lang_libs})
      math(EXPR checked "${checked} + 1")
    endforeach()
  endforeach()

  if(plain_under_nvcc)
    set(tu "${CMAKE_CURRENT_BINARY_DIR}/header_checks/cu/plain_headers.cu")
    list(TRANSFORM plain_under_nvcc REPLACE "(.+)" "#include <\\1>" OUTPUT_VARIABLE lines)
    string(JOIN "\n" lines ${lines})
    file(CONFIGURE OUTPUT "${tu}" @ONLY CONTENT
"// Generated by fived_add_header_checks(): the headers whose code is the same under nvcc
// (each one's C++ TU shows it self-contained), parsed by nvcc's front end together.
@lines@
")
    _fived_add_header_check(fived_header_checks_cu CUDA "${tu}" fived::fived fived::cuda)
    math(EXPR checked "${checked} + 1")
  endif()

  # Every unit above linked into one program: a function or kernel a header defines without
  # `inline` (or a template) is defined again in each unit that includes it, which no unit
  # alone shows; a user's program of two source files would not link.
  get_property(check_targets GLOBAL PROPERTY _FIVED_HEADER_CHECK_TARGETS)
  set(main "${CMAKE_CURRENT_BINARY_DIR}/header_checks/linked_main.cpp")
  file(CONFIGURE OUTPUT "${main}" CONTENT "// Generated by fived_add_header_checks(): the header checks' units linked together.
int main() { return 0; }
")
  add_executable(fived_header_checks_linked "${main}")
  target_link_libraries(fived_header_checks_linked PRIVATE ${check_targets})
  if(FIVED_HAS_CUDA)
    set_target_properties(fived_header_checks_linked PROPERTIES LINKER_LANGUAGE CUDA)
  endif()
  add_dependencies(fived_header_checks fived_header_checks_linked)

  list(LENGTH headers n)
  list(LENGTH plain_under_nvcc plain)
  message(STATUS "fived: header checks: ${n} headers, ${checked} translation units (CUDA: ${FIVED_HAS_CUDA}; "
                 "${plain} plain headers share one .cu unit)")
  foreach(s IN LISTS skipped)
    message(STATUS "fived: header check skipped: ${s}")
  endforeach()
endfunction()
