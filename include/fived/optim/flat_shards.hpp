#pragma once
// The data-parallel layout of one flat buffer (parameters or gradients), at compile time.
//
//   using S = fived::FlatShards<GptLayout<cfg>::size, /*dp=*/4>;
//   S::padded            // size rounded up so the DP shards are equal and aligned
//   S::shard_size        // padded / dp, a multiple of `align` elements
//   S::shard(r)          // [r * shard_size, (r + 1) * shard_size): rank r's piece of the padded buffer
//   S::owned(r)          // shard(r) clipped to the real elements [0, size) (may be empty)
//
//   using Bk = fived::FlatBuckets<GptLayout<cfg>::size, sizeof(float), 25 << 20>;
//   Bk::count, Bk::bucket(i)   // [i * elements, ...) over the real elements; the last may be short
//
// Padding elements exist only in buffers made for collectives (reduce-scatter and all-gather
// need equal blocks); the model's own buffers hold `size` elements. A collective over a
// padded buffer carries zeros in [size, padded).

#include <cstddef>

#include "fived/optim/adamw.hpp"  // FlatRange

namespace fived {

// `Size` elements split over `DP` ranks; every shard is `Align` elements aligned (64 floats =
// 256 bytes by default, the alignment NCCL and vector loads like).
template <std::size_t Size, int DP, std::size_t Align = 64>
struct FlatShards {
  static_assert(DP >= 1, "FlatShards: the data-parallel size must be at least 1");
  static_assert(Align >= 1, "FlatShards: the alignment is a number of elements, at least 1");
  static constexpr std::size_t size = Size;
  static constexpr int dp = DP;
  static constexpr std::size_t align = Align;
  static constexpr std::size_t quantum = static_cast<std::size_t>(DP) * Align;
  static constexpr std::size_t padded = (Size + quantum - 1) / quantum * quantum;
  static constexpr std::size_t shard_size = padded / static_cast<std::size_t>(DP);
  static constexpr std::size_t padding = padded - Size;

  static constexpr FlatRange shard(int r) {
    return {static_cast<std::size_t>(r) * shard_size, static_cast<std::size_t>(r + 1) * shard_size};
  }
  // The real elements of rank r's shard (what its optimizer owns).
  static constexpr FlatRange owned(int r) {
    const FlatRange s = shard(r);
    const std::size_t b = s.begin < Size ? s.begin : Size, e = s.end < Size ? s.end : Size;
    return {b, e};
  }
  // The rank whose shard holds element i (i < padded).
  static constexpr int owner(std::size_t i) { return static_cast<int>(i / shard_size); }

  static_assert(padded >= Size && padded % quantum == 0 && padding < quantum);
};

// Buckets of `BucketBytes` (rounded down to whole elements of `ElemBytes`) over `Size`
// elements, for bucketed all-reduce. The last bucket holds the remainder.
template <std::size_t Size, std::size_t ElemBytes, std::size_t BucketBytes>
struct FlatBuckets {
  static_assert(ElemBytes >= 1 && BucketBytes >= ElemBytes,
                "FlatBuckets: a bucket must hold at least one element (BucketBytes >= the element size)");
  static constexpr std::size_t size = Size;
  static constexpr std::size_t elements = BucketBytes / ElemBytes;  // per full bucket
  static constexpr std::size_t count = Size == 0 ? 0 : (Size + elements - 1) / elements;
  static constexpr FlatRange bucket(std::size_t i) {
    const std::size_t b = i * elements, e = b + elements;
    return {b, e < Size ? e : Size};
  }
};

}  // namespace fived
