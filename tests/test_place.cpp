// Placements and redistribute on the host backend, on integer data with exact
// equality: every transition on every axis of several meshes, with the other
// axes replicated, sharded or partial around it.
//
// Two properties are checked for each transition From -> To on axis A:
//  1. value: the tensor after redistribute holds exactly the pieces the new
//     layout says it should, computed here from the global tensor;
//  2. adjoint: with R = redistribute<A, To> and R* the backward transition the
//     types give (dual(To) -> dual(From)),  <y, R(x)> == <R*(y), x>, where the
//     pairing of a value with a gradient of dual placement is the sum over all
//     ranks of local dot products. This is what makes the backward collective
//     "follow from the type": it is the transpose of the forward one.
//  3. no allocation: the same transition (and its backward) into a
//     preallocated view, through a workspace of exactly the advertised size
//     (redistribute_workspace), gives the allocating form's result; a
//     steady-state loop of them allocates no buffer.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/device/buffer.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/ops.hpp"
#include "fived/place/redistribute.hpp"

using namespace fived;
using i64 = std::int64_t;

namespace {

template <class... Ts> struct types {};
using all_placements = types<Replicate, Partial, Shard<0>, Shard<1>, Shard<2>>;

template <class P> using unpartial = std::conditional_t<std::is_same_v<P, Partial>, Replicate, P>;
template <class PS>
using without_partial = PlacementSet<unpartial<typename PS::template on<Axis::tp>>, unpartial<typename PS::template on<Axis::cp>>,
                                     unpartial<typename PS::template on<Axis::dp>>, unpartial<typename PS::template on<Axis::pp>>>;

// A valid local piece of the logical tensor `scale_of(layout) * global`: the
// pieces of a Replicate/Shard layout, and on each Partial axis P the piece
// times (coord_P + 1), so the sum over P is the value times n(n+1)/2.
template <class L>
std::vector<i64> piece_of(const L& layout, const std::vector<i64>& global) {
  using Plain = ShardLayout<typename L::mesh, L::rank, without_partial<typename L::placements>>;
  const Plain plain(layout.global_shape(), layout.coord());
  auto local = Sharded<i64, Plain>::slice_of(plain, global).storage();
  i64 factor = 1;
  for (Axis a : world_axes)
    if (L::placements::partial(a)) factor *= layout.coord()[a] + 1;
  for (auto& v : local) v *= factor;
  return local;
}

std::vector<i64> ramp(i64 n, i64 mul, i64 add) {
  std::vector<i64> v(n);
  for (i64 i = 0; i < n; ++i) v[i] = (i * mul + add) % 1009 - 300;
  return v;
}

i64 dot(const std::vector<i64>& a, const std::vector<i64>& b) {
  return std::inner_product(a.begin(), a.end(), b.begin(), i64{0});
}

// Results of one run, one slot per world rank, checked on the main thread.
struct Outcome {
  std::vector<std::vector<i64>> got, want;
  std::vector<std::vector<i64>> got_back;                // the backward transition's result
  std::vector<std::vector<i64>> into_view, into_view_back;  // the same, without allocating
  std::vector<i64> pair_forward, pair_backward;  // <y, R(x)> and <R*(y), x> per rank
  explicit Outcome(int n)
      : got(n), want(n), got_back(n), into_view(n), into_view_back(n), pair_forward(n), pair_backward(n) {}
};

// redistribute<A, To> of x into a preallocated piece, through a workspace of
// exactly redistribute_workspace elements, both filled with garbage first (the
// result must not depend on what they held). Ops<double, Host> moves the i64
// elements: its data-movement members take any element type.
template <Axis A, class To, class L, class Comm>
std::vector<i64> into_view(const Sharded<i64, L>& x, Comm& comm) {
  using Out = redistributed_layout_t<L, A, To>;
  Sharded<i64, Out> y(Out(x.layout().global_shape(), x.layout().coord()));
  Buffer<i64, Host> workspace(redistribute_workspace<A, To>(x.layout()));
  std::fill_n(y.data(), y.local().size(), i64{777});
  std::fill_n(workspace.data(), workspace.size(), i64{-555});
  Ops<double, Host> ops;
  redistribute<A, To>(x.view(), y.view(), workspace.span(), comm, ops);
  return y.storage();
}

template <class M, Axis A, class Background, class From, class To>
void check_transition() {
  using In = ShardLayout<M, 3, typename Background::template with<A, From>>;
  using Out = redistributed_layout_t<In, A, To>;
  // gradient placements: the duals, on every axis
  using GradOut = ShardLayout<M, 3, typename Out::placements::gradient>;
  constexpr int n = M::extent(A);
  constexpr i64 partial_sum = n * (n + 1) / 2;  // sum of (coord + 1) over the axis

  const typename In::Shape shape{2 * M::size, M::size, M::size};
  const i64 total = shape[0] * shape[1] * shape[2];
  const auto g = ramp(total, 7, 3);
  const auto h = ramp(total, 11, 5);
  // logical value of x on axis A; everything else is the same on both sides
  std::vector<i64> value = g;
  if constexpr (std::is_same_v<From, Partial>)
    for (auto& v : value) v *= partial_sum;

  Outcome out(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    auto& comm = ctx.template comm<A>();
    const int r = world.rank();

    const In in_layout(shape, ctx.coord());
    const Sharded<i64, In> x(in_layout, piece_of(in_layout, g));
    const auto y = redistribute<A, To>(x, comm);
    out.got[r] = y.storage();
    if constexpr (std::is_same_v<To, Partial>) {
      // Any split into partial sums is valid; compare the sum over A on the main thread.
      using Whole = typename Out::template with<A, Replicate>;
      out.want[r] = piece_of(Whole(shape, ctx.coord()), value);
    } else {
      out.want[r] = piece_of(y.layout(), value);
    }

    // adjoint: a gradient for y, pulled back by the backward transition
    const GradOut grad_layout(shape, ctx.coord());
    const Sharded<i64, GradOut> dy(grad_layout, piece_of(grad_layout, h));
    const auto dx = redistribute<A, dual_t<From>>(dy, comm);
    static_assert(std::is_same_v<typename decltype(dx)::placements, typename In::placements::gradient>);
    out.got_back[r] = dx.storage();

    out.into_view[r] = into_view<A, To>(x, comm);
    out.into_view_back[r] = into_view<A, dual_t<From>>(dy, comm);
    out.pair_forward[r] = dot(dy.storage(), y.storage());
    out.pair_backward[r] = dot(dx.storage(), x.storage());
  });

  INFO(M::name() << " axis " << axis_name(A) << ": " << collective_name(Transition<From, To>::forward));
  for (int r = 0; r < M::size; ++r) {
    if constexpr (std::is_same_v<To, Partial>) {
      // the sum over the A group (ranks sharing r's other coordinates) is the value
      if (M::coord(r)[A] != 0) continue;
      std::vector<i64> sum(out.got[r].size(), 0);
      for (int q : AxisGroup<M, axis_bit(A)>::members(r))
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += out.got[q][i];
      CHECK(sum == out.want[r]);
    } else {
      CHECK(out.got[r] == out.want[r]);
    }
    CHECK(out.into_view[r] == out.got[r]);
    CHECK(out.into_view_back[r] == out.got_back[r]);
  }
  CHECK(std::accumulate(out.pair_forward.begin(), out.pair_forward.end(), i64{0}) ==
        std::accumulate(out.pair_backward.begin(), out.pair_backward.end(), i64{0}));
}

template <class M, Axis A, class Background, class From, class... To>
void from_to(types<To...>) {
  (
      [] {
        using In = ShardLayout<M, 3, typename Background::template with<A, From>>;
        if constexpr (can_redistribute<In, A, To>) check_transition<M, A, Background, From, To>();
      }(),
      ...);
}

template <class M, Axis A, class Background, class... From>
void every_transition(types<From...>) {
  (from_to<M, A, Background, From>(all_placements{}), ...);
}

template <class M, Axis A, class Background>
void every_transition_on() {
  every_transition<M, A, Background>(all_placements{});
}

}  // namespace

TEST_CASE("the collective follows from the two placements") {
  static_assert(Transition<Partial, Replicate>::forward == Collective::all_reduce);
  static_assert(Transition<Partial, Shard<1>>::forward == Collective::reduce_scatter);
  static_assert(Transition<Shard<1>, Replicate>::forward == Collective::all_gather);
  static_assert(Transition<Shard<0>, Shard<1>>::forward == Collective::all_to_all);
  static_assert(Transition<Replicate, Shard<0>>::forward == Collective::slice);
  static_assert(Transition<Shard<0>, Partial>::forward == Collective::pad);
  static_assert(Transition<Shard<0>, Shard<0>>::forward == Collective::none);
  static_assert(!has_transition<Replicate, Partial>);
  // TP cuts dim 0 finer than DP: DP may only change dim 0 once TP does not shard it
  using M = Mesh<TP<2>, DP<2>>;
  using TpDp = ShardLayout<M, 1, Placements<On<Axis::tp, Shard<0>>, On<Axis::dp, Shard<0>>>>;
  static_assert(can_redistribute<TpDp, Axis::tp, Replicate> && !can_redistribute<TpDp, Axis::dp, Replicate>);
  static_assert(!can_redistribute<ShardLayout<M, 1, Placements<On<Axis::tp, Shard<0>>>>, Axis::dp, Shard<0>>);
  static_assert(can_redistribute<ShardLayout<M, 1, Placements<On<Axis::dp, Shard<0>>>>, Axis::tp, Shard<0>>);
  // Megatron's sequence-parallel pair: all-gather entering, reduce-scatter in backward
  static_assert(Transition<Shard<0>, Replicate>::backward == Collective::reduce_scatter);
  static_assert(Transition<Partial, Shard<0>>::backward == Collective::all_gather);
  static_assert(Transition<Partial, Replicate>::backward == Collective::all_reduce);
  static_assert(Transition<Replicate, Shard<1>>::backward == Collective::pad);
  static_assert(std::is_same_v<Placements<On<Axis::tp, Replicate>, On<Axis::dp, Shard<0>>>::gradient,
                               Placements<On<Axis::tp, Partial>, On<Axis::dp, Shard<0>>, On<Axis::cp, Partial>,
                                          On<Axis::pp, Partial>>>);
  CHECK(collective_name(Transition<Partial, Shard<0>>::forward) == "reduce_scatter");
}

TEST_CASE("local shapes and offsets, several axes on one dimension") {
  using M = Mesh<TP<2>, DP<3>>;
  using L = ShardLayout<M, 2, Placements<On<Axis::tp, Shard<0>>, On<Axis::dp, Shard<0>>>>;
  static_assert(L::splits(0) == 6 && L::splits(1) == 1);
  static_assert(L::innermost(Axis::tp, 0) && !L::innermost(Axis::dp, 0));
  // rank (tp=1, dp=2) holds piece 2*2+1 = 5 of 6: TP cuts the finer pieces
  const L l({12, 5}, Coord{.tp = 1, .dp = 2});
  CHECK(l.local_shape() == L::Shape{2, 5});
  CHECK(l.offset() == L::Shape{10, 0});
  CHECK(l.local_size() == 10);
}

TEST_CASE("an uneven split is a clear error") {
  using L = ShardLayout<Mesh<TP<4>>, 2, Placements<On<Axis::tp, Shard<1>>>>;
  CHECK_THROWS_WITH_AS(L({3, 10}, Coord{}),
                       "cannot shard dimension 1 of size 10 into 4 equal pieces over Mesh<TP<4>>: pad the dimension "
                       "to a multiple of 4 or change the placement",
                       std::invalid_argument);
}

TEST_CASE("redistribute needs the communicator of its axis") {
  using M = Mesh<TP<2>, DP<2>>;
  using L = ShardLayout<M, 1, Placements<On<Axis::tp, Shard<0>>>>;
  std::vector<std::string> errors(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    const L layout({4}, ctx.coord());
    const Sharded<float, L> x(layout, std::vector<float>(2, 1.f));
    try {
      (void)redistribute<Axis::tp, Replicate>(x, ctx.comm<Axis::dp>());
    } catch (const std::invalid_argument& e) {
      errors[world.rank()] = e.what();
    }
  });
  for (const auto& e : errors)
    CHECK(e.find("redistribute over tp of Mesh<TP<2>, DP<2>> needs this rank's tp communicator") != std::string::npos);
}

TEST_CASE("a local buffer of the wrong size is rejected") {
  using L = ShardLayout<Mesh<TP<2>>, 1, Placements<On<Axis::tp, Shard<0>>>>;
  const L layout({8}, Coord{});
  CHECK_THROWS_AS((Sharded<float, L>(layout, std::vector<float>(8))), std::invalid_argument);
}

TEST_CASE("every transition on TP<4>") { every_transition_on<Mesh<TP<4>>, Axis::tp, Replicated>(); }

TEST_CASE("every transition on each axis of TP<2> x DP<2>, around other placements") {
  using M = Mesh<TP<2>, DP<2>>;
  every_transition_on<M, Axis::tp, Replicated>();
  every_transition_on<M, Axis::dp, Replicated>();
  // DP shards dim 0 more coarsely while TP moves; TP is partial while DP moves
  every_transition_on<M, Axis::tp, Placements<On<Axis::dp, Shard<0>>>>();
  every_transition_on<M, Axis::dp, Placements<On<Axis::tp, Partial>>>();
}

TEST_CASE("every transition on each axis of TP<3> x PP<2>") {
  using M = Mesh<TP<3>, PP<2>>;
  every_transition_on<M, Axis::tp, Placements<On<Axis::pp, Shard<1>>>>();
  every_transition_on<M, Axis::pp, Placements<On<Axis::tp, Shard<2>>>>();
}

TEST_CASE("every transition on each axis of TP<2> x CP<2> x DP<2>") {
  using M = Mesh<TP<2>, CP<2>, DP<2>>;
  every_transition_on<M, Axis::tp, Placements<On<Axis::cp, Shard<1>>, On<Axis::dp, Shard<0>>>>();
  every_transition_on<M, Axis::cp, Placements<On<Axis::tp, Partial>, On<Axis::dp, Shard<1>>>>();
  every_transition_on<M, Axis::dp, Placements<On<Axis::tp, Shard<2>>, On<Axis::cp, Partial>>>();
}

TEST_CASE("the workspace a transition needs: none where the pieces are contiguous") {
  using M = Mesh<TP<4>>;
  using S0 = ShardLayout<M, 3, Placements<On<Axis::tp, Shard<0>>>>;
  using S1 = ShardLayout<M, 3, Placements<On<Axis::tp, Shard<1>>>>;
  using R = ShardLayout<M, 3, Replicated>;
  using P = ShardLayout<M, 3, Placements<On<Axis::tp, Partial>>>;
  const Coord c{.tp = 2};
  const S0 s0({8, 4, 12}, c);  // local [2, 4, 12]: 96 elements
  const S1 s1({8, 4, 12}, c);  // local [8, 1, 12]: 96
  const R r({8, 4, 12}, c);    // 384
  const P p({8, 4, 12}, c);    // 384
  // leading dimension, or no pieces at all: the collective reads and writes the views directly
  CHECK(redistribute_workspace<Axis::tp, Replicate>(s0) == 0);  // all-gather
  CHECK(redistribute_workspace<Axis::tp, Partial>(s0) == 0);    // pad
  CHECK(redistribute_workspace<Axis::tp, Shard<0>>(r) == 0);    // slice
  CHECK(redistribute_workspace<Axis::tp, Shard<0>>(p) == 0);    // reduce-scatter
  CHECK(redistribute_workspace<Axis::tp, Replicate>(p) == 0);   // all-reduce
  CHECK(redistribute_workspace<Axis::tp, Shard<1>>(s1) == 0);   // none
  // a later dimension: the input is split before the collective, the output joined after
  CHECK(redistribute_workspace<Axis::tp, Replicate>(s1) == 384);  // joins what it gathers
  CHECK(redistribute_workspace<Axis::tp, Partial>(s1) == 384);    // joins the padded blocks
  CHECK(redistribute_workspace<Axis::tp, Shard<2>>(r) == 384);    // splits the whole tensor
  CHECK(redistribute_workspace<Axis::tp, Shard<1>>(p) == 384);    // splits what it sends
  CHECK(redistribute_workspace<Axis::tp, Shard<1>>(s0) == 96);    // splits the input only
  CHECK(redistribute_workspace<Axis::tp, Shard<0>>(s1) == 96);    // joins the output only
  CHECK(redistribute_workspace<Axis::tp, Shard<2>>(s1) == 192);   // both
  // what decides is the size of the dimensions before the moving one, not its index
  CHECK(redistribute_workspace<Axis::tp, Replicate>(S1({1, 4, 12}, c)) == 0);
}

TEST_CASE("a workspace or an output view that does not fit is a clear error") {
  using M = Mesh<TP<2>>;
  using L = ShardLayout<M, 2, Placements<On<Axis::tp, Shard<1>>>>;
  using Out = redistributed_layout_t<L, Axis::tp, Replicate>;
  std::vector<std::string> small(M::size), other(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    const L layout({3, 4}, ctx.coord());
    const Sharded<float, L> x(layout, std::vector<float>(6, 1.f));
    Sharded<float, Out> y(Out({3, 4}, ctx.coord()));
    REQUIRE(redistribute_workspace<Axis::tp, Replicate>(layout) == 12);
    std::vector<float> workspace(11);
    try {
      redistribute<Axis::tp, Replicate>(x.view(), y.view(), workspace, ctx.comm<Axis::tp>(), HostCopyOps{});
    } catch (const std::invalid_argument& e) {
      small[world.rank()] = e.what();
    }
    workspace.resize(12);
    Sharded<float, Out> wrong(Out({3, 8}, ctx.coord()));
    try {
      redistribute<Axis::tp, Replicate>(x.view(), wrong.view(), workspace, ctx.comm<Axis::tp>(), HostCopyOps{});
    } catch (const std::invalid_argument& e) {
      other[world.rank()] = e.what();
    }
  });
  for (const auto& e : small)
    CHECK(e == "redistribute: the workspace holds 11 elements but this all_gather needs 12 (size it with "
               "redistribute_workspace<A, To>(layout))");
  for (const auto& e : other) CHECK(e.find("the output view belongs to another tensor or rank") != std::string::npos);
}

TEST_CASE("redistribute into preallocated views allocates nothing, step after step") {
  using M = Mesh<DP<2>, TP<2>>;
  using X = ShardLayout<M, 3, Placements<On<Axis::tp, Shard<1>>, On<Axis::dp, Shard<2>>>>;
  using Gathered = redistributed_layout_t<X, Axis::tp, Replicate>;     // all-gather of dimension 1
  using Full = redistributed_layout_t<Gathered, Axis::dp, Replicate>;  // all-gather of dimension 2, over dp
  using Swapped = redistributed_layout_t<X, Axis::tp, Shard<2>>;       // all-to-all, dimension 1 -> 2
  using Padded = redistributed_layout_t<X, Axis::tp, Partial>;         // pad
  static_assert(std::is_same_v<redistributed_layout_t<Padded, Axis::tp, Shard<1>>, X>);    // reduce-scatter
  static_assert(std::is_same_v<redistributed_layout_t<Gathered, Axis::tp, Shard<1>>, X>);  // slice
  const X::Shape shape{3, 4, 8};  // dimension 0 is not 1: every transition here regroups
  const auto global = ramp(3 * 4 * 8, 13, 1);
  const std::vector<float> global_f(global.begin(), global.end());
  constexpr int steps = 5;

  std::size_t at_start = 0, after_steps = 0, after_allocating = 0;
  std::vector<int> right(M::size, 0);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    auto& tp = ctx.comm<Axis::tp>();
    auto& dp = ctx.comm<Axis::dp>();
    const Coord c = ctx.coord();

    // Everything a step touches is made here, once; one workspace serves every transition.
    const auto x = Sharded<float, X>::slice_of(X(shape, c), global_f);
    Sharded<float, Gathered> gathered{Gathered(shape, c)};
    Sharded<float, Full> full{Full(shape, c)};
    Sharded<float, Swapped> swapped{Swapped(shape, c)};
    Sharded<float, Padded> padded{Padded(shape, c)};
    Sharded<float, X> scattered{X(shape, c)}, sliced{X(shape, c)};
    Buffer<float, Host> workspace(std::max({redistribute_workspace<Axis::tp, Replicate>(x.layout()),
                                            redistribute_workspace<Axis::dp, Replicate>(gathered.layout()),
                                            redistribute_workspace<Axis::tp, Shard<2>>(x.layout()),
                                            redistribute_workspace<Axis::tp, Partial>(x.layout()),
                                            redistribute_workspace<Axis::tp, Shard<1>>(padded.layout()),
                                            redistribute_workspace<Axis::tp, Shard<1>>(gathered.layout())}));
    REQUIRE(workspace.size() > 0);
    Ops<float, Host> ops;

    // The counter is process-wide and the ranks are threads: rank 0 reads it
    // while the others wait at the barriers around it.
    const auto count = [&](std::size_t& into) {
      world.barrier();
      if (world.rank() == 0) into = buffer_allocations<Host>().load();
      world.barrier();
    };
    count(at_start);
    for (int s = 0; s < steps; ++s) {
      redistribute<Axis::tp, Replicate>(x.view(), gathered.view(), workspace.span(), tp, ops);
      redistribute<Axis::dp, Replicate>(gathered.view(), full.view(), workspace.span(), dp, ops);
      redistribute<Axis::tp, Shard<2>>(x.view(), swapped.view(), workspace.span(), tp, ops);
      redistribute<Axis::tp, Partial>(x.view(), padded.view(), workspace.span(), tp, ops);
      redistribute<Axis::tp, Shard<1>>(padded.view(), scattered.view(), workspace.span(), tp, ops);
      redistribute<Axis::tp, Shard<1>>(gathered.view(), sliced.view(), workspace.span(), tp, ops);
    }
    count(after_steps);
    // The allocating form does allocate: the counter sees these buffers.
    const auto gathered_again = redistribute<Axis::tp, Replicate>(x, tp);
    count(after_allocating);

    const auto swapped_want = Sharded<float, Swapped>::slice_of(Swapped(shape, c), global_f);
    right[world.rank()] = full.storage() == global_f && swapped.storage() == swapped_want.storage() &&
                          scattered.storage() == x.storage() && sliced.storage() == x.storage() &&
                          gathered_again.storage() == gathered.storage();
  });
  CHECK(after_steps == at_start);
  CHECK(after_allocating > after_steps);
  for (int r = 0; r < M::size; ++r) CHECK(right[r] == 1);
}
