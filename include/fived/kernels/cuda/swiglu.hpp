#pragma once
// SwiGLU, contract of fived/kernels/host/swiglu.hpp:
//   swiglu_forward(s, h, gu, N, F)       h [N, F] = silu(gate) * up, gu [N, 2F] = [gate | up]
//   swiglu_backward(s, dgu, dh, gu, N, F)   dgu [N, 2F] ("=")
// Elementwise over N x F, grid-stride, float math.

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

template <class T>
__global__ void swiglu_forward_kernel(T* h, const T* gu, std::size_t n, std::size_t F) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t r = i / F, j = i % F;
    const float g = to_float(gu[r * 2 * F + j]), u = to_float(gu[r * 2 * F + F + j]);
    h[i] = from_float<T>(g * sigmoid_f(g) * u);
  }
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgu, const T* dh, const T* gu, std::size_t n, std::size_t F) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t r = i / F, j = i % F;
    const float g = to_float(gu[r * 2 * F + j]), u = to_float(gu[r * 2 * F + F + j]);
    const float d = to_float(dh[i]), s = sigmoid_f(g);
    dgu[r * 2 * F + j] = from_float<T>(d * u * s * (1.0f + g * (1.0f - s)));
    dgu[r * 2 * F + F + j] = from_float<T>(d * g * s);
  }
}

}  // namespace detail

template <class T>
void swiglu_forward(cudaStream_t stream, T* h, const T* gu, int N, int F) {
  static_assert(is_element_v<T>, "swiglu_forward: element type must be float or fived::bf16");
  const std::size_t n = static_cast<std::size_t>(N) * static_cast<std::size_t>(F);
  if (n == 0) return;
  detail::swiglu_forward_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(h), dev(gu), n,
                                                                              static_cast<std::size_t>(F));
  FIVED_CUDA_CHECK_LAUNCH("swiglu_forward_kernel");
}

template <class T>
void swiglu_backward(cudaStream_t stream, T* dgu, const T* dh, const T* gu, int N, int F) {
  static_assert(is_element_v<T>, "swiglu_backward: element type must be float or fived::bf16");
  const std::size_t n = static_cast<std::size_t>(N) * static_cast<std::size_t>(F);
  if (n == 0) return;
  detail::swiglu_backward_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(dgu), dev(dh), dev(gu), n,
                                                                               static_cast<std::size_t>(F));
  FIVED_CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}

}  // namespace fived::kernels::cuda
