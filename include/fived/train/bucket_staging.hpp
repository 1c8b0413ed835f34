#pragma once
// One bucket's collectives over a data-parallel group under ZeRO, through a padded staging
// buffer: a bucket is reduce-scattered and all-gathered in DP equal pieces of its padded size
// (train/bucket_plan.hpp: a multiple of DP x 64 elements), so the real elements are copied in,
// the padding zeroed, and the collective runs on the whole. One bucket's worth is allocated,
// once, and reused by every bucket.
//
//   BucketStaging<Plan, T, Device> staging(ops);
//   std::span<const T> piece = staging.reduce_scatter(ops, comm, i, grads_of_bucket_i);   // averaged
//   staging.all_gather(ops, comm, i, my_piece, whole_buffer);                              // bucket i's range

#include <cstddef>
#include <span>

#include "fived/comm/types.hpp"
#include "fived/device/buffer.hpp"

namespace fived {

template <class Plan, class T, class Device>
class BucketStaging {
  static constexpr int DP = Plan::dp;

 public:
  BucketStaging() = default;  // holds nothing (no ZeRO)
  template <class Ops>
  explicit BucketStaging(Ops& ops)
      : whole_(ops.template make_buffer<T>(Plan::max_padded)), piece_(ops.template make_buffer<T>(Plan::max_padded / DP)) {}

  // Bucket i's gradient g (its real elements) reduce-scattered with the average over the
  // group: this rank's piece of the padded bucket (its owned elements first).
  template <class Ops, class Comm>
  std::span<const T> reduce_scatter(Ops& ops, Comm& comm, std::size_t i, std::span<const T> g) {
    const std::size_t padded = Plan::bucket(i).padded;
    std::span<T> in = whole_.span().first(padded), out = piece_.span().first(padded / DP);
    ops.copy(in.data(), g.data(), g.size());
    ops.zero(in.data() + g.size(), in.size() - g.size());
    comm.reduce_scatter(std::span<const T>(in), out, ReduceOp::avg);
    return out;
  }

  // Every rank's piece of bucket i gathered into dst at the bucket's range (flat-buffer
  // offsets); `mine` is this rank's piece or its owned elements (the rest is padding).
  template <class Ops, class Comm>
  void all_gather(Ops& ops, Comm& comm, std::size_t i, std::span<const T> mine, std::span<T> dst) {
    const auto& bk = Plan::bucket(i);
    std::span<T> in = piece_.span().first(bk.padded / DP), out = whole_.span().first(bk.padded);
    ops.copy(in.data(), mine.data(), mine.size());
    ops.zero(in.data() + mine.size(), in.size() - mine.size());
    comm.all_gather(std::span<const T>(in), out);
    ops.copy(dst.data() + bk.range.begin, out.data(), bk.range.size());
  }

  std::size_t elements() const { return whole_.size() + piece_.size(); }

 private:
  Buffer<T, Device> whole_, piece_;
};

}  // namespace fived
