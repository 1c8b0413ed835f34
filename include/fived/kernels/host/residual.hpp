#pragma once
// Host residual add: out = a + b elementwise over n values (sum in acc_t<T>, one
// rounding to T). out may alias a or b. The backward of a residual add is the
// identity on both branches, which the "+=" input gradients of the other kernels
// (layernorm dinp, matmul with accumulate) already express, so there is no
// residual_backward.

#include <cstddef>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

template <class T>
void residual_forward(T* out, const T* a, const T* b, std::size_t n) {
  using A = acc_t<T>;
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<T>(static_cast<A>(a[i]) + static_cast<A>(b[i]));
}

// into += x over n accumulators (stat_t: float or double), as residual_forward adds.
template <class A>
void add_acc(A* into, const A* x, std::size_t n) {
  residual_forward(into, into, x, n);
}

}  // namespace fived::kernels::host
