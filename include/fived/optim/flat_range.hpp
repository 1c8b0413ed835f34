#pragma once
// [begin, end) of a flat buffer (parameters, gradients, optimizer state).

#include <cstddef>

namespace fived {

struct FlatRange {
  std::size_t begin = 0;
  std::size_t end = 0;
  constexpr std::size_t size() const { return end - begin; }
  constexpr bool empty() const { return end <= begin; }
  constexpr bool contains(const FlatRange& r) const { return r.begin >= begin && r.end <= end; }
  friend constexpr bool operator==(const FlatRange&, const FlatRange&) = default;
};

}  // namespace fived
