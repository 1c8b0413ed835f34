#pragma once
// ShardLayout: where one rank's piece of a tensor sits in the global tensor.
//
// The global shape is a runtime value (batch and sequence sizes come from the
// data); the mesh, the rank of the tensor and the placements are types. When
// several axes shard the same dimension, the faster axis (tp before cp before
// dp before pp) cuts the finer pieces, matching the rank order: neighbours in
// the TP group hold neighbouring pieces.

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "fived/mesh/mesh.hpp"
#include "fived/place/placement.hpp"

namespace fived {

template <MeshType M, std::size_t Rank, class PS>
class ShardLayout {
  static_assert(Rank >= 1, "a sharded tensor needs at least one dimension");
  static_assert(PS::max_shard_dim() < static_cast<int>(Rank),
                "a Shard<d> placement names dimension d, but the tensor has fewer dimensions than d+1");

 public:
  using mesh = M;
  using placements = PS;
  static constexpr std::size_t rank = Rank;
  using Shape = std::array<std::int64_t, Rank>;

  // How many pieces dimension d is cut into.
  static constexpr int splits(int d) {
    int n = 1;
    for (Axis a : world_axes)
      if (PS::shards(a, d)) n *= M::extent(a);
    return n;
  }

  // True when no faster axis shards dimension d besides `a` (which must shard it).
  static constexpr bool innermost(Axis a, int d) {
    for (Axis b : world_axes) {
      if (b == a) return PS::shards(a, d);
      if (PS::shards(b, d) && M::extent(b) > 1) return false;
    }
    return false;
  }

  ShardLayout(Shape global, Coord coord) : global_(global), coord_(coord) {
    for (std::size_t d = 0; d < Rank; ++d) {
      if (global_[d] < 0) throw std::invalid_argument("ShardLayout: dimension " + std::to_string(d) + " has negative size");
      if (global_[d] % splits(static_cast<int>(d)) != 0)
        throw std::invalid_argument("cannot shard dimension " + std::to_string(d) + " of size " + std::to_string(global_[d]) +
                                    " into " + std::to_string(splits(static_cast<int>(d))) + " equal pieces over " +
                                    M::name() + ": pad the dimension to a multiple of " +
                                    std::to_string(splits(static_cast<int>(d))) + " or change the placement");
    }
  }

  const Shape& global_shape() const { return global_; }
  const Coord& coord() const { return coord_; }

  Shape local_shape() const {
    Shape s = global_;
    for (std::size_t d = 0; d < Rank; ++d) s[d] /= splits(static_cast<int>(d));
    return s;
  }
  std::int64_t local_size() const {
    std::int64_t n = 1;
    for (auto e : local_shape()) n *= e;
    return n;
  }
  std::int64_t global_size() const {
    std::int64_t n = 1;
    for (auto e : global_) n *= e;
    return n;
  }
  // Index of this rank's piece along dimension d (mixed radix, faster axes finer).
  std::int64_t piece(int d) const {
    std::int64_t idx = 0, w = 1;
    for (Axis a : world_axes)
      if (PS::shards(a, d)) idx += coord_[a] * w, w *= M::extent(a);
    return idx;
  }
  // Global index where this rank's piece starts, per dimension.
  Shape offset() const {
    Shape o{};
    const Shape l = local_shape();
    for (std::size_t d = 0; d < Rank; ++d) o[d] = piece(static_cast<int>(d)) * l[d];
    return o;
  }

  // The same tensor with axis A placed as P.
  template <Axis A, class P>
  using with = ShardLayout<M, Rank, typename PS::template with<A, P>>;

 private:
  Shape global_;
  Coord coord_;
};

}  // namespace fived
