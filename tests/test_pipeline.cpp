// Pipeline parallelism: where the layers go (pipeline/stage_layers.hpp).

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>

#include "fived/pipeline/stage_layers.hpp"

using namespace fived;

namespace {

struct eight : gpt_config {
  static constexpr int layers = 8, d_model = 32, heads = 4, vocab = 53, max_seq = 16, vocab_multiple = 16;
  static constexpr bool tied = false;
};
// A vocabulary so large that the head costs about 3 blocks: 2*C*Vp = 2*32*1152 vs 24*C^2 = 24576.
struct big_vocab : eight {
  static constexpr int vocab = 1100, vocab_multiple = 128;
};

// Uniform costs: equal parts, the remainder on the first parts.
using U4 = StageLayers<eight, 4, UniformCost>;
static_assert(U4::bounds == std::array<int, 5>{0, 2, 4, 6, 8});
using U3 = StageLayers<eight, 3, UniformCost>;
static_assert(U3::count(0) + U3::count(1) + U3::count(2) == 8 && U3::cost_of(0) <= 3 && U3::cost_of(1) <= 3 &&
              U3::cost_of(2) <= 3);
// FLOP costs: the head weighs 3 blocks here, so the last part gets fewer blocks.
using F4 = StageLayers<big_vocab, 4>;
static_assert(FlopCost<big_vocab>::head() == 3.0 * FlopCost<big_vocab>::block());
static_assert(F4::count(3) == 1 && F4::count(0) + F4::count(1) + F4::count(2) == 7);
static_assert(F4::cost_of(3) == 4 * FlopCost<big_vocab>::block(), "the slowest part: 1 block + the head");
// Even: equal parts whatever the cost.
using E4 = StageLayers<big_vocab, 4, FlopCost, true>;
static_assert(E4::bounds == std::array<int, 5>{0, 2, 4, 6, 8});
// One part is the whole model.
static_assert(StageLayers<eight, 1>::bounds == std::array<int, 2>{0, 8});
static_assert(std::is_same_v<U4::part<1>, Layers<2, 2>> && std::is_same_v<F4::part<3>, Layers<7, 1>>);

// The most expensive part is the least possible: no other cut of 8 blocks into 4 does better.
template <class S, int Parts>
double brute_force_best() {
  double best = 1e300;
  for (int a = 1; a < 8; ++a)
    for (int b = a + 1; b < 8; ++b)
      for (int c = b + 1; c < 8; ++c) {
        const int bounds[] = {0, a, b, c, 8};
        double worst = 0;
        for (int p = 0; p < Parts; ++p) {
          const double cost = (bounds[p + 1] - bounds[p]) * FlopCost<big_vocab>::block() +
                              (p == Parts - 1 ? FlopCost<big_vocab>::head() : 0.0);
          worst = std::max(worst, cost);
        }
        best = std::min(best, worst);
      }
  return best;
}

}  // namespace

TEST_CASE("stage layers: the balanced cut is optimal") {
  double worst = 0;
  for (int p = 0; p < 4; ++p) worst = std::max(worst, F4::cost_of(p));
  CHECK(worst == brute_force_best<F4, 4>());
}

// ---- the executor against the serial model ---------------------------------------------------

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/pipeline/executor.hpp"
#include "fived/train/data_parallel.hpp"

namespace {

struct four : gpt_config {
  static constexpr int layers = 4, d_model = 32, heads = 4, vocab = 53, max_seq = 16, vocab_multiple = 16;
  static constexpr bool tied = false;
};
constexpr int B = 4, T = 8;
const GptInit init{11, 0.05};
const AdamWConfig hp{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f};

void global_batch(int step, int micro, std::vector<int>& tok, std::vector<int>& tgt) {
  std::mt19937 rng(500u + static_cast<unsigned>(step));
  std::uniform_int_distribution<int> d(0, four::vocab - 1);
  tok.resize(static_cast<std::size_t>(micro) * B * T);
  tgt.resize(tok.size());
  for (int& t : tok) t = d(rng);
  for (std::size_t i = 0; i < tok.size(); ++i) tgt[i] = (tok[i] * 5 + 1) % four::vocab;
}

struct Result {
  std::vector<double> losses;
  std::vector<float> weights, grads;  // the serial layout
};

Result serial_run(int micro, int steps) {
  GPT<four> m(init);
  DataParallel<GPT<four>> dp(m, hp, micro);
  Result r;
  std::vector<int> tok, tgt;
  for (int s = 0; s < steps; ++s) {
    global_batch(s, micro, tok, tgt);
    r.losses.push_back(dp.step(tok, tgt, B, T));
  }
  r.weights.assign(m.params().begin(), m.params().end());
  r.grads.assign(m.grads().begin(), m.grads().end());
  return r;
}

using pipeline::Op;
using pipeline::Step;
using Program = std::vector<Step>;

// Hand-written programs for two stages (rank 0: the first part, rank 1: the last).
// GPipe: every forward, then every backward.
std::vector<Program> gpipe2(int micro) {
  Program r0, r1;
  int g = 0;
  for (int m = 0; m < micro; ++m) {
    r0.push_back({Op::forward, m, 0}), r0.push_back({Op::send_activation, m, 0, 1, g});
    r1.push_back({Op::recv_activation, m, 0, 0, g++}), r1.push_back({Op::forward, m, 0});
  }
  for (int m = 0; m < micro; ++m) {
    r1.push_back({Op::backward, m, 0}), r1.push_back({Op::send_gradient, m, 0, 0, g});
    r0.push_back({Op::recv_gradient, m, 0, 1, g++}), r0.push_back({Op::backward, m, 0});
  }
  return {r0, r1};
}
// 1F1B: one warm-up forward on rank 0, then a forward and a backward in turn.
std::vector<Program> one_f_one_b2(int micro) {
  Program r0, r1;
  int g = 0;
  auto fwd = [&](int m) {
    r0.push_back({Op::forward, m, 0}), r0.push_back({Op::send_activation, m, 0, 1, g});
    r1.push_back({Op::recv_activation, m, 0, 0, g++}), r1.push_back({Op::forward, m, 0});
  };
  auto bwd = [&](int m) {
    r1.push_back({Op::backward, m, 0}), r1.push_back({Op::send_gradient, m, 0, 0, g});
    r0.push_back({Op::recv_gradient, m, 0, 1, g++}), r0.push_back({Op::backward, m, 0});
  };
  fwd(0);
  for (int m = 1; m < micro; ++m) fwd(m), bwd(m - 1);
  bwd(micro - 1);
  return {r0, r1};
}

template <int Stage>
using StageModel = GPT<four, Mesh<PP<2>>, float, Host, NoSequenceParallel,
                       typename StageLayers<four, 2, UniformCost>::template part<Stage>>;

template <int Stage>
void run_stage(MeshContext<Mesh<PP<2>>, host::Comm>& ctx, const Program& program, int micro, int steps, Result& out) {
  StageModel<Stage> model(ctx, init);
  DataParallel<StageModel<Stage>> dp(model, hp, micro);
  pipeline::Executor exec(program, micro, ctx.comm<Axis::pp>(), std::tie(model), std::tie(dp));
  std::vector<int> tok, tgt;
  for (int s = 0; s < steps; ++s) {
    global_batch(s, micro, tok, tgt);
    out.losses.push_back(exec.step(tok, tgt, B, T));
  }
  for (const ParamInfo& t : StageModel<Stage>::layout::tensors) {
    const ParamInfo& w = GPT<four>::layout::tensors[static_cast<std::size_t>(*GPT<four>::layout::find(t.name()))];
    std::copy_n(model.params().begin() + static_cast<std::ptrdiff_t>(t.offset), t.size(),
                out.weights.begin() + static_cast<std::ptrdiff_t>(w.offset));
    std::copy_n(model.grads().begin() + static_cast<std::ptrdiff_t>(t.offset), t.size(),
                out.grads.begin() + static_cast<std::ptrdiff_t>(w.offset));
  }
}

// Both stages' tensors put together in the serial layout; losses from every rank.
std::vector<Result> pipeline_run(const std::vector<Program>& programs, int micro, int steps) {
  std::vector<Result> per_rank(2);
  Result merged;
  merged.weights.assign(GPT<four>::layout::size, 0.0f);
  merged.grads.assign(GPT<four>::layout::size, 0.0f);
  per_rank[0] = per_rank[1] = merged;
  host::run(2, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<PP<2>>>(world);
    const int stage = ctx.coord()[Axis::pp];
    if (stage == 0) run_stage<0>(ctx, programs[0], micro, steps, per_rank[0]);
    else run_stage<1>(ctx, programs[1], micro, steps, per_rank[1]);
  });
  return per_rank;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(double(a[i]) - b[i])), s = std::max(s, std::abs(double(b[i])));
  return d / s;
}

void compare(const std::vector<Program>& programs, int micro) {
  constexpr int steps = 3;
  const Result ref = serial_run(micro, steps);
  const std::vector<Result> ranks = pipeline_run(programs, micro, steps);
  std::vector<float> w(ref.weights.size()), g(ref.grads.size());
  for (std::size_t i = 0; i < w.size(); ++i)  // each element lives on one stage, zeros on the other
    w[i] = ranks[0].weights[i] + ranks[1].weights[i], g[i] = ranks[0].grads[i] + ranks[1].grads[i];
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    CHECK(ranks[0].losses[static_cast<std::size_t>(s)] == ranks[1].losses[static_cast<std::size_t>(s)]);  // every rank
    CHECK(std::abs(ranks[0].losses[static_cast<std::size_t>(s)] - ref.losses[static_cast<std::size_t>(s)]) <=
          1e-6 * ref.losses[static_cast<std::size_t>(s)]);
  }
  CHECK(rel(g, ref.grads) <= 1e-5);  // the last step's gradients (reduced, clipped)
  CHECK(rel(w, ref.weights) <= 1e-5);
}

}  // namespace

TEST_CASE("the executor on hand-written two-stage programs equals the serial model: GPipe and 1F1B") {
  for (int micro : {2, 3, 5}) {
    CAPTURE(micro);
    compare(gpipe2(micro), micro);
    compare(one_f_one_b2(micro), micro);
  }
}
