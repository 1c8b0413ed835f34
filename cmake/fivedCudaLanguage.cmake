# CMake 3.25 does not know the nvcc flag for C++20 (CUDA_STANDARD 20 fails);
# teach it, so that cuda_std_20 / CMAKE_CUDA_STANDARD work on CUDA sources.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
if(NOT DEFINED CMAKE_CUDA_STANDARD)
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
endif()

# fived::cuda links the shared CUDA runtime; CMake's default for CUDA targets is
# the static one, which would put two runtimes into one program.
if(NOT DEFINED CMAKE_CUDA_RUNTIME_LIBRARY)
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
endif()
