#pragma once
// Placements: how a tensor lives on one mesh axis.
//
//   Replicate   every rank of the axis holds the whole tensor
//   Shard<d>    rank i of the axis holds the i-th equal slice along dimension d
//   Partial     every rank holds a tensor of the full shape; the value is their sum
//
// PlacementSet gives one placement per world axis; users write
// Placements<On<Axis::tp, Shard<1>>, ...> and omitted axes are Replicate.

#include <algorithm>
#include <type_traits>

#include "fived/mesh/axis.hpp"

namespace fived {

struct Replicate {};
struct Partial {};
template <int D>
struct Shard {
  static_assert(D >= 0, "Shard<d> needs a dimension d >= 0");
  static constexpr int dim = D;
};

template <class P> struct is_shard : std::false_type {};
template <int D> struct is_shard<Shard<D>> : std::true_type {};
template <class P> inline constexpr bool is_shard_v = is_shard<P>::value;

template <class P>
concept PlacementTag = std::is_same_v<P, Replicate> || std::is_same_v<P, Partial> || is_shard_v<P>;

// The placement of a gradient, given the placement of its value: the
// adjoint of replication is summation, so Replicate and Partial trade places;
// a shard's gradient is the same shard.
template <class P> struct dual { using type = P; };
template <> struct dual<Replicate> { using type = Partial; };
template <> struct dual<Partial> { using type = Replicate; };
template <class P> using dual_t = typename dual<P>::type;

// A placement on one named world axis.
template <Axis A, class P>
struct On {
  static_assert(is_world_axis(A), "placements are given on world axes (tp, cp, dp, pp); EP is a view, not a placement axis");
  static_assert(PlacementTag<P>, "On<axis, P>: P must be Replicate, Partial or Shard<d>");
  static constexpr Axis axis = A;
  using placement = P;
};

// Canonical form: one placement per world axis, in the order tp, cp, dp, pp.
template <class Ptp, class Pcp, class Pdp, class Ppp>
struct PlacementSet {
  template <Axis A>
  using on = std::conditional_t<A == Axis::tp, Ptp, std::conditional_t<A == Axis::cp, Pcp, std::conditional_t<A == Axis::dp, Pdp, Ppp>>>;

  // The same set with axis A changed to P.
  template <Axis A, class P>
  using with = PlacementSet<std::conditional_t<A == Axis::tp, P, Ptp>, std::conditional_t<A == Axis::cp, P, Pcp>,
                            std::conditional_t<A == Axis::dp, P, Pdp>, std::conditional_t<A == Axis::pp, P, Ppp>>;

  // The placements of this tensor's gradient.
  using gradient = PlacementSet<dual_t<Ptp>, dual_t<Pcp>, dual_t<Pdp>, dual_t<Ppp>>;

  static constexpr bool shards(Axis a, int d) {
    switch (a) {
      case Axis::tp: return shard_dim<Ptp>() == d;
      case Axis::cp: return shard_dim<Pcp>() == d;
      case Axis::dp: return shard_dim<Pdp>() == d;
      default: return shard_dim<Ppp>() == d;
    }
  }
  static constexpr bool partial(Axis a) {
    switch (a) {
      case Axis::tp: return std::is_same_v<Ptp, Partial>;
      case Axis::cp: return std::is_same_v<Pcp, Partial>;
      case Axis::dp: return std::is_same_v<Pdp, Partial>;
      default: return std::is_same_v<Ppp, Partial>;
    }
  }
  static constexpr int max_shard_dim() {
    return std::max({shard_dim<Ptp>(), shard_dim<Pcp>(), shard_dim<Pdp>(), shard_dim<Ppp>()});
  }

 private:
  template <class P>
  static constexpr int shard_dim() {
    if constexpr (is_shard_v<P>) return P::dim;
    else return -1;
  }
};

namespace detail {
template <class... Ons>
struct make_placements {
  static constexpr int count([[maybe_unused]] Axis a) { return (0 + ... + (Ons::axis == a ? 1 : 0)); }
  static_assert(count(Axis::tp) <= 1 && count(Axis::cp) <= 1 && count(Axis::dp) <= 1 && count(Axis::pp) <= 1,
                "Placements<...> gives a placement for the same axis twice: give each axis at most once");
  // picks the placement of the On<> with axis A (Replicate when absent)
  template <Axis A, class... Rest> struct pick { using type = Replicate; };
  template <Axis A, class First, class... Rest>
  struct pick<A, First, Rest...> {
    using type = std::conditional_t<First::axis == A, typename First::placement, typename pick<A, Rest...>::type>;
  };
  using type = PlacementSet<typename pick<Axis::tp, Ons...>::type, typename pick<Axis::cp, Ons...>::type,
                            typename pick<Axis::dp, Ons...>::type, typename pick<Axis::pp, Ons...>::type>;
};
}  // namespace detail

// Placements<On<Axis::tp, Shard<0>>, On<Axis::dp, Partial>>; omitted axes are Replicate.
template <class... Ons>
using Placements = typename detail::make_placements<Ons...>::type;

using Replicated = Placements<>;

}  // namespace fived
