#pragma once
// Conversions, contract of fived/kernels/host/convert.hpp (acc_t is float here):
//   to_fp32(s, dst, src, n)      dst[i] = float(src[i])
//   from_acc(s, dst, src, n)     dst[i] = T(src[i]), src float

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

template <class T>
__global__ void to_fp32_kernel(float* dst, const T* src, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = to_float(src[i]);
}

template <class T>
__global__ void from_acc_kernel(T* dst, const float* src, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = from_float<T>(src[i]);
}

}  // namespace detail

template <class T>
void to_fp32(cudaStream_t stream, float* dst, const T* src, std::size_t n) {
  static_assert(is_element_v<T>, "to_fp32: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::to_fp32_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dst, dev(src), n);
  FIVED_CUDA_CHECK_LAUNCH("to_fp32_kernel");
}

template <class T>
void from_acc(cudaStream_t stream, T* dst, const float* src, std::size_t n) {
  static_assert(is_element_v<T>, "from_acc: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::from_acc_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(dst), src, n);
  FIVED_CUDA_CHECK_LAUNCH("from_acc_kernel");
}

}  // namespace fived::kernels::cuda
