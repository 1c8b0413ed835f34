# Run as: cmake -DMODE=<find_package|add_subdirectory|fetchcontent|vcpkg_port> -DFIVED_SOURCE_DIR=...
#               -DFIVED_BINARY_DIR=... -DCONSUMER_DIR=... -DWORK_DIR=... -DCONFIG=...
#               -DGENERATOR=... -DCONSUMER_ARGS=<list> -P RunConsumer.cmake
#
# Driver of the packaging.<MODE> tests (see CMakeLists.txt next to this file):
# gets fived into the consumer project the MODE way, then configures, builds and
# runs it. Everything happens under WORK_DIR, which is emptied first.

cmake_minimum_required(VERSION 3.24)  # policies of the project, also in script mode

foreach(var IN ITEMS MODE FIVED_SOURCE_DIR FIVED_BINARY_DIR CONSUMER_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "RunConsumer.cmake: -D${var}=... is required")
  endif()
endforeach()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(build_dir "${WORK_DIR}/build")
set(config_args)  # cmake --build / --install
set(ctest_config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
  set(ctest_config_args -C "${CONFIG}")
endif()

# Runs one step; on failure prints the step's output and stops the test.
function(step name)
  list(JOIN ARGN " " shown)
  message(STATUS "[${MODE}] ${name}: ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  if(NOT result EQUAL 0)
    message("${output}")  # as it is: an error message would re-wrap it
    message(FATAL_ERROR "[${MODE}] ${name} failed (${result})")
  endif()
  set(step_output "${output}" PARENT_SCOPE)
endfunction()

set(mode_args "-DFIVED_CONSUMER_MODE=${MODE}")
if(MODE STREQUAL "find_package")
  # Install exactly what this build tree would install, into a private prefix.
  set(prefix "${WORK_DIR}/prefix")
  step(install "${CMAKE_COMMAND}" --install "${FIVED_BINARY_DIR}" --prefix "${prefix}" ${config_args})
  # Only the private prefix may provide fived: no package registries, and the
  # consumer checks that fived_DIR lies under the prefix.
  list(APPEND mode_args "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
       -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF "-DFIVED_CONSUMER_EXPECT_PREFIX=${prefix}")
elseif(MODE STREQUAL "vcpkg_port")
  # The overlay port's steps, run the way the port runs them, without vcpkg (absent offline):
  # fived's sources configured with the port's options in Release (vcpkg_cmake_configure),
  # installed into a packages folder (vcpkg_cmake_install; the package lands in share/fived,
  # where vcpkg_cmake_config_fixup expects it), then found there by the consumer.
  include("${FIVED_SOURCE_DIR}/ports/fived/options.cmake")
  set(prefix "${WORK_DIR}/packages")
  set(port_build "${WORK_DIR}/port-build")
  set(compiler_args ${CONSUMER_ARGS})
  list(FILTER compiler_args INCLUDE REGEX "^-DCMAKE_(CXX_COMPILER|MAKE_PROGRAM)=")
  step(port-configure "${CMAKE_COMMAND}" -S "${FIVED_SOURCE_DIR}" -B "${port_build}" -G "${GENERATOR}"
       -DCMAKE_BUILD_TYPE=Release "-DCMAKE_INSTALL_PREFIX=${prefix}" ${FIVED_PORT_OPTIONS} ${compiler_args})
  step(port-install "${CMAKE_COMMAND}" --install "${port_build}" ${config_args})
  foreach(file IN ITEMS share/fived/fivedConfig.cmake share/fived/fivedTargets.cmake include/fived/fived.hpp)
    if(NOT EXISTS "${prefix}/${file}")
      message(FATAL_ERROR "[${MODE}] the port installed no ${file}")
    endif()
  endforeach()
  set(mode_args -DFIVED_CONSUMER_MODE=find_package "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
       -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF "-DFIVED_CONSUMER_EXPECT_PREFIX=${prefix}")
elseif(MODE STREQUAL "add_subdirectory" OR MODE STREQUAL "fetchcontent")
  # fived's CUDA detection (nvcc compiler checks) only costs time here: what is
  # tested is how fived behaves as a subproject.
  list(APPEND mode_args "-DFIVED_CONSUMER_SOURCE_DIR=${FIVED_SOURCE_DIR}" -DFIVED_ENABLE_CUDA=OFF)
  # The consumer must not expect fived::cuda when fived's CUDA parts are off.
  list(FILTER CONSUMER_ARGS EXCLUDE REGEX "^-DFIVED_CONSUMER_EXPECT_CUDA=")
else()
  message(FATAL_ERROR "RunConsumer.cmake: unknown MODE '${MODE}'")
endif()

# CMAKE_BUILD_TYPE matters to single-config generators only; --no-warn-unused-cli
# keeps multi-config ones (and settings unused in a MODE) quiet about it.
step(configure "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${build_dir}" -G "${GENERATOR}" --no-warn-unused-cli
     "-DCMAKE_BUILD_TYPE=${CONFIG}" ${CONSUMER_ARGS} ${mode_args})
message("${step_output}")
step(build "${CMAKE_COMMAND}" --build "${build_dir}" ${config_args})
step(run "${CMAKE_CTEST_COMMAND}" --test-dir "${build_dir}" --output-on-failure ${ctest_config_args})
message("${step_output}")
