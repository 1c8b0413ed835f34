#pragma once
// GELU (tanh approximation, as GPT-2), contract of fived/kernels/host/gelu.hpp:
//   gelu_forward(s, out, inp, n)
//   gelu_backward(s, dinp, inp, dout, n)    dinp = dout * gelu'(inp); dinp may alias dout
// Elementwise, grid-stride, float math (tanhf).

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

template <class T>
__global__ void gelu_forward_kernel(T* out, const T* inp, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(gelu_f(to_float(inp[i])));
}

template <class T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dinp[i] = from_float<T>(to_float(dout[i]) * gelu_grad_f(to_float(inp[i])));
}

}  // namespace detail

template <class T>
void gelu_forward(cudaStream_t stream, T* out, const T* inp, std::size_t n) {
  static_assert(is_element_v<T>, "gelu_forward: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::gelu_forward_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(out), dev(inp), n);
  FIVED_CUDA_CHECK_LAUNCH("gelu_forward_kernel");
}

template <class T>
void gelu_backward(cudaStream_t stream, T* dinp, const T* inp, const T* dout, std::size_t n) {
  static_assert(is_element_v<T>, "gelu_backward: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::gelu_backward_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(dinp), dev(inp), dev(dout), n);
  FIVED_CUDA_CHECK_LAUNCH("gelu_backward_kernel");
}

}  // namespace fived::kernels::cuda
