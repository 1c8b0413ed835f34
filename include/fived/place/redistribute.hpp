#pragma once
// redistribute<A, To>(x, comm): change a tensor's placement on one mesh axis.
// The collective follows from the two placement types, at compile time:
//
//   from \ to    Replicate     Shard<j>         Partial
//   Replicate    -             local slice      (no rule: does not compile)
//   Shard<i>     all-gather    all-to-all       local zero-pad (adjoint of slice)
//   Partial      all-reduce    reduce-scatter   -
//
// The backward of a transition is the transition between the gradients'
// placements in the other direction: dual(To) -> dual(From), with
// dual(Replicate) = Partial, dual(Partial) = Replicate, dual(Shard) = Shard.
// The table is closed under that rule, so every forward step has a backward:
// all-gather <-> reduce-scatter, all-reduce <-> all-reduce, all-to-all <->
// all-to-all, slice <-> zero-pad.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/comm/communicator.hpp"
#include "fived/place/sharded.hpp"

namespace fived {

enum class Collective { none, all_reduce, reduce_scatter, all_gather, all_to_all, slice, pad };

constexpr std::string_view collective_name(Collective c) {
  switch (c) {
    case Collective::none: return "none";
    case Collective::all_reduce: return "all_reduce";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_gather: return "all_gather";
    case Collective::all_to_all: return "all_to_all";
    case Collective::slice: return "slice";
    case Collective::pad: return "pad";
  }
  return "?";
}

template <class From, class To>
inline constexpr bool has_transition = !(std::is_same_v<From, Replicate> && std::is_same_v<To, Partial>);

template <class From, class To>
constexpr Collective collective_for() {
  static_assert(PlacementTag<From> && PlacementTag<To>, "placements must be Replicate, Partial or Shard<d>");
  static_assert(has_transition<From, To>,
                "Replicate -> Partial has no rule: a replicated value has no canonical split into partial sums; "
                "slice it to Shard<d> instead, or keep it replicated");
  if constexpr (std::is_same_v<From, To>) return Collective::none;
  else if constexpr (std::is_same_v<From, Partial>) return std::is_same_v<To, Replicate> ? Collective::all_reduce : Collective::reduce_scatter;
  else if constexpr (std::is_same_v<From, Replicate>) return Collective::slice;
  else if constexpr (std::is_same_v<To, Replicate>) return Collective::all_gather;
  else if constexpr (std::is_same_v<To, Partial>) return Collective::pad;
  else return Collective::all_to_all;
}

// A placement change on one axis, and the one its gradient makes in backward.
template <class From, class To>
struct Transition {
  using from = From;
  using to = To;
  static constexpr Collective forward = collective_for<From, To>();
  using backward_from = dual_t<To>;
  using backward_to = dual_t<From>;
  static constexpr Collective backward = collective_for<backward_from, backward_to>();
};

namespace detail {

// Views a row-major tensor as [outer][n * block] around dimension d and cuts
// or joins the n blocks; block = (shape[d] / n) * prod(shape[d+1:]).
template <std::size_t R>
struct BlockView {
  std::int64_t outer = 1, block = 1;
  BlockView(const std::array<std::int64_t, R>& shape, int d, int n) {
    for (int i = 0; i < d; ++i) outer *= shape[i];
    block = shape[d] / n;
    for (std::size_t i = d + 1; i < R; ++i) block *= shape[i];
  }
};

// Cuts a tensor around dimension d into its n blocks ([outer][n][block] ->
// [n][outer][block], so block k is contiguous: what a collective sends to or
// receives from rank k), or joins them back (the inverse). `shape` is the
// shape of the joined tensor.
enum class Blocks { split, join };

template <class T, std::size_t R>
std::vector<T> regroup(Blocks how, std::span<const T> in, const std::array<std::int64_t, R>& shape, int d, int n) {
  const BlockView<R> v(shape, d, n);
  std::vector<T> out(in.size());
  for (int k = 0; k < n; ++k)
    for (std::int64_t o = 0; o < v.outer; ++o) {
      const std::int64_t joined = (o * n + k) * v.block, split = (k * v.outer + o) * v.block;
      const auto from = how == Blocks::split ? joined : split, to = how == Blocks::split ? split : joined;
      std::copy_n(in.begin() + from, v.block, out.begin() + to);
    }
  return out;
}

template <class L, Axis A, class P>
constexpr bool innermost_if_shard() {
  if constexpr (is_shard_v<P>) return L::innermost(A, P::dim);
  else return true;
}

}  // namespace detail

template <class L, Axis A, class To>
using redistributed_layout_t = typename L::template with<A, To>;

// Whether redistribute<A, To> is defined for a tensor of layout L: the
// placements have a rule, and where axis A shards a dimension (before or
// after) it is the innermost axis sharding it, so its pieces are contiguous.
template <class L, Axis A, class To>
inline constexpr bool can_redistribute =
    has_transition<typename L::placements::template on<A>, To> &&
    detail::innermost_if_shard<L, A, typename L::placements::template on<A>>() &&
    detail::innermost_if_shard<redistributed_layout_t<L, A, To>, A, To>();

// Changes the placement of x on axis A to To; `comm` is this rank's
// communicator over axis A.
template <Axis A, class To, class T, class L, Communicator C>
Sharded<T, redistributed_layout_t<L, A, To>> redistribute(const Sharded<T, L>& x, C& comm) {
  static_assert(is_world_axis(A), "redistribute works on a world axis (tp, cp, dp, pp)");
  using From = typename L::placements::template on<A>;
  using Out = redistributed_layout_t<L, A, To>;
  constexpr Collective op = collective_for<From, To>();
  static_assert(!has_transition<From, To> || can_redistribute<L, A, To>,
                "redistribute: this axis is not the innermost (fastest) axis sharding the dimension, so its pieces "
                "are not contiguous; change the placements of the faster axes (tp, then cp, dp, pp) first");

  // A communicator of another axis can have the same size and rank, so the
  // group's name (which MeshContext gives it) is checked too.
  constexpr int n = L::mesh::extent(A);
  if (comm.size() != n || comm.rank() != x.layout().coord()[A] ||
      std::string(comm.name()) != AxisGroup<typename L::mesh, axis_bit(A)>::name())
    throw std::invalid_argument("redistribute over " + std::string(axis_name(A)) + " of " + L::mesh::name() +
                                " needs this rank's " + std::string(axis_name(A)) + " communicator (size " +
                                std::to_string(n) + ", rank " + std::to_string(x.layout().coord()[A]) + "), but got '" +
                                comm.name() + "' (size " + std::to_string(comm.size()) + ", rank " +
                                std::to_string(comm.rank()) + ")");

  Out out_layout(x.layout().global_shape(), x.layout().coord());
  const auto in_shape = x.layout().local_shape();
  const auto out_shape = out_layout.local_shape();
  const std::span<const T> in = x.local();
  std::vector<T> out(out_layout.local_size());
  const int me = comm.rank();

  if constexpr (op == Collective::none) {
    std::copy(in.begin(), in.end(), out.begin());
  } else if constexpr (op == Collective::all_reduce) {
    comm.all_reduce(in, std::span<T>(out), ReduceOp::sum);
  } else if constexpr (op == Collective::reduce_scatter) {
    const auto packed = detail::regroup(detail::Blocks::split, in, in_shape, To::dim, n);
    comm.reduce_scatter(std::span<const T>(packed), std::span<T>(out), ReduceOp::sum);
  } else if constexpr (op == Collective::all_gather) {
    std::vector<T> gathered(out.size());
    comm.all_gather(in, std::span<T>(gathered));
    out = detail::regroup(detail::Blocks::join, std::span<const T>(gathered), out_shape, From::dim, n);
  } else if constexpr (op == Collective::all_to_all) {
    const auto packed = detail::regroup(detail::Blocks::split, in, in_shape, To::dim, n);
    std::vector<T> received(packed.size());
    comm.all_to_all(std::span<const T>(packed), std::span<T>(received));
    out = detail::regroup(detail::Blocks::join, std::span<const T>(received), out_shape, From::dim, n);
  } else if constexpr (op == Collective::slice) {
    const auto blocks = detail::regroup(detail::Blocks::split, in, in_shape, To::dim, n);
    std::copy_n(blocks.begin() + me * out.size(), out.size(), out.begin());
  } else {  // pad: own block in place, zeros elsewhere
    std::vector<T> blocks(out.size(), T{});
    std::copy(in.begin(), in.end(), blocks.begin() + me * in.size());
    out = detail::regroup(detail::Blocks::join, std::span<const T>(blocks), out_shape, From::dim, n);
  }
  return Sharded<T, Out>(std::move(out_layout), std::move(out));
}

// A view (a piece inside a larger buffer) redistributes as a copy of it.
template <Axis A, class To, class T, class L, Communicator C>
Sharded<std::remove_const_t<T>, redistributed_layout_t<L, A, To>> redistribute(const ShardedView<T, L>& x, C& comm) {
  return redistribute<A, To>(x.copy(), comm);
}

}  // namespace fived
