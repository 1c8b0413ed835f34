# The options the port configures fived with, shared by portfile.cmake and by the test that
# runs the port's steps without vcpkg (tests/packaging: packaging.vcpkg_port). Headers and the
# CMake package only; the package's fived::cuda appears in a consumer that has the CUDA
# toolkit and NCCL (cmake/fivedCudaTarget.cmake), whatever this build found.
set(FIVED_PORT_OPTIONS
  -DFIVED_BUILD_TESTS=OFF
  -DFIVED_BUILD_EXAMPLES=OFF
  -DFIVED_BUILD_BENCH=OFF
  -DFIVED_ENABLE_CUDA=OFF
  -DFIVED_INSTALL_CMAKEDIR=share/fived)
