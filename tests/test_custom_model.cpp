// A model fived does not ship (examples/parallel_blocks.hpp: parallel attention + MLP blocks,
// written outside namespace fived) trained by the Trainer on a mesh equals its own serial
// run: the gradient read after the first reduction, every step's loss, and the weights after
// the last step, to fp32's 1e-5 relative. On Mesh<DP<2>, PP<2>, TP<2>> (SP, ZeRO-1, 1F1B)
// and Mesh<CP<2>, TP<2>> (SP, ring attention). And its plan, computed at compile time from
// the model type (plan::from_model), is what a Trainer step sends and what the model holds.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
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
#include "support/trainer_checks.hpp"

using namespace fived;
using parallel_gpt::Model;
using Serial = Model<>;

namespace {

constexpr int steps = 3, B = 4, T = 8;
const TrainerConfig hp{.adamw = {.beta2 = 0.95, .eps = 1e-4, .weight_decay = 0.1, .max_norm = 0.5},
                       .lr = ConstantLr{3e-3}};
const GptInit init{7, 0.1};

template <class M, class Policy, class Sched>
void equals_serial(const std::string& what) {
  test::trainer_equals_serial<Serial, Model<M, SequenceParallel>, Policy, Sched>(what, hp, init, steps, B, T,
                                                                                  parallel_gpt::config::vocab);
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
  const test::StepTraffic got = test::step_traffic<Model<M, SequenceParallel>, ZeRO<1>, Sched>(hp, init, tok, tgt, B, T);
  test::check_traffic<P>(got);
  for (const plan::Traffic& x : got.by_rank)
    CHECK(x.tp.all_reduce.calls > 0);  // the LayerNorms' SP sums: one a block, its bytes one norm's
}

TEST_CASE("the custom model's plan: its buffers after a forward and backward on Mesh<CP<2>, TP<2>> are the planned bytes") {
  using M = Mesh<CP<2>, TP<2>>;
  using P = PlanOf<M, NoZeRO, Accumulate<1>>;
  std::vector<int> tok, tgt;
  test::global_batch(1, 1, B, T, parallel_gpt::config::vocab, tok, tgt);
  const std::size_t held = test::bytes_held_after_step<Model<M, SequenceParallel>>(init, tok, tgt, B, T);
  const plan::Memory& m = P::memory;
  const plan::Bytes planned = m.parameters + m.gradients + m.peak_activations + m.recompute + m.work;
  CHECK(m.in_flight == 1);
  CHECK(held == planned + sizeof(float));  // + the (unused) router bias of a dense model
}
