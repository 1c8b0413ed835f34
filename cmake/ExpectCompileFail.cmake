# Run as: cmake -DARGS_FILE=<file> -P ExpectCompileFail.cmake
#
# The driver of fived_add_compile_fail_test() (FivedTestHelpers.cmake). ARGS_FILE
# sets COMPILE_COMMAND (a list: compiler, flags, source) and EXPECT (a regex).
# Passes only when the compilation fails AND its diagnostics match EXPECT, so a
# program that fails for an unrelated reason does not pass as "misuse rejected".

cmake_minimum_required(VERSION 3.24)  # policies of the project, also in script mode

if(NOT ARGS_FILE OR NOT EXISTS "${ARGS_FILE}")
  message(FATAL_ERROR "ExpectCompileFail.cmake: ARGS_FILE not given or missing: '${ARGS_FILE}'")
endif()
include("${ARGS_FILE}")
list(REMOVE_ITEM COMPILE_COMMAND "")  # an empty generator expression (no definitions) leaves ""

# Plain ASCII quotes and untranslated messages, so regexes do not depend on the locale.
set(ENV{LC_ALL} C)
set(ENV{LANG} C)

list(JOIN COMPILE_COMMAND " " shown)
execute_process(COMMAND ${COMPILE_COMMAND}
                RESULT_VARIABLE result
                OUTPUT_VARIABLE output
                ERROR_VARIABLE output)  # same variable: stdout and stderr merged in order

# The compiler's output is printed as it is (an error message would re-wrap it).
if(result EQUAL 0)
  message("command: ${shown}\n${output}")
  message(FATAL_ERROR "compiled, but was expected to fail with a diagnostic matching\n  ${EXPECT}")
endif()
if(NOT output MATCHES "${EXPECT}")
  message("command: ${shown}\n--- compiler output ---\n${output}")
  message(FATAL_ERROR "failed to compile (${result}), but no diagnostic matches\n  ${EXPECT}")
endif()
message(STATUS "rejected as expected (matched: ${CMAKE_MATCH_0})")
