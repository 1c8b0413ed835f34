#pragma once
// How data parallelism cuts one rank's flat parameter and gradient buffers, at compile time.
//
//   using P = fived::BucketPlan<Model::layout, /*dp=*/4, sizeof(bf16), 4 << 20>;   // any ParamTable
//   P::count                  // number of buckets
//   P::bucket(i)              // {range, padded, unit, shard_offset}
//   P::shard_size(i)          // padded / DP: every rank's piece of bucket i, padding included
//   P::owned(i, r)            // the real elements of rank r's piece (may be empty)
//   P::buckets_of(u)          // [first, last) bucket indices of unit u
//   P::shard_total            // what a rank holds of a sharded buffer: the sum of its pieces
//
// Buckets never cross a unit. A layout's units (Layout::units, Layout::unit_begin(u)) are
// for a transformer the embeddings, each layer, and the final norm with the head. So a bucket is
// complete as soon as backward finishes its unit, and ZeRO-3 gathers a unit as whole
// buckets. A unit larger than BucketBytes is cut into buckets of BucketBytes, the last
// one shorter. A layout without units is a single unit.
//
// A tensor that another pipeline stage holds too (Layout::tied_range, where the layout has
// one: the word embedding that a tied head multiplies by) is cut into buckets of its own,
// from its first element. So every stage that holds it cuts it alike, each DP rank owns the
// same elements of it on each stage, and the stages can add their gradients of it piece by
// piece (pipeline/tied_grads.hpp).
//
// Each bucket is reduce-scattered and all-gathered in DP equal pieces. Its size is rounded up
// to a multiple of DP * Align elements (`padded`, Align = 64 elements = 256 bytes in fp32, the
// alignment NCCL and vector loads like). Rank r's piece is [begin + r*s, begin + (r+1)*s) with
// s = padded / DP, and the real elements of it are the ones it owns. The padding exists only
// in the staging buffer of a collective; the model's buffers hold exactly Layout::size
// elements. This is Megatron's per-bucket sharding, not one contiguous shard per rank: a
// rank's optimizer state is a piece of every bucket, so each bucket can be reduced the
// moment backward has finished it.
//
// A sharded buffer on a rank (ZeRO-2 gradients, ZeRO-3 parameters) stores its pieces one
// after the other: bucket i's piece starts at bucket(i).shard_offset, and its owned elements
// come first in it.

#include <array>
#include <cstddef>

#include "fived/optim/flat_range.hpp"

namespace fived {

struct Bucket {
  FlatRange range;                // the real elements, in the flat buffer
  std::size_t padded = 0;         // range.size() rounded up to a multiple of DP * Align
  int unit = 0;                   // the layout unit that holds it
  std::size_t shard_offset = 0;   // where a rank's piece starts in a sharded buffer
};

template <class Layout, int DP, std::size_t ElemBytes, std::size_t BucketBytes, std::size_t Align = 64>
struct BucketPlan {
  static_assert(DP >= 1, "fived::BucketPlan: the data-parallel size must be at least 1");
  static_assert(Align >= 1, "fived::BucketPlan: the alignment is a number of elements, at least 1");
  static_assert(ElemBytes >= 1 && BucketBytes >= ElemBytes,
                "fived::BucketPlan: a bucket must hold at least one element (BucketBytes >= the element size)");

  static constexpr std::size_t size = Layout::size;
  static constexpr int dp = DP;
  static constexpr std::size_t elements = BucketBytes / ElemBytes;  // in a full bucket
  static constexpr std::size_t quantum = static_cast<std::size_t>(DP) * Align;
  static constexpr bool has_units = requires { Layout::units; Layout::unit_begin(0); };

  static constexpr int units = [] {
    if constexpr (has_units) return Layout::units;
    else return 1;
  }();
  static constexpr FlatRange unit(int u) {
    if constexpr (has_units) return {Layout::unit_begin(u), Layout::unit_begin(u + 1)};
    else return {0, size};
  }

  // The tensor shared with another pipeline stage (empty: none).
  static constexpr FlatRange tied = [] {
    if constexpr (requires { Layout::tied_range; }) return FlatRange(Layout::tied_range);
    else return FlatRange{};
  }();
  // Unit u as the stretches cut into buckets: the unit, split at the tied tensor's ends.
  static constexpr std::array<FlatRange, 3> stretches(int u) {
    const FlatRange r = unit(u);
    if (tied.empty() || !r.contains(tied)) return {r, FlatRange{}, FlatRange{}};
    return {FlatRange{r.begin, tied.begin}, tied, FlatRange{tied.end, r.end}};
  }
  static_assert(tied.empty() ||
                    [] {
                      for (int u = 0; u < units; ++u)
                        if (unit(u).contains(tied)) return true;
                      return false;
                    }(),
                "fived::BucketPlan: the layout's tied tensor must lie inside one unit");

  static constexpr std::size_t count = [] {
    std::size_t n = 0;
    for (int u = 0; u < units; ++u)
      for (const FlatRange& s : stretches(u)) n += (s.size() + elements - 1) / elements;
    return n;
  }();

 private:
  static constexpr std::array<Bucket, count> build() {
    std::array<Bucket, count> b{};
    std::size_t i = 0, shard = 0;
    for (int u = 0; u < units; ++u)
      for (const FlatRange& s : stretches(u))
        for (std::size_t at = s.begin; at < s.end; at += elements, ++i) {
          const std::size_t end = at + elements < s.end ? at + elements : s.end;
          const std::size_t padded = (end - at + quantum - 1) / quantum * quantum;
          b[i] = Bucket{{at, end}, padded, u, shard};
          shard += padded / static_cast<std::size_t>(DP);
        }
    return b;
  }

 public:
  static constexpr std::array<Bucket, count> buckets = build();

  static constexpr const Bucket& bucket(std::size_t i) { return buckets[i]; }
  static constexpr std::size_t shard_size(std::size_t i) { return buckets[i].padded / static_cast<std::size_t>(DP); }
  // Rank r's piece of bucket i, in flat-buffer offsets (it may reach past the real elements).
  static constexpr FlatRange piece(std::size_t i, int r) {
    const std::size_t b = buckets[i].range.begin + static_cast<std::size_t>(r) * shard_size(i);
    return {b, b + shard_size(i)};
  }
  // The real elements of rank r's piece of bucket i: what its optimizer owns there.
  static constexpr FlatRange owned(std::size_t i, int r) {
    const FlatRange p = piece(i, r);
    const std::size_t e = buckets[i].range.end;
    return {p.begin < e ? p.begin : e, p.end < e ? p.end : e};
  }
  // The buckets of unit u: indices [buckets_of(u).begin, buckets_of(u).end).
  static constexpr FlatRange buckets_of(int u) {
    std::size_t first = 0;
    while (first < count && buckets[first].unit < u) ++first;
    std::size_t last = first;
    while (last < count && buckets[last].unit == u) ++last;
    return {first, last};
  }

  static constexpr std::size_t shard_total = [] {
    std::size_t s = 0;
    for (std::size_t i = 0; i < count; ++i) s += shard_size(i);
    return s;
  }();
  static constexpr std::size_t padded_total = shard_total * static_cast<std::size_t>(DP);
  static constexpr std::size_t max_padded = [] {
    std::size_t m = 0;
    for (std::size_t i = 0; i < count; ++i) m = buckets[i].padded > m ? buckets[i].padded : m;
    return m;
  }();
  // Elements rank r owns over all buckets (they sum to `size` over the ranks).
  static constexpr std::size_t owned_total(int r) {
    std::size_t s = 0;
    for (std::size_t i = 0; i < count; ++i) s += owned(i, r).size();
    return s;
  }
};

}  // namespace fived
