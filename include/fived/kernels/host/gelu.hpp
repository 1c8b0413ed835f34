#pragma once
// Host GELU, tanh approximation (as GPT-2 and llm.c):
//   gelu(x)  = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// Elementwise over n values, computed in acc_t<T>. The backward overwrites:
// dinp = dout * gelu'(inp), and dinp may alias dout (each element is read before
// it is written), so the MLP backward can turn d(gelu output) into d(pre-activation)
// in place. The same scalar functions serve the GEMM's GELU epilogue (gemm.hpp).

#include <cmath>
#include <cstddef>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

namespace detail_gelu {

template <class A>
inline A gelu(A x) {
  const A s = static_cast<A>(0.7978845608028654);  // sqrt(2/pi)
  const A c = static_cast<A>(0.044715);
  return static_cast<A>(0.5) * x * (static_cast<A>(1) + std::tanh(s * (x + c * x * x * x)));
}

template <class A>
inline A gelu_grad(A x) {
  const A s = static_cast<A>(0.7978845608028654);
  const A c = static_cast<A>(0.044715);
  const A t = std::tanh(s * (x + c * x * x * x));
  return static_cast<A>(0.5) * (static_cast<A>(1) + t) +
         static_cast<A>(0.5) * x * (static_cast<A>(1) - t * t) * s * (static_cast<A>(1) + static_cast<A>(3) * c * x * x);
}

}  // namespace detail_gelu

template <class T>
void gelu_forward(T* out, const T* inp, std::size_t n) {
  using A = acc_t<T>;
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<T>(detail_gelu::gelu(static_cast<A>(inp[i])));
}

template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::size_t n) {
  using A = acc_t<T>;
  for (std::size_t i = 0; i < n; ++i)
    dinp[i] = static_cast<T>(static_cast<A>(dout[i]) * detail_gelu::gelu_grad(static_cast<A>(inp[i])));
}

}  // namespace fived::kernels::host
