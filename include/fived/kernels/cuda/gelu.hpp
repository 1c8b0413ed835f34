#pragma once
// GELU (tanh approximation, as GPT-2), contract of fived/kernels/host/gelu.hpp:
//   gelu_forward(s, out, inp, n)
//   gelu_backward(s, dinp, inp, dout, n)    dinp = dout * gelu'(inp); dinp may alias dout
// Elementwise (16-byte accesses where aligned), float math (tanhf).

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

template <class T>
struct GeluForward {
  T* out;
  const T* inp;
  template <int W>
  __device__ void at(std::size_t i) const {
    float x[W];
    load_elems<W>(x, inp + i);
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = gelu_f(x[k]);
    store_elems<W>(out + i, x);
  }
};

template <class T>
struct GeluBackward {
  T* dinp;
  const T* inp;
  const T* dout;
  template <int W>
  __device__ void at(std::size_t i) const {
    float x[W], d[W];
    load_elems<W>(x, inp + i);
    load_elems<W>(d, dout + i);
#pragma unroll
    for (int k = 0; k < W; ++k) d[k] *= gelu_grad_f(x[k]);
    store_elems<W>(dinp + i, d);
  }
};

}  // namespace detail

template <class T>
void gelu_forward(cudaStream_t stream, T* out, const T* inp, std::size_t n) {
  static_assert(is_element_v<T>, "gelu_forward: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::launch_elementwise<T>(stream, "gelu_forward", n, detail::GeluForward<device_t<T>>{dev(out), dev(inp)},
                                detail::aligned16({out, inp}));
}

template <class T>
void gelu_backward(cudaStream_t stream, T* dinp, const T* inp, const T* dout, std::size_t n) {
  static_assert(is_element_v<T>, "gelu_backward: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::launch_elementwise<T>(stream, "gelu_backward", n,
                                detail::GeluBackward<device_t<T>>{dev(dinp), dev(inp), dev(dout)},
                                detail::aligned16({dinp, inp, dout}));
}

}  // namespace fived::kernels::cuda
