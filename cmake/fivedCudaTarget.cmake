# Defines fived::cuda (fived::fived + CUDA runtime + cuBLASLt + NCCL) when the
# CUDA toolkit and NCCL are found (and cuDNN with the cudnn-frontend headers, for the fused
# attention, when those are found and FIVED_ENABLE_CUDNN is not OFF). The MPI bootstrap of
# the NCCL communicator takes fived::mpi as well (fivedMpiTarget.cmake). Used by fived's
# own build and by fivedConfig.cmake for consumers; does nothing when a
# dependency is missing.
if(TARGET fived::cuda)
  return()
endif()
find_package(CUDAToolkit QUIET)
list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
find_package(NCCL QUIET)
if(NOT CUDAToolkit_FOUND OR NOT NCCL_FOUND)
  message(STATUS "fived: fived::cuda not available (CUDA toolkit found: ${CUDAToolkit_FOUND}, NCCL found: ${NCCL_FOUND})")
  return()
endif()
add_library(fived_cuda INTERFACE IMPORTED GLOBAL)
target_link_libraries(fived_cuda INTERFACE fived::fived CUDA::cudart CUDA::cublasLt NCCL::nccl)
target_compile_definitions(fived_cuda INTERFACE FIVED_WITH_CUDA=1)
if(NOT DEFINED FIVED_ENABLE_CUDNN OR FIVED_ENABLE_CUDNN)
  find_package(CUDNN QUIET)
endif()
if(CUDNN_FOUND)
  # cudnn-frontend compiles some of its engines at run time (NVRTC).
  target_link_libraries(fived_cuda INTERFACE CUDNN::cudnn CUDA::nvrtc)
  target_compile_definitions(fived_cuda INTERFACE FIVED_WITH_CUDNN=1)
  message(STATUS "fived: attention through cuDNN ${CUDNN_VERSION} (cudnn-frontend ${CUDNN_FRONTEND_VERSION})")
else()
  message(STATUS "fived: cuDNN or the cudnn-frontend headers not found: attention runs fived's own kernel")
endif()
add_library(fived::cuda ALIAS fived_cuda)
