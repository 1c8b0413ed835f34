// Tensor-parallel layers on the host backend, against the serial computation
// on the full weights.
//
// For Mesh<TP<2>> and Mesh<TP<4>>, each with and without sequence
// parallelism, each layer alone (ColumnParallelLinear, RowParallelLinear,
// LayerNorm), the MLP (column c_fc, GELU, row c_proj) and the attention (fused
// q|k|v column-parallel by heads, causal attention, row c_proj), on random
// nonzero data:
//  - the forward output, gathered to Replicate, equals the serial output;
//  - the input gradient, gathered, equals the serial one;
//  - every weight and bias gradient, all-gathered over TP, equals the serial one;
// within 1e-5 relative in fp32 (max |tp - serial| / max |serial| per tensor)
// and 1e-12 in fp64. A Counting communicator checks the collectives each layer
// issues in forward and in backward against Megatron's counts.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/kernels/host/gelu.hpp"
#include "fived/kernels/host/gemm.hpp"
#include "fived/mesh/context.hpp"
#include "fived/kernels/host/attention.hpp"
#include "fived/kernels/host/layernorm.hpp"
#include "fived/nn/tp/attention.hpp"
#include "fived/nn/tp/layernorm.hpp"
#include "fived/nn/tp/linear.hpp"
#include "fived/nn/tp/mlp.hpp"
#include "support/compare.hpp"

using namespace fived;
using namespace fived::nn::tp;
namespace kh = fived::kernels::host;
using i64 = std::int64_t;
using Shape3 = std::array<i64, 3>;

static_assert(Communicator<Counting<host::Comm>>);

// The placements are part of the types.
using M2 = Mesh<TP<2>>;
static_assert(std::is_same_v<ColumnParallelLinear<M2, false>::input_placement, Replicate>);
static_assert(std::is_same_v<ColumnParallelLinear<M2, true>::input_placement, Shard<1>>);
static_assert(std::is_same_v<ColumnParallelLinear<M2, false>::output_placement, Shard<2>>);
static_assert(std::is_same_v<ColumnParallelLinear<M2, false>::weight_placement, Shard<1>>);
static_assert(std::is_same_v<ColumnParallelLinear<M2, false>::bias_placement, Shard<0>>);
static_assert(std::is_same_v<RowParallelLinear<M2, false>::input_placement, Shard<2>>);
static_assert(std::is_same_v<RowParallelLinear<M2, false>::output_placement, Replicate>);
static_assert(std::is_same_v<RowParallelLinear<M2, true>::output_placement, Shard<1>>);
static_assert(std::is_same_v<RowParallelLinear<M2, true>::weight_placement, Shard<0>>);
static_assert(std::is_same_v<RowParallelLinear<M2, true>::bias_placement, Replicate>);
static_assert(std::is_same_v<RowParallelLinear<M2, true>::bias_grad_placement, Partial>);  // reduced by the owner
static_assert(std::is_same_v<RowParallelLinear<M2, false>::bias_grad_placement, Replicate>);
static_assert(std::is_same_v<ColumnParallelLinear<M2, false, float, 3>::output_placement, Shard<3>>);  // fused q|k|v
static_assert(std::is_same_v<ColumnParallelLinear<M2, false, float, 3>::weight_placement, Shard<2>>);
static_assert(std::is_same_v<LayerNorm<M2, true>::grad_placement, Partial>);
static_assert(std::is_same_v<LayerNorm<M2, false>::grad_placement, Replicate>);
static_assert(std::is_same_v<Attention<M2, 4, true>::output_placement, Shard<1>>);
static_assert(std::is_same_v<MLP<M2, false>::input_placement, Replicate>);
static_assert(std::is_same_v<MLP<M2, true>::output_placement, Shard<1>>);
static_assert(Chain<ColumnParallelLinear<M2, true>, RowParallelLinear<M2, true>>::ok);
static_assert(Chain<RowParallelLinear<M2, true>, ColumnParallelLinear<M2, true>>::ok);  // block to block with SP
static_assert(Chain<RowParallelLinear<M2, false>, ColumnParallelLinear<M2, false>>::ok);
// The conjugate pairs, read off the transitions the types make:
static_assert(Transition<Replicate, Replicate>::forward == Collective::none &&
              Transition<Partial, Replicate>::forward == Collective::all_reduce);  // f / g without SP
static_assert(Transition<Shard<1>, Replicate>::forward == Collective::all_gather &&
              Transition<Partial, Shard<1>>::forward == Collective::reduce_scatter);  // with SP

namespace {

constexpr i64 kB = 2, kT = 8, kC = 16, kH = 64;


using fived::test::max_rel_error;

// The whole tensor on every rank: all-gather over TP of the shards (or the
// all-reduce of a partial value; a copy when already replicated).
template <class X, class C>
auto gathered(const X& x, C& tp) {
  return redistribute<Axis::tp, Replicate>(x, tp).storage();
}

// Serial linear, HF Conv1D: y[rows, out] = x[rows, in] W[in, out] + b.
template <class T>
std::vector<T> serial_fwd(const std::vector<T>& x, const std::vector<T>& w, const std::vector<T>& b, int rows, int in,
                          int out) {
  std::vector<T> y(static_cast<std::size_t>(rows) * out);
  kh::matmul(y.data(), x.data(), w.data(), b.data(), rows, out, in, false, false);
  return y;
}
template <class T>
void serial_bwd(const std::vector<T>& x, const std::vector<T>& w, const std::vector<T>& dy, int rows, int in, int out,
                std::vector<T>& dx, std::vector<T>& dw, std::vector<T>& db) {
  dx.assign(static_cast<std::size_t>(rows) * in, T{});
  dw.assign(static_cast<std::size_t>(in) * out, T{});
  db.assign(static_cast<std::size_t>(out), T{});
  kh::matmul(dx.data(), dy.data(), w.data(), nullptr, rows, in, out, false, true);
  kh::matmul(dw.data(), x.data(), dy.data(), nullptr, in, out, rows, true, false);
  kh::bias_backward(db.data(), dy.data(), rows, out);
}

template <class T>
struct Reference {
  std::vector<T> y, dx;
  std::vector<std::vector<T>> grads;
};

struct RankResult {
  double err_y = INFINITY, err_dx = INFINITY;
  std::vector<double> err_grads;
  CommCounts fwd, bwd;
};

// Gathered parameter gradients, in a fixed order.
template <class M, bool SP, class T, int G, class C>
std::vector<std::vector<T>> grads_of(const ColumnParallelLinear<M, SP, T, G>& l, C& tp) {
  return {gathered(l.weight_grad(), tp), gathered(l.bias_grad(), tp)};
}
template <class M, bool SP, class T, class C>
std::vector<std::vector<T>> grads_of(const RowParallelLinear<M, SP, T>& l, C& tp) {
  return {gathered(l.weight_grad(), tp), gathered(l.bias_grad(), tp)};
}
template <class M, bool SP, class T, class C>
std::vector<std::vector<T>> grads_of(const MLP<M, SP, T>& m, C& tp) {
  auto g = grads_of(m.c_fc(), tp);
  for (auto& e : grads_of(m.c_proj(), tp)) g.push_back(std::move(e));
  return g;
}

template <class M, int H, bool SP, class T, class C>
std::vector<std::vector<T>> grads_of(const Attention<M, H, SP, T>& a, C& tp) {
  auto g = grads_of(a.c_attn(), tp);
  for (auto& e : grads_of(a.c_proj(), tp)) g.push_back(std::move(e));
  return g;
}

// tp::LayerNorm issues no collective and adds its input gradient to the
// residual stream's; this gives it the forward/backward(…, tp) shape the
// harness calls.
template <class M, bool SP, class T>
struct NormAlone : LayerNorm<M, SP, T> {
  using LayerNorm<M, SP, T>::LayerNorm;
  using typename LayerNorm<M, SP, T>::input_type;
  template <class C>
  input_type forward(const input_type& x, C&) { return LayerNorm<M, SP, T>::forward(x); }
  template <class C>
  input_type backward(const input_type& dy, C&) {
    input_type dx(dy.layout(), std::vector<T>(dy.local().size(), T{}));
    LayerNorm<M, SP, T>::backward(dy, dx);
    return dx;
  }
};
template <class M, bool SP, class T, class C>
std::vector<std::vector<T>> grads_of(const NormAlone<M, SP, T>& n, C& tp) {
  return {gathered(n.weight_grad(), tp), gathered(n.bias_grad(), tp)};
}

// Runs `Layer` on M::size host ranks and compares every rank's gathered
// results with the reference; returns each rank's errors and counts.
template <class Layer, class T, class Make>
std::vector<RankResult> run_tp(Make make, const std::vector<T>& x, Shape3 xs, const std::vector<T>& dy, Shape3 ys,
                               const Reference<T>& ref) {
  using M = typename Layer::mesh;
  std::vector<RankResult> results(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(Counting<host::Comm>(world));
    auto& tp = ctx.template comm<Axis::tp>();
    using In = typename Layer::input_type;
    using Out = typename Layer::output_type;
    Layer layer = make(ctx.coord());
    const auto xin = In::slice_of(typename In::layout_type(xs, ctx.coord()), x);
    const auto dyin = Out::slice_of(typename Out::layout_type(ys, ctx.coord()), dy);
    RankResult& r = results[ctx.rank()];
    const CommCounts c0 = tp.counts();
    const Out y = layer.forward(xin, tp);
    const CommCounts c1 = tp.counts();
    const In dx = layer.backward(dyin, tp);
    const CommCounts c2 = tp.counts();
    r.fwd = c1 - c0;
    r.bwd = c2 - c1;
    r.err_y = max_rel_error(gathered(y, tp), ref.y);
    r.err_dx = max_rel_error(gathered(dx, tp), ref.dx);
    const auto g = grads_of(layer, tp);
    for (std::size_t i = 0; i < ref.grads.size(); ++i)
      r.err_grads.push_back(i < g.size() ? max_rel_error(g[i], ref.grads[i]) : INFINITY);
  });
  return results;
}

template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

CommCounts counts(int ar, int rs, int ag) {
  CommCounts c;
  c.all_reduce.calls = ar;
  c.reduce_scatter.calls = rs;
  c.all_gather.calls = ag;
  return c;
}
bool same_calls(const CommCounts& a, const CommCounts& b) {
  auto calls_only = [](CommCounts c) {
    for (Tally* t : {&c.all_reduce, &c.reduce_scatter, &c.all_gather, &c.all_to_all, &c.all_to_all_v, &c.send_recv,
                     &c.broadcast, &c.barrier})
      t->bytes = 0;
    return c;
  };
  return calls_only(a) == calls_only(b);
}

double worst_seen[2] = {0, 0};  // fp32, fp64

template <class T>
void check(const std::string& what, const std::vector<RankResult>& rs, std::size_t ngrads, const CommCounts& fwd,
           const CommCounts& bwd) {
  double worst = 0;
  for (std::size_t r = 0; r < rs.size(); ++r) {
    CAPTURE(what);
    CAPTURE(r);
    CHECK(rs[r].err_y <= tolerance<T>());
    CHECK(rs[r].err_dx <= tolerance<T>());
    REQUIRE(rs[r].err_grads.size() == ngrads);
    for (double e : rs[r].err_grads) CHECK(e <= tolerance<T>());
    worst = std::max({worst, rs[r].err_y, rs[r].err_dx});
    for (double e : rs[r].err_grads) worst = std::max(worst, e);
    CHECK(same_calls(rs[r].fwd, fwd));
    CHECK(same_calls(rs[r].bwd, bwd));
    CHECK(rs[r].fwd.total_calls() == fwd.total_calls());
    CHECK(rs[r].bwd.total_calls() == bwd.total_calls());
  }
  double& w = worst_seen[std::is_same_v<T, float> ? 0 : 1];
  w = std::max(w, worst);
  std::printf("%-40s max rel err %.3g  fwd AR/RS/AG %lld/%lld/%lld  bwd AR/RS/AG %lld/%lld/%lld\n", what.c_str(), worst,
              (long long)rs[0].fwd.all_reduce.calls, (long long)rs[0].fwd.reduce_scatter.calls,
              (long long)rs[0].fwd.all_gather.calls, (long long)rs[0].bwd.all_reduce.calls,
              (long long)rs[0].bwd.reduce_scatter.calls, (long long)rs[0].bwd.all_gather.calls);
}

template <class M, bool SP>
std::string label(const char* layer, const char* type) {
  return std::string(layer) + " " + M::name() + (SP ? " SP " : " ") + type;
}

template <class M, bool SP, class T>
void column_case() {
  const int rows = kB * kT, in = kC, out = kH;
  const auto x = test::random_values<T>(rows * in, 1), w = test::random_values<T>(in * out, 2), b = test::random_values<T>(out, 3),
             dy = test::random_values<T>(rows * out, 4);
  Reference<T> ref;
  ref.y = serial_fwd(x, w, b, rows, in, out);
  ref.grads.resize(2);
  serial_bwd(x, w, dy, rows, in, out, ref.dx, ref.grads[0], ref.grads[1]);
  using L = ColumnParallelLinear<M, SP, T>;
  auto rs = run_tp<L>([&](Coord c) { return L(in, out, w, b, c); }, x, {kB, kT, in}, dy, {kB, kT, out}, ref);
  // fwd: identity (no SP) or all-gather; bwd: all-reduce (no SP) or reduce-scatter of dx.
  check<T>(label<M, SP>("ColumnParallelLinear", std::is_same_v<T, float> ? "fp32" : "fp64"), rs, 2,
           SP ? counts(0, 0, 1) : counts(0, 0, 0), SP ? counts(0, 1, 0) : counts(1, 0, 0));
}

template <class M, bool SP, class T>
void row_case() {
  const int rows = kB * kT, in = kH, out = kC;
  const auto x = test::random_values<T>(rows * in, 11), w = test::random_values<T>(in * out, 12), b = test::random_values<T>(out, 13),
             dy = test::random_values<T>(rows * out, 14);
  Reference<T> ref;
  ref.y = serial_fwd(x, w, b, rows, in, out);
  ref.grads.resize(2);
  serial_bwd(x, w, dy, rows, in, out, ref.dx, ref.grads[0], ref.grads[1]);
  using L = RowParallelLinear<M, SP, T>;
  auto rs = run_tp<L>([&](Coord c) { return L(in, out, w, b, c); }, x, {kB, kT, in}, dy, {kB, kT, out}, ref);
  // fwd: all-reduce (no SP) or reduce-scatter; bwd: identity (no SP) or
  // all-gather of dy (SP; the bias gradient stays Partial, gathered here by the test).
  check<T>(label<M, SP>("RowParallelLinear", std::is_same_v<T, float> ? "fp32" : "fp64"), rs, 2,
           SP ? counts(0, 1, 0) : counts(1, 0, 0), SP ? counts(0, 0, 1) : counts(0, 0, 0));
}

template <class M, bool SP, class T>
void mlp_case() {
  const int rows = kB * kT;
  const auto x = test::random_values<T>(rows * kC, 21), wf = test::random_values<T>(kC * kH, 22), bf = test::random_values<T>(kH, 23),
             wp = test::random_values<T>(kH * kC, 24), bp = test::random_values<T>(kC, 25), dy = test::random_values<T>(rows * kC, 26);
  // Serial MLP.
  Reference<T> ref;
  std::vector<T> h = serial_fwd(x, wf, bf, rows, kC, kH), a(h.size());
  kh::gelu_forward(a.data(), h.data(), h.size());
  ref.y = serial_fwd(a, wp, bp, rows, kH, kC);
  std::vector<T> da, dwp, dbp, dx, dwf, dbf;
  serial_bwd(a, wp, dy, rows, kH, kC, da, dwp, dbp);
  kh::gelu_backward(da.data(), h.data(), da.data(), da.size());
  serial_bwd(x, wf, da, rows, kC, kH, dx, dwf, dbf);
  ref.dx = dx;
  ref.grads = {dwf, dbf, dwp, dbp};
  using L = MLP<M, SP, T>;
  auto rs = run_tp<L>([&](Coord c) { return L(kC, kH, wf, bf, wp, bp, c); }, x, {kB, kT, kC}, dy, {kB, kT, kC}, ref);
  // Megatron: no SP, one all-reduce each way; SP, all-gather + reduce-scatter each way.
  check<T>(label<M, SP>("MLP", std::is_same_v<T, float> ? "fp32" : "fp64"), rs, 4,
           SP ? counts(0, 1, 1) : counts(1, 0, 0), SP ? counts(0, 1, 1) : counts(1, 0, 0));
}

// Attention with 4 heads (1 or 2 per rank): c_attn, causal attention, c_proj.
template <class M, bool SP, class T>
void attention_case() {
  constexpr int NH = 4;
  const int rows = kB * kT;
  const auto x = test::random_values<T>(rows * kC, 31), wa = test::random_values<T>(kC * 3 * kC, 32),
             ba = test::random_values<T>(3 * kC, 33), wp = test::random_values<T>(kC * kC, 34),
             bp = test::random_values<T>(kC, 35), dy = test::random_values<T>(rows * kC, 36);
  Reference<T> ref;
  const std::vector<T> qkv = serial_fwd(x, wa, ba, rows, kC, 3 * kC);
  std::vector<T> att(static_cast<std::size_t>(rows) * kC);
  std::vector<acc_t<T>> lse(static_cast<std::size_t>(rows) * NH);
  kh::attention_forward(att.data(), lse.data(), qkv.data(), kB, kT, kC, NH);
  ref.y = serial_fwd(att, wp, bp, rows, kC, kC);
  std::vector<T> datt, dwp, dbp, dx, dwa, dba, dqkv(qkv.size());
  serial_bwd(att, wp, dy, rows, kC, kC, datt, dwp, dbp);
  kh::attention_backward(dqkv.data(), datt.data(), qkv.data(), att.data(), lse.data(), kB, kT, kC, NH);
  serial_bwd(x, wa, dqkv, rows, kC, 3 * kC, dx, dwa, dba);
  ref.dx = dx;
  ref.grads = {dwa, dba, dwp, dbp};
  using L = Attention<M, NH, SP, T>;
  auto rs = run_tp<L>([&](Coord c) { return L(kC, wa, ba, wp, bp, c); }, x, {kB, kT, kC}, dy, {kB, kT, kC}, ref);
  check<T>(label<M, SP>("Attention", std::is_same_v<T, float> ? "fp32" : "fp64"), rs, 4,
           SP ? counts(0, 1, 1) : counts(1, 0, 0), SP ? counts(0, 1, 1) : counts(1, 0, 0));
}

// LayerNorm on the rows this rank holds: no collective; with SP its gradients are Partial.
template <class M, bool SP, class T>
void layernorm_case() {
  const int rows = kB * kT;
  const auto x = test::random_values<T>(rows * kC, 41), w = test::random_values<T>(kC, 42),
             b = test::random_values<T>(kC, 43), dy = test::random_values<T>(rows * kC, 44);
  Reference<T> ref;
  ref.y.resize(x.size());
  ref.dx.assign(x.size(), T{});
  ref.grads.assign(2, std::vector<T>(kC, T{}));
  std::vector<acc_t<T>> mean(rows), rstd(rows);
  kh::layernorm_forward(ref.y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, kC);
  kh::layernorm_backward(ref.dx.data(), ref.grads[0].data(), ref.grads[1].data(), dy.data(), x.data(), w.data(),
                         mean.data(), rstd.data(), rows, kC);
  using L = NormAlone<M, SP, T>;
  auto rs = run_tp<L>([&](Coord c) { return L(kC, w, b, c); }, x, {kB, kT, kC}, dy, {kB, kT, kC}, ref);
  check<T>(label<M, SP>("LayerNorm", std::is_same_v<T, float> ? "fp32" : "fp64"), rs, 2, counts(0, 0, 0),
           counts(0, 0, 0));
}

template <class M, bool SP>
void all_cases() {
  column_case<M, SP, float>();
  row_case<M, SP, float>();
  mlp_case<M, SP, float>();
  attention_case<M, SP, float>();
  layernorm_case<M, SP, float>();
  column_case<M, SP, double>();
  row_case<M, SP, double>();
  mlp_case<M, SP, double>();
  attention_case<M, SP, double>();
  layernorm_case<M, SP, double>();
}

}  // namespace

TEST_CASE("TP<2> without sequence parallelism") { all_cases<Mesh<TP<2>>, false>(); }
TEST_CASE("TP<2> with sequence parallelism") { all_cases<Mesh<TP<2>>, true>(); }
TEST_CASE("TP<4> without sequence parallelism") { all_cases<Mesh<TP<4>>, false>(); }
TEST_CASE("TP<4> with sequence parallelism") { all_cases<Mesh<TP<4>>, true>(); }

TEST_CASE("the counting communicator counts calls and bytes per kind") {
  host::run(2, [](host::Comm& world) {
    Counting<host::Comm> c(world);
    std::vector<float> a(6, 1.0f), b(6), g(12), s(3);
    c.all_reduce(std::span<const float>(a), std::span<float>(b));
    c.all_gather(std::span<const float>(a), std::span<float>(g));
    c.reduce_scatter(std::span<const float>(a), std::span<float>(s));
    auto sub = c.split(0, c.rank(), "sub");
    sub.barrier();
    const CommCounts n = c.counts();
    if (n.all_reduce != Tally{1, 24} || n.all_gather != Tally{1, 24} || n.reduce_scatter != Tally{1, 24} ||
        n.barrier.calls != 0 || sub.counts().barrier.calls != 1 || b[0] != 2.0f || s[0] != 2.0f)
      throw std::runtime_error("counting communicator miscounted");
  });
}

TEST_CASE("sequence parallelism needs the sequence to split over TP") {
  using M = Mesh<TP<4>>;
  using L = ColumnParallelLinear<M, true>;
  using In = L::input_type;
  CHECK_THROWS_WITH_AS(In(In::layout_type({2, 6, 16}, M::coord(0)), std::vector<float>(2 * 6 * 16 / 4)),
                       doctest::Contains("cannot shard dimension 1 of size 6 into 4"), std::invalid_argument);
}
