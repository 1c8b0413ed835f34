// A model fived does not ship (examples/parallel_blocks.hpp: parallel attention + MLP blocks,
// written outside namespace fived) trained by the Trainer on a mesh equals its own serial
// run: the gradient read after the first reduction, every step's loss, and the weights after
// the last step, to fp32's 1e-5 relative. On Mesh<DP<2>, PP<2>, TP<2>> (SP, ZeRO-1, 1F1B)
// and Mesh<CP<2>, TP<2>> (SP, ring attention). And its plan, computed at compile time from
// the model type (plan::from_model), is what a Trainer step sends and what the model holds.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <mutex>
#include <cmath>
#include <string>
#include <vector>

#include "../examples/parallel_blocks.hpp"
#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/plan/plan.hpp"
#include "fived/train/trainer.hpp"
#include "support/batches.hpp"
#include "support/compare.hpp"

using namespace fived;
using parallel_gpt::Model;
using Serial = Model<>;

namespace {

constexpr int steps = 3, B = 4, T = 8;
const TrainerConfig hp{.adamw = {.beta2 = 0.95, .eps = 1e-4, .weight_decay = 0.1, .max_norm = 0.5},
                       .lr = ConstantLr{3e-3}};
const GptInit init{7, 0.1};

struct Run {
  std::vector<float> grads;  // after the first reduction, serial layout
  std::vector<double> losses;
  std::vector<float> weights;  // after the last step, serial layout
};

// The serial model: the gradient of the first global batch (micro micro-batches), then
// `steps` optimizer steps.
Run serial_run(int micro) {
  Run r;
  std::vector<int> tok, tgt;
  {
    Serial m(init);
    test::global_batch(1, micro, B, T, parallel_gpt::config::vocab, tok, tgt);
    for (int k = 0; k < micro; ++k) {
      m.forward(tok.data() + k * B * T, tgt.data() + k * B * T, B, T);
      m.backward();
    }
    r.grads.assign(m.grads().begin(), m.grads().end());
    for (float& g : r.grads) g /= static_cast<float>(micro);
  }
  Serial m(init);
  DataParallel<Serial> dp(m, hp.adamw, micro);
  dp.optimizer().hp.lr = 3e-3;
  for (int s = 1; s <= steps; ++s) {
    test::global_batch(s, micro, B, T, parallel_gpt::config::vocab, tok, tgt);
    r.losses.push_back(dp.step(tok, tgt, B, T));
  }
  r.weights.assign(m.params().begin(), m.params().end());
  return r;
}

// Per tensor, max |got - ref| / max |ref|: the worst one, and its name.
double worst_tensor(const std::vector<float>& got, const std::vector<float>& ref, std::string& where) {
  REQUIRE(got.size() == ref.size());
  double worst = 0;
  for (const ParamInfo& t : Serial::serial_layout::tensors)
    if (const double e = test::max_rel_error(got, ref, t.offset, t.size()); e > worst) worst = e, where = t.name();
  return worst;
}

template <class M, class Policy, class Sched>
void equals_serial(const std::string& what) {
  using Parallel = Model<M, SequenceParallel>;
  constexpr int micro = Sched::table.micro_batches;
  const Run ref = serial_run(micro);
  std::vector<Run> got(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Run& mine = got[static_cast<std::size_t>(ctx.rank())];
    Trainer<Parallel, Policy, Sched> t(ctx, hp, init);
    std::vector<int> tok, tgt;
    for (int s = 1; s <= steps; ++s) {
      test::global_batch(s, micro, B, T, parallel_gpt::config::vocab, tok, tgt);
      if (s > 1) {
        mine.losses.push_back(t.step(s, tok, tgt, B, T));
        continue;
      }
      mine.losses.push_back(t.reduce(s, tok, tgt, B, T));
      mine.grads = t.serial_grads();
      t.update();
    }
    mine.weights = t.serial_params();
  });
  double loss = 0, grads = 0, weights = 0;
  std::string grad_at, weight_at;
  for (const Run& r : got) {
    for (int s = 0; s < steps; ++s)
      loss = std::max(loss, std::abs(r.losses[static_cast<std::size_t>(s)] - ref.losses[static_cast<std::size_t>(s)]) /
                                ref.losses[static_cast<std::size_t>(s)]);
    grads = std::max(grads, worst_tensor(r.grads, ref.grads, grad_at));
    weights = std::max(weights, worst_tensor(r.weights, ref.weights, weight_at));
  }
  MESSAGE(what << ": losses within " << loss << ", first gradient within " << grads << " (" << grad_at
               << "), weights after " << steps << " steps within " << weights << " (" << weight_at << ") of serial");
  CHECK(loss <= 1e-5);
  CHECK(grads <= 1e-5);
  CHECK(weights <= 1e-5);
  CHECK(ref.losses.back() < ref.losses.front());  // it trains
}

}  // namespace

static_assert(check_model<Serial>::ok && ModelPart<Serial>, "the custom model satisfies the model contract");
static_assert(Serial::layout::count == 2 + 4 * 10 + 3, "wte, wpe; 10 tensors a block; ln_f and lm_head");
static_assert(plan::from_model<Serial>().parameters() == static_cast<std::int64_t>(Serial::layout::num_parameters),
              "the plan counts the model's parameters: one LayerNorm a block");

TEST_CASE("parallel blocks (a model outside fived) on Mesh<DP<2>, PP<2>, TP<2>>, SP, ZeRO-1, 1F1B: equals serial") {
  equals_serial<Mesh<DP<2>, PP<2>, TP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 4>>("DP 2 x PP 2 x TP 2");
}

TEST_CASE("parallel blocks on Mesh<CP<2>, TP<2>>, SP, ring attention: equals serial") {
  equals_serial<Mesh<CP<2>, TP<2>>, NoZeRO, Accumulate<2>>("CP 2 x TP 2");
}

namespace {

// The run as the planner reads it, with the Trainer's cut of the blocks.
template <class M, class Policy, class Sched>
struct run : plan::layout {
  using mesh = M;
  using schedule = Sched;
  static constexpr bool sequence_parallel = true;
  static constexpr int zero = Policy::stage, element_bytes = 4, micro_batch = B / M::dp, sequence = T;
  static constexpr auto bounds =
      StageLayers<Model<M, SequenceParallel>, Sched::table.shape.ranks * Sched::table.shape.chunks>::bounds;
};
template <class M, class Policy, class Sched>
using PlanOf = plan::Plan<plan::from_model<Model<M, SequenceParallel>>(), run<M, Policy, Sched>>;

}  // namespace

TEST_CASE("the custom model's plan, from its type: a Trainer step's collectives on DP 2 x PP 2 x TP 2, group by group") {
  using M = Mesh<DP<2>, PP<2>, TP<2>>;
  using Sched = pipeline::OneFOneB<2, 4>;
  using P = PlanOf<M, ZeRO<1>, Sched>;
  std::vector<int> tok, tgt;
  test::global_batch(1, Sched::table.micro_batches, B, T, parallel_gpt::config::vocab, tok, tgt);
  std::mutex mu;
  std::vector<plan::Traffic> got(M::size);
  std::vector<int> pp_rank(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(Counting<host::Comm>(world));
    Trainer<Model<M, SequenceParallel>, ZeRO<1>, Sched> t(ctx, hp, init);
    auto counts = [&] {
      return plan::Traffic{ctx.template comm<Axis::tp>().counts(), ctx.template comm<Axis::cp>().counts(), {},
                           ctx.template comm<Axis::pp>().counts(), ctx.template comm<typename M::grad_group>().counts(), {}};
    };
    const plan::Traffic before = counts();
    t.step(1, tok, tgt, B, T);
    const plan::Traffic after = counts();
    std::lock_guard lock(mu);
    const auto r = static_cast<std::size_t>(ctx.rank());
    got[r] = {after.tp - before.tp, after.cp - before.cp, {}, after.pp - before.pp, after.grad - before.grad, {}};
    pp_rank[r] = ctx.coord()[Axis::pp];
  });
  for (int r = 0; r < M::size; ++r) {
    CAPTURE(r);
    const plan::Traffic& want = P::traffic_by_rank[static_cast<std::size_t>(pp_rank[static_cast<std::size_t>(r)])];
    const plan::Traffic& x = got[static_cast<std::size_t>(r)];
    CHECK(x.tp == want.tp);
    CHECK(x.pp == want.pp);
    CHECK(x.grad == want.grad);
    CHECK(x.tp.all_reduce.calls > 0);  // the LayerNorms' SP sums: one a block, its bytes one norm's
  }
}

TEST_CASE("the custom model's plan: its buffers after a forward and backward on Mesh<CP<2>, TP<2>> are the planned bytes") {
  using M = Mesh<CP<2>, TP<2>>;
  using P = PlanOf<M, NoZeRO, Accumulate<1>>;
  std::vector<int> tok, tgt;
  test::global_batch(1, 1, B, T, parallel_gpt::config::vocab, tok, tgt);
  const std::size_t before = buffer_bytes_held<Host>();
  std::size_t held = 0;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Model<M, SequenceParallel> model(ctx, init);
    model.forward(tok.data(), tgt.data(), B, T);
    model.backward();
    ctx.world().barrier();
    if (ctx.rank() == 0) held = buffer_bytes_held<Host>() - before;
    ctx.world().barrier();
  });
  const plan::Memory& m = P::memory;
  const plan::Bytes planned = m.parameters + m.gradients + m.peak_activations + m.recompute + m.work;
  CHECK(m.in_flight == 1);
  CHECK(held == M::size * (planned + sizeof(float)));  // + the (unused) router bias of a dense model
}
