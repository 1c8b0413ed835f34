#pragma once
// Host AdamW (decoupled weight decay, Loshchilov & Hutter), one step over n values:
//   w -= lr * weight_decay * w
//   m  = beta1 m + (1 - beta1) g
//   v  = beta2 v + (1 - beta2) g^2
//   w -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
// step counts from 1. With fp32 master weights (master != nullptr) w is the master
// copy, the update is in float, and param = T(master) afterwards: bf16 parameters
// never accumulate rounding error over steps. With master == nullptr the update is
// done on param itself, in acc_t<T>; that is only allowed for T = float or double
// (a bf16 parameter without a master copy throws). The moments m and v are float.
// Weight decay is applied to whatever tensor it is given: the caller passes
// weight_decay = 0 for biases, LayerNorm parameters and embeddings if it wants the
// GPT-2 convention.

#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

template <class T>
void adamw_update(T* param, float* master, const T* grad, float* m, float* v, std::size_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int step) {
  if (step < 1)
    throw std::invalid_argument("fived::kernels::host::adamw_update: step counts from 1 (got " + std::to_string(step) +
                                ")");
  if (master == nullptr && !(std::is_same_v<T, float> || std::is_same_v<T, double>))
    throw std::invalid_argument(
        "fived::kernels::host::adamw_update: a bf16 parameter needs fp32 master weights (master is nullptr)");
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const A b1 = beta1, b2 = beta2, e = eps, wd = weight_decay, l = lr;
  const A bc1 = A(1) - std::pow(b1, static_cast<A>(step));
  const A bc2 = A(1) - std::pow(b2, static_cast<A>(step));
  for (std::size_t i = 0; i < n; ++i) {
    const A g = static_cast<A>(grad[i]);
    const A mi = b1 * static_cast<A>(m[i]) + (A(1) - b1) * g;
    const A vi = b2 * static_cast<A>(v[i]) + (A(1) - b2) * g * g;
    m[i] = static_cast<float>(mi);
    v[i] = static_cast<float>(vi);
    A w = master != nullptr ? static_cast<A>(master[i]) : static_cast<A>(param[i]);
    w -= l * wd * w;
    w -= l * (mi / bc1) / (std::sqrt(vi / bc2) + e);
    if (master != nullptr) {
      master[i] = static_cast<float>(w);
      param[i] = static_cast<T>(master[i]);
    } else {
      param[i] = static_cast<T>(w);
    }
  }
}

}  // namespace fived::kernels::host
