#pragma once
// Residual add, contract of fived/kernels/host/residual.hpp:
//   residual_forward(s, out, a, b, n)      out = a + b (out may alias a or b)
//   add_acc(s, into, x, n)                 into += x over float accumulators

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

struct Add {
  __device__ float operator()(float x, float y) const { return x + y; }
};

}  // namespace detail

template <class T>
void residual_forward(cudaStream_t stream, T* out, const T* a, const T* b, std::size_t n) {
  static_assert(is_element_v<T>, "residual_forward: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::launch_elementwise<T>(stream, "residual_forward", n, detail::MapBinary<device_t<T>, detail::Add>{dev(out), dev(a), dev(b), {}},
                                detail::aligned16({out, a, b}));
}

inline void add_acc(cudaStream_t stream, float* into, const float* x, std::size_t n) {
  residual_forward(stream, into, into, x, n);
}

}  // namespace fived::kernels::cuda
