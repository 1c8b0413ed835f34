#pragma once
// redistribute<A, To>: change a tensor's placement on one mesh axis.
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
//
// Two forms:
//
//   auto y = redistribute<A, To>(x, comm);                        // allocates y (host; or
//                                                                 // (x, comm, ops) on any device)
//   std::size_t n = redistribute_workspace<A, To>(x.layout());    // once, when sizing buffers
//   redistribute<A, To>(x.view(), y.view(), workspace, comm, ops);  // into y: allocates nothing
//
// The second is the one a training step uses: a collective of a non-leading
// dimension needs its pieces regrouped into contiguous blocks before or after
// it ([outer][n][block] <-> [n][outer][block]), and those copies go through a
// workspace the caller sized once, with the kernels of `ops` (an Ops<T, Device>,
// or HostCopyOps below): ops.regroup, ops.copy, ops.zero. The views, the
// workspace and the spans the communicator sees are memory of one device (on
// Cuda, device memory, which nccl::Comm takes). On Cuda the regroup kernels run
// on ops' stream and the collective after the communicator's compute stream:
// make them the same (comm.set_compute_stream(ops.stream())) or order them.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "fived/comm/communicator.hpp"
#include "fived/device/buffer.hpp"
#include "fived/kernels/host/regroup.hpp"
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

// The kernels redistribute needs, on host memory, for callers without an
// Ops<T, Host> (place/ does not depend on nn/): the same members, any element type.
struct HostCopyOps {
  using device = Host;
  template <class U>
  void regroup(U* out, const U* in, std::int64_t outer, int n, std::int64_t block, kernels::host::Blocks how) {
    kernels::host::regroup(out, in, outer, n, block, how);
  }
  template <class U>
  void copy(U* dst, const U* src, std::size_t n) {
    if (dst != src) std::copy_n(src, n, dst);
  }
  template <class U>
  void zero(U* p, std::size_t n) {
    std::fill_n(p, n, U{});
  }
  void synchronize() {}
};

namespace detail {

using kernels::host::Blocks;

// Views a row-major tensor as [outer][n * block] around dimension d, to cut or
// join its n pieces along d; block = (shape[d] / n) * prod(shape[d+1:]). When
// outer == 1 (d leads, or the dimensions before it are 1) or n == 1, piece k is
// already the contiguous block k and nothing needs regrouping.
struct BlockView {
  std::int64_t outer = 1, block = 1;
  int n = 1;
  BlockView() = default;
  template <std::size_t R>
  BlockView(const std::array<std::int64_t, R>& shape, int d, int n_) : n(n_) {
    for (int i = 0; i < d; ++i) outer *= shape[i];
    block = shape[d] / n;
    for (std::size_t i = d + 1; i < R; ++i) block *= shape[i];
  }
  bool regroups() const { return outer > 1 && n > 1; }
};

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

namespace detail {

// What one rank does for redistribute<A, To> of a piece of layout L: the
// collective, the split of the input around To's dimension before it (pack:
// reduce-scatter, all-to-all, slice) and the join of the output around From's
// dimension after it (unpack: all-gather, all-to-all, pad), each only where the
// pieces are not contiguous already. The workspace holds the packed input, then
// what the collective receives before it is unpacked.
template <Axis A, class To, class L>
struct Route {
  static_assert(is_world_axis(A), "redistribute works on a world axis (tp, cp, dp, pp)");
  using From = typename L::placements::template on<A>;
  using Out = redistributed_layout_t<L, A, To>;
  static constexpr Collective op = collective_for<From, To>();
  static_assert(!has_transition<From, To> || can_redistribute<L, A, To>,
                "redistribute: this axis is not the innermost (fastest) axis sharding the dimension, so its pieces "
                "are not contiguous; change the placements of the faster axes (tp, then cp, dp, pp) first");
  static constexpr int n = L::mesh::extent(A);

  std::size_t in_size, out_size;
  BlockView pack, unpack;  // n == 1 (nothing to regroup) unless set below

  Route(const L& in, const Out& out)
      : in_size(static_cast<std::size_t>(in.local_size())), out_size(static_cast<std::size_t>(out.local_size())) {
    if constexpr (op != Collective::none && is_shard_v<To>) pack = BlockView(in.local_shape(), To::dim, n);
    if constexpr (op != Collective::none && is_shard_v<From>) unpack = BlockView(out.local_shape(), From::dim, n);
  }
  std::size_t packed_size() const { return pack.regroups() ? in_size : 0; }
  std::size_t workspace() const { return packed_size() + (unpack.regroups() ? out_size : 0); }
};

// A communicator of another axis can have the same size and rank, so the
// group's name (which MeshContext gives it) is checked too.
template <Axis A, class L, class C>
void check_comm(const L& layout, const C& comm) {
  constexpr int n = L::mesh::extent(A);
  if (comm.size() != n || comm.rank() != layout.coord()[A] ||
      std::string(comm.name()) != AxisGroup<typename L::mesh, axis_bit(A)>::name())
    throw std::invalid_argument("redistribute over " + std::string(axis_name(A)) + " of " + L::mesh::name() +
                                " needs this rank's " + std::string(axis_name(A)) + " communicator (size " +
                                std::to_string(n) + ", rank " + std::to_string(layout.coord()[A]) + "), but got '" +
                                comm.name() + "' (size " + std::to_string(comm.size()) + ", rank " +
                                std::to_string(comm.rank()) + ")");
}

}  // namespace detail

// Elements of T the workspace of redistribute<A, To> needs for a piece of this
// layout; 0 where every piece is contiguous (the leading dimension, all-reduce).
// Depends on the layout's shape only: size a workspace once, reuse it every step.
template <Axis A, class To, class L>
std::size_t redistribute_workspace(const L& layout) {
  using Out = redistributed_layout_t<L, A, To>;
  return detail::Route<A, To, L>(layout, Out(layout.global_shape(), layout.coord())).workspace();
}

// Changes the placement of x on axis A to To, writing this rank's piece into
// `out` (a view of layout redistributed_layout_t<L, A, To>, for the same global
// shape and rank), with no allocation: regrouping goes through `workspace`, at
// least redistribute_workspace<A, To>(x.layout()) elements, and runs on `ops`
// (ops.regroup, ops.copy, ops.zero; see the top of this file). `comm` is this
// rank's communicator over axis A. x, out and workspace must not overlap.
template <Axis A, class To, class U, class L, class T, class LO, class Device, Communicator C, class Ops>
void redistribute(const ShardedView<U, L, Device>& x, const ShardedView<T, LO, Device>& out,
                  std::span<std::type_identity_t<T>> workspace, C& comm, Ops&& ops) {
  static_assert(!std::is_const_v<T>,
                "redistribute: the output view must be writable (ShardedView<T, ...>, not ShardedView<const T, ...>)");
  static_assert(std::is_same_v<std::remove_const_t<U>, T>,
                "redistribute: the input and the output hold different element types");
  static_assert(std::is_same_v<LO, redistributed_layout_t<L, A, To>>,
                "redistribute: the output view's layout must be the input's with axis A placed as To "
                "(redistributed_layout_t<L, A, To>)");
  if constexpr (requires { typename std::remove_cvref_t<Ops>::device; })
    static_assert(std::is_same_v<typename std::remove_cvref_t<Ops>::device, Device>,
                  "redistribute: the ops run on another device than the tensors' memory");
  using Route = detail::Route<A, To, L>;
  constexpr Collective op = Route::op;
  constexpr int n = Route::n;

  detail::check_comm<A>(x.layout(), comm);
  if (out.layout().global_shape() != x.layout().global_shape() || !(out.layout().coord() == x.layout().coord()))
    throw std::invalid_argument("redistribute: the output view belongs to another tensor or rank: its global shape "
                                "and mesh coordinate must be the input's");
  const Route route(x.layout(), out.layout());
  if (workspace.size() < route.workspace())
    throw std::invalid_argument("redistribute: the workspace holds " + std::to_string(workspace.size()) +
                                " elements but this " + std::string(collective_name(op)) + " needs " +
                                std::to_string(route.workspace()) +
                                " (size it with redistribute_workspace<A, To>(layout))");

  const std::size_t in_size = route.in_size, out_size = route.out_size;
  const T* in = x.data();
  T* y = out.data();
  const std::size_t me = static_cast<std::size_t>(comm.rank());

  // What the collective sends: the input, split into contiguous blocks if needed.
  const T* send = in;
  if (route.pack.regroups()) {
    ops.regroup(workspace.data(), in, route.pack.outer, n, route.pack.block, detail::Blocks::split);
    send = workspace.data();
  }
  // Where it writes: the output, or the workspace that is then joined into the output.
  T* recv = route.unpack.regroups() ? workspace.data() + route.packed_size() : y;

  if constexpr (op == Collective::none) {
    ops.copy(y, in, out_size);
  } else if constexpr (op == Collective::all_reduce) {
    comm.all_reduce(std::span<const T>(in, in_size), std::span<T>(y, out_size), ReduceOp::sum);
  } else if constexpr (op == Collective::reduce_scatter) {
    comm.reduce_scatter(std::span<const T>(send, in_size), std::span<T>(recv, out_size), ReduceOp::sum);
  } else if constexpr (op == Collective::all_gather) {
    comm.all_gather(std::span<const T>(send, in_size), std::span<T>(recv, out_size));
  } else if constexpr (op == Collective::all_to_all) {
    comm.all_to_all(std::span<const T>(send, in_size), std::span<T>(recv, out_size));
  } else if constexpr (op == Collective::slice) {  // this rank's block
    ops.copy(recv, send + me * out_size, out_size);
  } else {  // pad: this rank's block in place, zeros elsewhere
    ops.zero(recv, out_size);
    ops.copy(recv + me * in_size, send, in_size);
  }
  if (route.unpack.regroups()) ops.regroup(y, recv, route.unpack.outer, n, route.unpack.block, detail::Blocks::join);
}

// The allocating form, on any device: returns a new piece, and frees the
// workspace it used (waiting for the device's queued work first).
template <Axis A, class To, class U, class L, class Device, Communicator C, class Ops>
Sharded<std::remove_const_t<U>, redistributed_layout_t<L, A, To>, Device> redistribute(
    const ShardedView<U, L, Device>& x, C& comm, Ops&& ops) {
  using T = std::remove_const_t<U>;
  using Out = redistributed_layout_t<L, A, To>;
  detail::check_comm<A>(x.layout(), comm);
  Sharded<T, Out, Device> y(Out(x.layout().global_shape(), x.layout().coord()));
  Buffer<T, Device> workspace(redistribute_workspace<A, To>(x.layout()));
  redistribute<A, To>(x, y.view(), workspace.span(), comm, ops);
  if constexpr (!std::is_same_v<Device, Host>) ops.synchronize();
  return y;
}

template <Axis A, class To, class T, class L, class Device, Communicator C, class Ops>
Sharded<T, redistributed_layout_t<L, A, To>, Device> redistribute(const Sharded<T, L, Device>& x, C& comm, Ops&& ops) {
  return redistribute<A, To>(x.view(), comm, ops);
}

// On the host the kernels are HostCopyOps': redistribute<A, To>(x, comm).
template <Axis A, class To, class T, class L, Communicator C>
Sharded<T, redistributed_layout_t<L, A, To>> redistribute(const Sharded<T, L>& x, C& comm) {
  return redistribute<A, To>(x.view(), comm, HostCopyOps{});
}

// A view (a piece inside a larger buffer) redistributes into a new piece.
template <Axis A, class To, class T, class L, Communicator C>
Sharded<std::remove_const_t<T>, redistributed_layout_t<L, A, To>> redistribute(const ShardedView<T, L>& x, C& comm) {
  return redistribute<A, To>(x, comm, HostCopyOps{});
}

}  // namespace fived
