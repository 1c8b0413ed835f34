#pragma once
// Host SwiGLU (Llama's MLP activation), forward and backward, in acc_t<T>:
//   gu [N, 2F] = [gate | up] (one GEMM's output: the gate and up projections side by side)
//   h  [N, F]  = silu(gate) * up,            silu(g) = g sigmoid(g)
//   d gate = dh * up * silu'(g),  d up = dh * silu(g),  silu'(g) = s (1 + g (1 - s)), s = sigmoid(g)
// The backward overwrites dgu [N, 2F].

#include <cmath>
#include <cstddef>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

template <class T>
void swiglu_forward(T* h, const T* gu, int N, int F) {
  using A = acc_t<T>;
  const std::size_t sF = static_cast<std::size_t>(F);
  for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r)
    for (std::size_t j = 0; j < sF; ++j) {
      const A g = static_cast<A>(gu[r * 2 * sF + j]), u = static_cast<A>(gu[r * 2 * sF + sF + j]);
      h[r * sF + j] = static_cast<T>(g / (A(1) + std::exp(-g)) * u);
    }
}

template <class T>
void swiglu_backward(T* dgu, const T* dh, const T* gu, int N, int F) {
  using A = acc_t<T>;
  const std::size_t sF = static_cast<std::size_t>(F);
  for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r)
    for (std::size_t j = 0; j < sF; ++j) {
      const A g = static_cast<A>(gu[r * 2 * sF + j]), u = static_cast<A>(gu[r * 2 * sF + sF + j]);
      const A d = static_cast<A>(dh[r * sF + j]), s = A(1) / (A(1) + std::exp(-g));
      dgu[r * 2 * sF + j] = static_cast<T>(d * u * s * (A(1) + g * (A(1) - s)));
      dgu[r * 2 * sF + sF + j] = static_cast<T>(d * g * s);
    }
}

}  // namespace fived::kernels::host
