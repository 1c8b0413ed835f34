#pragma once
// Host block regrouping around one dimension, for the collectives of redistribute.
//
//   regroup(out, in, outer, n, block, Blocks::split)   [outer][n][block] -> [n][outer][block]
//   regroup(out, in, outer, n, block, Blocks::join)    [n][outer][block] -> [outer][n][block]
//
// A row-major tensor viewed as [outer][n * block] around dimension d (outer = the
// product of the dimensions before d, block = its n-th part times the dimensions
// after d) is cut into n pieces along d that are not contiguous unless outer == 1.
// A collective sends to or receives from rank k one contiguous block, so split
// gathers piece k into block k, and join puts the blocks back. join undoes split.
// Pure data movement, for any trivially copyable T; out and in must not overlap.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace fived::kernels::host {

// Which way regroup moves the blocks (one enum for both backends).
enum class Blocks { split, join };

namespace detail_regroup {
inline void check_sizes(const char* backend, std::int64_t outer, int n, std::int64_t block) {
  if (outer < 0 || n < 1 || block < 0)
    throw std::invalid_argument(std::string("fived::kernels::") + backend +
                                "::regroup: needs outer >= 0, n >= 1 and block >= 0 (got outer=" +
                                std::to_string(outer) + ", n=" + std::to_string(n) +
                                ", block=" + std::to_string(block) + ")");
}
}  // namespace detail_regroup

template <class T>
void regroup(T* out, const T* in, std::int64_t outer, int n, std::int64_t block, Blocks how) {
  static_assert(std::is_trivially_copyable_v<T>, "regroup moves elements as bytes: T must be trivially copyable");
  detail_regroup::check_sizes("host", outer, n, block);
  for (std::int64_t o = 0; o < outer; ++o)
    for (int k = 0; k < n; ++k) {
      const std::int64_t joined = (o * n + k) * block, split = (k * outer + o) * block;
      const std::int64_t from = how == Blocks::split ? joined : split, to = how == Blocks::split ? split : joined;
      std::copy_n(in + from, block, out + to);
    }
}

}  // namespace fived::kernels::host
