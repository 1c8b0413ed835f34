// Pipeline parallelism: where the layers go (pipeline/stage_layers.hpp).

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>

#include "fived/nn/gpt.hpp"
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
using U4 = StageLayers<GPT<eight>, 4, UniformCost>;
static_assert(U4::bounds == std::array<int, 5>{0, 2, 4, 6, 8});
using U3 = StageLayers<GPT<eight>, 3, UniformCost>;
static_assert(U3::count(0) + U3::count(1) + U3::count(2) == 8 && U3::cost_of(0) <= 3 && U3::cost_of(1) <= 3 &&
              U3::cost_of(2) <= 3);
// FLOP costs: the head weighs 3 blocks here, so the last part gets fewer blocks.
using F4 = StageLayers<GPT<big_vocab>, 4>;
static_assert(FlopCost<GPT<big_vocab>>::head() == 3.0 * FlopCost<GPT<big_vocab>>::block());
static_assert(F4::count(3) == 1 && F4::count(0) + F4::count(1) + F4::count(2) == 7);
static_assert(F4::cost_of(3) == 4 * FlopCost<GPT<big_vocab>>::block(), "the slowest part: 1 block + the head");
// Even: equal parts whatever the cost.
using E4 = StageLayers<GPT<big_vocab>, 4, FlopCost, true>;
static_assert(E4::bounds == std::array<int, 5>{0, 2, 4, 6, 8});
// One part is the whole model.
static_assert(StageLayers<GPT<eight>, 1>::bounds == std::array<int, 2>{0, 8});
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
          const double cost = (bounds[p + 1] - bounds[p]) * FlopCost<GPT<big_vocab>>::block() +
                              (p == Parts - 1 ? FlopCost<GPT<big_vocab>>::head() : 0.0);
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
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/pipeline/executor.hpp"
#include "fived/pipeline/schedules.hpp"
#include "fived/train/data_parallel.hpp"
#include "support/batches.hpp"

namespace {

// 8 blocks: P x V parts of 4, 2 or 1 for P x V = 2, 4, 8.
using model_cfg = eight;
using Serial = GPT<model_cfg>;
constexpr int B = 4, T = 8, steps = 3;
const GptInit init{11, 0.05};
const AdamWConfig hp{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f};

void global_batch(int step, int micro, std::vector<int>& tok, std::vector<int>& tgt) {
  test::global_batch(step, micro, B, T, model_cfg::vocab, tok, tgt);
}

struct Result {
  std::vector<double> losses;
  std::vector<float> weights, grads;  // the serial layout (zeros where another rank holds the tensor)
};

Result serial_run(int micro) {
  Serial m(init);
  DataParallel<Serial> dp(m, hp, micro);
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

// Chunk c of rank r holds virtual stage shape.stage(r, c): its part of the 8 blocks.
template <class Sched, class M, class SP, int r, int c>
using ChunkModel = GPT<model_cfg, M, float, Host, SP,
                       typename StageLayers<GPT<model_cfg>, Sched::table.ranks * Sched::table.chunks, UniformCost,
                                            true>::template part<Sched::table.shape.stage(r, c)>>;

// A model chunk and its trainer (averaging over `micro` micro-batches), made in place.
template <class Model, class Policy, int micro>
struct Chunk {
  Model model;
  DataParallel<Model, Policy> dp;
  template <class Ctx>
  explicit Chunk(Ctx& ctx) : model(ctx, init), dp(model, ctx, hp, micro) {}
  // Every rank of the TP group calls it (a gather); `keep`: this one writes.
  void copy_into(Result& out, bool keep) {
    const std::vector<float> w = model.gather_params(), g = model.gather_grads();
    if (!keep) return;
    for (const ParamInfo& t : Model::serial_layout::tensors) {
      const ParamInfo& to = Serial::layout::tensors[static_cast<std::size_t>(*Serial::layout::find(t.name()))];
      std::copy_n(w.begin() + static_cast<std::ptrdiff_t>(t.offset), t.size(),
                  out.weights.begin() + static_cast<std::ptrdiff_t>(to.offset));
      std::copy_n(g.begin() + static_cast<std::ptrdiff_t>(t.offset), t.size(),
                  out.grads.begin() + static_cast<std::ptrdiff_t>(to.offset));
    }
  }
};

template <class Sched, class M, class Policy, class SP, int r, class Ctx, std::size_t... c>
void run_rank(Ctx& ctx, Result& out, std::index_sequence<c...>) {
  constexpr int micro = Sched::table.micro_batches;
  std::tuple<Chunk<ChunkModel<Sched, M, SP, r, static_cast<int>(c)>, Policy, micro>...> chunks{
      (static_cast<void>(c), ctx)...};
  auto exec = pipeline::make_executor(Sched::table, r, ctx.template comm<Axis::pp>(),
                                      std::tie(std::get<c>(chunks).model...), std::tie(std::get<c>(chunks).dp...));
  std::vector<int> tok, tgt;
  const bool keep = ctx.coord()[Axis::dp] == 0 && ctx.coord()[Axis::tp] == 0;
  for (int s = 0; s < steps; ++s) {
    global_batch(s, micro, tok, tgt);
    const double loss = exec.step(tok, tgt, B, T);
    if (keep) out.losses.push_back(loss);
  }
  (std::get<c>(chunks).copy_into(out, keep), ...);
}

// Per pipeline stage: its losses and its tensors in the serial layout.
template <class Sched, class M = Mesh<PP<Sched::table.ranks>>, class Policy = NoZeRO, class SP = NoSequenceParallel>
std::vector<Result> pipeline_run() {
  constexpr int P = Sched::table.ranks, V = Sched::table.chunks;
  static_assert(M::pp == P);
  std::vector<Result> per_stage(P);
  for (Result& r : per_stage) r.weights.assign(Serial::layout::size, 0.0f), r.grads.assign(Serial::layout::size, 0.0f);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    const int stage = ctx.coord()[Axis::pp];
    [&]<int... r>(std::integer_sequence<int, r...>) {
      (..., (stage == r ? run_rank<Sched, M, Policy, SP, r>(ctx, per_stage[r], std::make_index_sequence<V>{}) : void()));
    }(std::make_integer_sequence<int, P>{});
  });
  return per_stage;
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, s = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    d = std::max(d, std::abs(double(a[i]) - b[i])), s = std::max(s, std::abs(double(b[i])));
  return d / s;
}

double worst_loss = 0, worst_grad = 0, worst_weight = 0;

template <class Sched, class M = Mesh<PP<Sched::table.ranks>>, class Policy = NoZeRO, class SP = NoSequenceParallel>
void equals_serial() {
  constexpr int micro = Sched::table.micro_batches;
  CAPTURE(M::name());
  CAPTURE(Sched::table.ranks);
  CAPTURE(micro);
  CAPTURE(Sched::table.chunks);
  CAPTURE(Policy::stage);
  const Result ref = serial_run(micro);
  const std::vector<Result> stages = pipeline_run<Sched, M, Policy, SP>();
  std::vector<float> w(ref.weights.size(), 0.0f), g(ref.grads.size(), 0.0f);
  for (const Result& r : stages)  // each tensor lives on one stage, zeros elsewhere
    for (std::size_t i = 0; i < w.size(); ++i) w[i] += r.weights[i], g[i] += r.grads[i];
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    const auto i = static_cast<std::size_t>(s);
    for (const Result& r : stages) CHECK(r.losses[i] == stages[0].losses[i]);  // the same loss on every stage
    const double e = std::abs(stages[0].losses[i] - ref.losses[i]) / ref.losses[i];
    worst_loss = std::max(worst_loss, e);
    CHECK(e <= 1e-6);
  }
  // The last step's gradients (reduced over the micro-batches and DP, clipped) where the
  // model's buffer holds them all: without ZeRO.
  if constexpr (Policy::stage == 0) {
    const double eg = max_rel(g, ref.grads);
    worst_grad = std::max(worst_grad, eg);
    CHECK(eg <= 1e-5);
  }
  const double ew = max_rel(w, ref.weights);  // the weights after 3 AdamW steps
  worst_weight = std::max(worst_weight, ew);
  CHECK(ew <= 1e-5);
}

template <int P>
void every_schedule() {
  using namespace pipeline;
  equals_serial<GPipe<P, P>>();
  equals_serial<GPipe<P, 2 * P>>();
  equals_serial<GPipe<P, 3 * P + 1>>();
  equals_serial<OneFOneB<P, P>>();
  equals_serial<OneFOneB<P, 2 * P>>();
  equals_serial<OneFOneB<P, 3 * P + 1>>();
  equals_serial<Interleaved1F1B<P, P, 2>>();
  equals_serial<Interleaved1F1B<P, 2 * P, 2>>();
  equals_serial<ZBH1<P, P>>();
  equals_serial<ZBH1<P, 2 * P>>();
  equals_serial<ZBH1<P, 3 * P + 1>>();
  equals_serial<ZBV<P, 2 * P>>();
  equals_serial<ZBV<P, 3 * P + 1>>();
  equals_serial<DualPipeV<P, 2 * P>>();
  equals_serial<DualPipeV<P, 3 * P + 1>>();
  // the messages placed for other costs (I 1.4 F, W 0.6 F)
  constexpr Cost c{.forward = 29, .backward = 57, .input_grad = 40, .weight_grad = 17};
  equals_serial<ZBH1<P, 2 * P, c>>();
  equals_serial<ZBV<P, 2 * P, c>>();
  equals_serial<DualPipeV<P, 2 * P, c>>();
}

}  // namespace

// M in {P, 2P, 3P + 1} where the schedule allows it (interleaved: multiples of P; ZB-V: M >= 2P).
TEST_CASE("PP 2 and 4, every schedule: loss, gradients and weights after 3 steps equal the serial model") {
  every_schedule<2>();
  every_schedule<4>();
  MESSAGE("worst relative error: loss " << worst_loss << ", gradients " << worst_grad << ", weights " << worst_weight);
}

TEST_CASE("Mesh<DP<2>, PP<2>, TP<2>> (8 ranks, SP): 1F1B with ZeRO-1 and ZB-H1 with ZeRO-2 equal the serial model") {
  using M = Mesh<DP<2>, PP<2>, TP<2>>;
  equals_serial<pipeline::OneFOneB<2, 4>, M, ZeRO<1>, SequenceParallel>();
  equals_serial<pipeline::ZBH1<2, 3>, M, ZeRO<2>, SequenceParallel>();
  equals_serial<pipeline::Interleaved1F1B<2, 2, 2>, M, NoZeRO, SequenceParallel>();
  MESSAGE("worst relative error: loss " << worst_loss << ", gradients " << worst_grad << ", weights " << worst_weight);
}

namespace {
// ZeRO-2's transient gradients on stage r of Mesh<DP<2>, PP<2>> after two steps of Sched.
template <class Sched, int r>
std::size_t transient_peak(MeshContext<Mesh<DP<2>, PP<2>>, host::Comm>& ctx) {
  Chunk<ChunkModel<Sched, Mesh<DP<2>, PP<2>>, NoSequenceParallel, r, 0>, ZeRO<2>, Sched::table.micro_batches> c(ctx);
  auto exec = pipeline::make_executor(Sched::table, r, ctx.comm<Axis::pp>(), std::tie(c.model), std::tie(c.dp));
  std::vector<int> tok, tgt;
  for (int s = 0; s < 2; ++s) {
    global_batch(s, Sched::table.micro_batches, tok, tgt);
    exec.step(tok, tgt, B, T);
  }
  return c.dp.memory().transient_peak;
}
template <class Sched>
std::vector<std::size_t> transient_peaks() {
  std::vector<std::size_t> by_rank(4);
  host::run(4, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<DP<2>, PP<2>>>(world);
    by_rank[static_cast<std::size_t>(ctx.rank())] =
        ctx.coord()[Axis::pp] == 0 ? transient_peak<Sched, 0>(ctx) : transient_peak<Sched, 1>(ctx);
  });
  return by_rank;
}
}  // namespace

// A split backward writes its gradients at W alone: ZeRO-2 holds a unit's gradients from its
// W to their reduction, as a whole backward does, not from the I before.
TEST_CASE("ZeRO-2 on Mesh<DP<2>, PP<2>>: ZB-H1's transient gradients are 1F1B's (one unit at a time)") {
  const std::vector<std::size_t> one = transient_peaks<pipeline::OneFOneB<2, 4>>();
  CHECK(transient_peaks<pipeline::ZBH1<2, 4>>() == one);
  CHECK(one[0] > 0);
}
