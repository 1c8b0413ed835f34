#pragma once
// Residual add, contract of fived/kernels/host/residual.hpp:
//   residual_forward(s, out, a, b, n)      out = a + b (out may alias a or b)

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

template <class T>
struct ResidualAdd {
  T* out;
  const T* a;
  const T* b;
  template <int W>
  __device__ void at(std::size_t i) const {
    float x[W], y[W];
    load_elems<W>(x, a + i);
    load_elems<W>(y, b + i);
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] += y[k];
    store_elems<W>(out + i, x);
  }
};

}  // namespace detail

template <class T>
void residual_forward(cudaStream_t stream, T* out, const T* a, const T* b, std::size_t n) {
  static_assert(is_element_v<T>, "residual_forward: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::launch_elementwise<T>(stream, "residual_forward", n, detail::ResidualAdd<device_t<T>>{dev(out), dev(a), dev(b)},
                                detail::aligned16({out, a, b}));
}

}  // namespace fived::kernels::cuda
