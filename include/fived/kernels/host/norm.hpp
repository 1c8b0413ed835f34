#pragma once
// Host pieces of global gradient-norm clipping. The caller sums sum_of_squares over
// all gradient tensors (and, in parallel runs, all-reduces it over the mesh axes
// where gradients are sharded), then takes
//   factor = clip_factor(total, max_norm) = min(1, max_norm / (sqrt(total) + 1e-6))
// and scales every gradient by it. The sum is returned in double whatever T is, so
// summing many tensors (and ranks) loses nothing to float accumulation.
//
//   sum_of_squares_chunks(out, partials, base, chunks, count)
//     *out = the sum of squares of the chunks of one array (SquaresChunk, below: elements
//     [begin, end) of base), written, not added: partials[i] = chunk i's sum, then their sum
//     in chunk order. A device runs it as two launches, a block per chunk and one block for
//     the sum in order, whatever the number of tensors: the norm of a trainer's gradient in
//     two launches, where a sum per bucket cost a GPT-2 step two launches for each of its 68.
//   add_scalar(into, x)   *into += *x, one double (the parts of a norm, on the device)

#include <cmath>
#include <cstddef>

#include "fived/device/bf16.hpp"

namespace fived {
// A piece of the array sum_of_squares_chunks reads: elements [begin, end), at most
// max_elements (a device gives each chunk one block: 16Ki elements are eight 16-byte bf16
// loads a thread of 256).
struct SquaresChunk {
  static constexpr std::size_t max_elements = std::size_t{1} << 14;
  std::size_t begin = 0, end = 0;
};
}  // namespace fived

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

// out = x * factor over n accumulators (stat_t), in their own precision.
template <class A>
void scale_acc(A* out, const A* x, std::size_t n, double factor) {
  const A f = static_cast<A>(factor);
  for (std::size_t i = 0; i < n; ++i) out[i] = x[i] * f;
}

inline double clip_factor(double total_sum_of_squares, double max_norm) {
  const double f = max_norm / (std::sqrt(total_sum_of_squares) + 1e-6);
  return f < 1.0 ? f : 1.0;
}

template <class T>
void sum_of_squares_chunks(double* out, double* partials, const T* base, const SquaresChunk* chunks, std::size_t count) {
  double s = 0;
  for (std::size_t i = 0; i < count; ++i) {
    partials[i] = sum_of_squares(base + chunks[i].begin, chunks[i].end - chunks[i].begin);
    s += partials[i];
  }
  *out = s;
}

inline void add_scalar(double* into, const double* x) { *into += *x; }

}  // namespace fived::kernels::host
