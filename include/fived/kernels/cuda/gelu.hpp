#pragma once
// GELU (tanh approximation, as GPT-2), contract of fived/kernels/host/gelu.hpp:
//   gelu_forward(s, out, inp, n)
//   gelu_backward(s, dinp, inp, dout, n)    dinp = dout * gelu'(inp); dinp may alias dout
// Elementwise (16-byte accesses where aligned), float math (gelu_f, gelu_grad_f: one fast
// exponential and reciprocal an element).

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

struct Gelu {
  __device__ float operator()(float x) const { return gelu_f(x); }
};
struct GeluGradTimes {  // (inp, dout) -> dout * gelu'(inp)
  __device__ float operator()(float x, float d) const { return d * gelu_grad_f(x); }
};

}  // namespace detail

template <class T>
void gelu_forward(cudaStream_t stream, T* out, const T* inp, std::size_t n) {
  static_assert(is_element_v<T>, "gelu_forward: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::launch_elementwise<T>(stream, "gelu_forward", n,
                                detail::MapUnary<device_t<T>, detail::Gelu>{dev(out), dev(inp), {}},
                                detail::aligned16({out, inp}));
}

template <class T>
void gelu_backward(cudaStream_t stream, T* dinp, const T* inp, const T* dout, std::size_t n) {
  static_assert(is_element_v<T>, "gelu_backward: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::launch_elementwise<T>(stream, "gelu_backward", n,
                                detail::MapBinary<device_t<T>, detail::GeluGradTimes>{dev(dinp), dev(inp), dev(dout), {}},
                                detail::aligned16({dinp, inp, dout}));
}

}  // namespace fived::kernels::cuda
