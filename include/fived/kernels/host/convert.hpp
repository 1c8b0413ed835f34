#pragma once
// Host conversions: to_fp32, dst[i] = float(src[i]) (fp32 master weights from bf16
// parameters); from_acc, dst[i] = T(src[i]) (a result summed in acc_t<T>, rounded once).

#include <cstddef>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

template <class T>
void to_fp32(float* dst, const T* src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <class T>
void from_acc(T* dst, const acc_t<T>* src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

}  // namespace fived::kernels::host
