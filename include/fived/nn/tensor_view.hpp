#pragma once
// TensorView: a named tensor inside a flat parameter or gradient buffer (nn/param_table.hpp),
// what Decoder::param(name) and grad(name) return. Device memory on Cuda: for passing on,
// not for indexing.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "fived/nn/param_table.hpp"

namespace fived {

// A named tensor inside a flat buffer (device memory on Cuda: for passing on, not indexing).
template <class T>
struct TensorView {
  const ParamInfo* info = nullptr;
  std::span<T> data;

  std::string name() const { return info->name(); }
  std::int64_t rows() const { return info->rows; }
  std::int64_t cols() const { return info->cols; }
  int rank() const { return info->rank(); }
  std::size_t size() const { return data.size(); }
  T& operator[](std::size_t i) const { return data[i]; }
  T& operator()(std::int64_t r, std::int64_t c) const { return data[static_cast<std::size_t>(r * info->cols + c)]; }
};

}  // namespace fived
