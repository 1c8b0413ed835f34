#pragma once
// Host pieces of global gradient-norm clipping. The caller sums sum_of_squares over
// all gradient tensors (and, in parallel runs, all-reduces it over the mesh axes
// where gradients are sharded), then takes
//   factor = clip_factor(total, max_norm) = min(1, max_norm / (sqrt(total) + 1e-6))
// and scales every gradient by it. The sum is returned in double whatever T is, so
// summing many tensors (and ranks) loses nothing to float accumulation.

#include <cmath>
#include <cstddef>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

template <class T>
double sum_of_squares(const T* g, std::size_t n) {
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(static_cast<acc_t<T>>(g[i]));
    s += x * x;
  }
  return s;
}

// factor arrives in double and is rounded once to the precision the gradient is computed
// in (acc_t<T>): a double model's 1/3 stays a double's 1/3.
template <class T>
void scale(T* g, std::size_t n, double factor) {
  using A = acc_t<T>;
  const A f = static_cast<A>(factor);
  for (std::size_t i = 0; i < n; ++i) g[i] = static_cast<T>(static_cast<A>(g[i]) * f);
}

inline double clip_factor(double total_sum_of_squares, double max_norm) {
  const double f = max_norm / (std::sqrt(total_sum_of_squares) + 1e-6);
  return f < 1.0 ? f : 1.0;
}

}  // namespace fived::kernels::host
