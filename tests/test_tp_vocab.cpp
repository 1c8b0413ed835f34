// Vocab-parallel embedding and cross-entropy on the host backend, against the
// serial kernels on the full table / full logits.
//
// For Mesh<TP<2>> and Mesh<TP<4>> (the embedding each with and without
// sequence parallelism), V = 37 padded to Vp = 40, so padding rows/columns exist:
//  - the embedding output, gathered, equals kernels::host::embedding_forward on
//    the full table (wpe = 0: position embeddings are the model's), and the
//    gathered wte gradient equals embedding_backward's;
//  - the loss (on every rank) equals the mean of crossentropy_forward_backward's
//    losses on the full logits, and the gathered d-logits equal its d-logits,
//    with the padding columns set to 1e4 (they would dominate if they counted);
// within 1e-5 relative in fp32 (max |tp - serial| / max |serial| per tensor).
// A Counting communicator checks the collectives: embedding forward 1
// all-reduce (SP: 1 reduce-scatter), backward none (SP: 1 all-gather); loss 3
// all-reduces.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/kernels/host/crossentropy.hpp"
#include "fived/kernels/host/embedding.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/tp/vocab.hpp"
#include "support/compare.hpp"

using namespace fived;
using namespace fived::nn::tp;
namespace kh = fived::kernels::host;
using i64 = std::int64_t;

static_assert(std::is_same_v<VocabParallelEmbedding<Mesh<TP<2>>, false>::output_placement, Replicate>);
static_assert(std::is_same_v<VocabParallelEmbedding<Mesh<TP<2>>, true>::output_placement, Shard<1>>);
static_assert(std::is_same_v<VocabParallelEmbedding<Mesh<TP<2>>, true>::weight_placement, Shard<0>>);
static_assert(std::is_same_v<VocabParallelCrossEntropy<Mesh<TP<2>>>::input_placement, Shard<2>>);
static_assert(padded_vocab(37, 4) == 40 && padded_vocab(40, 4) == 40 && padded_vocab(50257, 128) == 50304);

namespace {

constexpr i64 kB = 2, kT = 8, kC = 16, kV = 37, kVp = 40;
constexpr double kTol = 1e-5;


// Ids in [0, V) with repeats, and the last real id (in the last shard) present.
std::vector<int> random_ids(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> id(0, kV - 1);
  std::vector<int> v(n);
  for (auto& e : v) e = id(gen);
  v[0] = kV - 1;
  v[1] = 0;
  v[2] = v[3] = v[5] = 7;  // repeated
  return v;
}

using fived::test::max_rel_error;

template <class X, class C>
auto gathered(const X& x, C& tp) {
  return redistribute<Axis::tp, Replicate>(x, tp).storage();
}

bool calls_are(const CommCounts& c, int ar, int rs, int ag) {
  return c.all_reduce.calls == ar && c.reduce_scatter.calls == rs && c.all_gather.calls == ag &&
         c.total_calls() == ar + rs + ag;
}

struct Result {
  double err_y = INFINITY, err_dw = INFINITY;
  CommCounts fwd, bwd;
};

template <class M, bool SP>
void embedding_case() {
  const auto wte = test::random_values<float>(kVp * kC, 1);
  const auto tokens = random_ids(kB * kT, 2);
  const auto dy = test::random_values<float>(kB * kT * kC, 3);
  // Serial: the full table, wpe = 0 (position embeddings are added by the model).
  std::vector<float> wpe(kT * kC, 0.0f), y_ref(kB * kT * kC), dw_ref(kVp * kC, 0.0f), dwpe(kT * kC, 0.0f);
  kh::embedding_forward(y_ref.data(), tokens.data(), wte.data(), wpe.data(), kB, kT, kC, kV);
  kh::embedding_backward(dw_ref.data(), dwpe.data(), dy.data(), tokens.data(), kB, kT, kC);

  using L = VocabParallelEmbedding<M, SP>;
  std::vector<Result> rs(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(Counting<host::Comm>(world));
    auto& tp = ctx.template comm<Axis::tp>();
    L emb(kVp, kC, wte, ctx.coord());
    using Out = typename L::output_type;
    const auto dyin = Out::slice_of(typename Out::layout_type({kB, kT, kC}, ctx.coord()), dy);
    Result& r = rs[ctx.rank()];
    const CommCounts c0 = tp.counts();
    const Out y = emb.forward(tokens, kB, kT, tp);
    const CommCounts c1 = tp.counts();
    emb.backward(dyin, tp);
    const CommCounts c2 = tp.counts();
    r.fwd = c1 - c0;
    r.bwd = c2 - c1;
    r.err_y = max_rel_error(gathered(y, tp), y_ref);
    r.err_dw = max_rel_error(gathered(emb.weight_grad(), tp), dw_ref);
  });
  double worst = 0;
  for (std::size_t i = 0; i < rs.size(); ++i) {
    CAPTURE(i);
    CHECK(rs[i].err_y <= kTol);
    CHECK(rs[i].err_dw <= kTol);
    worst = std::max({worst, rs[i].err_y, rs[i].err_dw});
    // fwd: Partial -> Replicate all-reduce | Partial -> Shard<1> reduce-scatter;
    // bwd: dy -> Replicate: identity | all-gather.
    CHECK(calls_are(rs[i].fwd, SP ? 0 : 1, SP ? 1 : 0, 0));
    CHECK(calls_are(rs[i].bwd, 0, 0, SP ? 1 : 0));
  }
  std::printf("VocabParallelEmbedding %-10s%s max rel err %.3g (y %.3g, dwte %.3g)  fwd AR/RS/AG %lld/%lld/%lld  bwd "
              "AR/RS/AG %lld/%lld/%lld\n",
              M::name().c_str(), SP ? " SP" : "   ", worst, rs[0].err_y, rs[0].err_dw,
              (long long)rs[0].fwd.all_reduce.calls, (long long)rs[0].fwd.reduce_scatter.calls,
              (long long)rs[0].fwd.all_gather.calls, (long long)rs[0].bwd.all_reduce.calls,
              (long long)rs[0].bwd.reduce_scatter.calls, (long long)rs[0].bwd.all_gather.calls);
}

template <class M>
void crossentropy_case() {
  const int N = kB * kT;
  auto logits = test::random_values<float>(N * kVp, 11);
  for (auto& e : logits) e *= 4.0f;
  // Padding columns: huge, so they would dominate max, sum and loss if they counted.
  for (int i = 0; i < N; ++i)
    for (i64 j = kV; j < kVp; ++j) logits[i * kVp + j] = 1e4f;
  auto targets = random_ids(N, 12);
  targets[4] = kV - 1;  // a target in the last (partly padded) shard
  std::vector<float> losses(N), dlogits_ref(N * kVp);
  kh::crossentropy_forward_backward(losses.data(), dlogits_ref.data(), logits.data(), targets.data(), N,
                                    static_cast<int>(kVp), static_cast<int>(kV), 1.0f / N);
  double mean = 0;
  for (float l : losses) mean += l;
  mean /= N;
  REQUIRE(std::isfinite(mean));
  REQUIRE(mean < 20.0);  // the padding (1e4) did not enter the softmax
  for (int i = 0; i < N; ++i)
    for (i64 j = kV; j < kVp; ++j) REQUIRE(dlogits_ref[i * kVp + j] == 0.0f);

  using CE = VocabParallelCrossEntropy<M>;
  using Lg = typename CE::logits_type;
  std::vector<double> err_loss(M::size, INFINITY), err_d(M::size, INFINITY);
  std::vector<CommCounts> cnt(M::size);
  std::vector<float> loss_of(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(Counting<host::Comm>(world));
    auto& tp = ctx.template comm<Axis::tp>();
    Lg lg = Lg::slice_of(typename Lg::layout_type({kB, kT, kVp}, ctx.coord()), logits);
    CE ce(kV);
    const CommCounts c0 = tp.counts();
    const float loss = ce.forward_backward(lg, targets, tp);
    cnt[ctx.rank()] = tp.counts() - c0;
    loss_of[ctx.rank()] = loss;
    err_loss[ctx.rank()] = std::abs(loss - mean) / std::abs(mean);
    err_d[ctx.rank()] = max_rel_error(gathered(lg, tp), dlogits_ref);
  });
  double worst = 0;
  for (int r = 0; r < M::size; ++r) {
    CAPTURE(r);
    CHECK(err_loss[r] <= kTol);
    CHECK(err_d[r] <= kTol);
    CHECK(loss_of[r] == loss_of[0]);  // the same loss on every rank
    CHECK(calls_are(cnt[r], 3, 0, 0));
    worst = std::max({worst, err_loss[r], err_d[r]});
  }
  std::printf("VocabParallelCrossEntropy %-10s max rel err %.3g (loss %.3g, dlogits %.3g)  loss %.6f  AR %lld\n",
              M::name().c_str(), worst, err_loss[0], err_d[0], loss_of[0], (long long)cnt[0].all_reduce.calls);
}

}  // namespace

TEST_CASE("vocab-parallel embedding, TP<2>") {
  embedding_case<Mesh<TP<2>>, false>();
  embedding_case<Mesh<TP<2>>, true>();
}
TEST_CASE("vocab-parallel embedding, TP<4>") {
  embedding_case<Mesh<TP<4>>, false>();
  embedding_case<Mesh<TP<4>>, true>();
}
TEST_CASE("vocab-parallel cross-entropy, TP<2> and TP<4>, padded vocabulary") {
  crossentropy_case<Mesh<TP<2>>>();
  crossentropy_case<Mesh<TP<4>>>();
}

TEST_CASE("a padded vocabulary that does not split over TP gives a readable error") {
  using M = Mesh<TP<4>>;
  const std::vector<float> wte(38 * kC, 0.0f);
  CHECK_THROWS_WITH_AS(VocabParallelEmbedding<M>(38, kC, wte, M::coord(0)),
                       doctest::Contains("pad the vocabulary to a multiple of TP"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(VocabParallelEmbedding<M>(38, kC, wte, M::coord(0)),
                       doctest::Contains("padded_vocab(V, 4) = 40"), std::invalid_argument);
}
