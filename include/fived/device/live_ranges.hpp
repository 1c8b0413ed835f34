#pragma once
// A set of byte ranges, kept as sorted, disjoint, non-adjacent [begin, end) pairs: what a
// releasable buffer holds live (device/cuda_pages.hpp), so that it can tell whether a chunk
// still holds a live byte however its ranges were committed and released (a range released
// twice, or in pieces, is no error).
//
//   LiveRanges live;
//   live.add(0, 100);  live.remove(10, 20);     // {[0, 10), [20, 100)}
//   live.intersects(12, 18);                    // false

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace fived {

class LiveRanges {
 public:
  using Range = std::pair<std::size_t, std::size_t>;

  LiveRanges() { ranges_.reserve(16); }

  void add(std::size_t b, std::size_t e) {
    if (b >= e) return;
    remove(b, e);
    auto at = ranges_.insert(std::lower_bound(ranges_.begin(), ranges_.end(), Range{b, e}), {b, e});
    if (at + 1 != ranges_.end() && (at + 1)->first == at->second) at->second = (at + 1)->second, ranges_.erase(at + 1);
    if (at != ranges_.begin() && (at - 1)->second == at->first) (at - 1)->second = at->second, ranges_.erase(at);
  }

  void remove(std::size_t b, std::size_t e) {
    if (b >= e) return;
    auto it = ranges_.begin();
    while (it != ranges_.end() && it->first < e) {
      const auto [lo, hi] = *it;
      if (hi <= b) {
        ++it;
      } else if (lo < b && e < hi) {  // [b, e) splits it
        it->second = b;
        ranges_.insert(it + 1, {e, hi});
        return;
      } else if (lo < b) {
        (it++)->second = b;
      } else if (e < hi) {
        (it++)->first = e;
      } else {
        it = ranges_.erase(it);
      }
    }
  }

  bool intersects(std::size_t b, std::size_t e) const {
    for (const auto& [lo, hi] : ranges_)
      if (lo < e && b < hi) return true;
    return false;
  }

  const std::vector<Range>& ranges() const { return ranges_; }

 private:
  std::vector<Range> ranges_;
};

}  // namespace fived
