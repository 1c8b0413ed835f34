#pragma once
// Residual add, contract of fived/kernels/host/residual.hpp:
//   residual_forward(s, out, a, b, n)      out = a + b (out may alias a or b)

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

template <class T>
__global__ void residual_forward_kernel(T* out, const T* a, const T* b, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

}  // namespace detail

template <class T>
void residual_forward(cudaStream_t stream, T* out, const T* a, const T* b, std::size_t n) {
  static_assert(is_element_v<T>, "residual_forward: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::residual_forward_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(out), dev(a), dev(b), n);
  FIVED_CUDA_CHECK_LAUNCH("residual_forward_kernel");
}

}  // namespace fived::kernels::cuda
