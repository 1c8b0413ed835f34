#pragma once
// [begin, end) of a flat buffer (parameters, gradients, optimizer state), and a range an
// optimizer owns with where it lies (OwnedRange).

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

// A range of the flat buffer an optimizer owns, and where its update finds it: the range's
// first parameter at params[param_at], its first gradient at grads[grad_at] of the arrays
// the update is given (OwnedRange{r}: at r's own offsets, in whole flat buffers; a ZeRO
// rank's pieces are packed in buffers of their own).
struct OwnedRange {
  FlatRange range;
  std::size_t param_at = range.begin, grad_at = range.begin;
};

}  // namespace fived
