#pragma once
// Host GELU, tanh approximation (as GPT-2 and llm.c):
//   gelu(x)  = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// computed through its sigmoid form (below).
// Elementwise over n values, computed in acc_t<T>. The backward overwrites:
// dinp = dout * gelu'(inp), and dinp may alias dout (each element is read before
// it is written), so the MLP backward can turn d(gelu output) into d(pre-activation)
// in place. The same scalar functions serve the GEMM's GELU epilogue (gemm.hpp).

#include <cmath>
#include <cstddef>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

namespace detail_gelu {

// Both through 0.5 (1 + tanh u) = s = 1 / (1 + e), e = e^-2u, as the CUDA kernels
// (kernels/cuda/common.hpp): one exponential and no tanh (glibc's is several times its exp; it
// was a fifth of the demo's time), and no cancellation where tanh u nears -1.
template <class A>
inline constexpr A two_k = static_cast<A>(2 * 0.7978845608028654);  // 2 sqrt(2/pi)
template <class A>
inline constexpr A cubic = static_cast<A>(0.044715);

template <class A>
inline A two_u(A x) {  // 2u = 2 sqrt(2/pi) (x + 0.044715 x^3)
  return two_k<A> * x * (static_cast<A>(1) + cubic<A> * x * x);
}

template <class A>
inline A gelu(A x) {
  return x / (static_cast<A>(1) + std::exp(-two_u(x)));  // x s; where e overflows, 0
}

// gelu' = s + x s (1 - s) 2u', with s (1 - s) as e s^2 (1 - s would cancel where s nears 1).
// Where e would overflow (-2u over 88 in float, 709 in double) the gradient is 0 to the type's
// precision.
template <class A>
inline A gelu_grad(A x) {
  const A minus_2u = -two_u(x);
  if (minus_2u > static_cast<A>(sizeof(A) == sizeof(float) ? 88 : 709)) return static_cast<A>(0);
  const A e = std::exp(minus_2u);
  const A s = static_cast<A>(1) / (static_cast<A>(1) + e);
  return s + x * (e * s * s) * two_k<A> * (static_cast<A>(1) + static_cast<A>(3) * cubic<A> * x * x);
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
