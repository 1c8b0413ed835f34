#pragma once
// What the model tests ask of a Trainer on a mesh, for any model type: that it equals its own
// serial run (the gradient read after the first reduction, every step's loss, the weights
// after the last step), and what one of its steps sends, group by group, for a plan to match.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/plan/comm.hpp"
#include "fived/train/trainer.hpp"
#include "batches.hpp"
#include "compare.hpp"

namespace fived::test {

struct Run {
  std::vector<float> grads;  // after the first reduction, serial layout
  std::vector<double> losses;
  std::vector<float> weights;  // after the last step, serial layout
};

// The serial model: the gradient of the first global batch (micro micro-batches of [B, T]),
// then `steps` optimizer steps at the schedule's constant learning rate.
template <class Serial>
Run serial_run(const TrainerConfig& hp, const GptInit& init, int steps, int micro, int B, int T, int vocab) {
  Run r;
  std::vector<int> tok, tgt;
  {
    Serial g(init);
    test::global_batch(1, micro, B, T, vocab, tok, tgt);
    for (int k = 0; k < micro; ++k) {
      g.forward(tok.data() + k * B * T, tgt.data() + k * B * T, B, T);
      g.backward();
    }
    r.grads.assign(g.grads().begin(), g.grads().end());
    for (float& x : r.grads) x /= static_cast<float>(micro);
  }
  Serial m(init);
  DataParallel<Serial> dp(m, hp.adamw, micro);
  dp.optimizer().hp.lr = hp.lr(1);
  for (int s = 1; s <= steps; ++s) {
    test::global_batch(s, micro, B, T, vocab, tok, tgt);
    r.losses.push_back(dp.step(tok, tgt, B, T));
  }
  r.weights.assign(m.params().begin(), m.params().end());
  return r;
}

// Per tensor of a serial layout, max |got - ref| / max |ref|: the worst one, and its name.
template <class Layout>
double worst_tensor(const std::vector<float>& got, const std::vector<float>& ref, std::string& where) {
  REQUIRE(got.size() == ref.size());
  double worst = 0;
  for (const ParamInfo& t : Layout::tensors)
    if (const double e = max_rel_error(got, ref, t.offset, t.size()); e > worst) worst = e, where = t.name();
  return worst;
}

// Trainer<Model, Policy, Sched> on Model's mesh against Serial over `steps` steps, to fp32's
// 1e-5 relative, and the serial run's loss falls.
template <class Serial, class Model, class Policy, class Sched>
void trainer_equals_serial(const std::string& what, const TrainerConfig& hp, const GptInit& init, int steps, int B,
                           int T, int vocab) {
  using M = typename Model::mesh;
  constexpr int micro = Sched::table.micro_batches;
  const Run ref = serial_run<Serial>(hp, init, steps, micro, B, T, vocab);
  std::vector<Run> got(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Run& mine = got[static_cast<std::size_t>(ctx.rank())];
    Trainer<Model, Policy, Sched> t(ctx, hp, init);
    std::vector<int> tok, tgt;
    for (int s = 1; s <= steps; ++s) {
      test::global_batch(s, micro, B, T, vocab, tok, tgt);
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
    for (std::size_t s = 0; s < static_cast<std::size_t>(steps); ++s)
      loss = std::max(loss, std::abs(r.losses[s] - ref.losses[s]) / ref.losses[s]);
    grads = std::max(grads, worst_tensor<typename Serial::serial_layout>(r.grads, ref.grads, grad_at));
    weights = std::max(weights, worst_tensor<typename Serial::serial_layout>(r.weights, ref.weights, weight_at));
  }
  MESSAGE(what << ": losses within " << loss << ", first gradient within " << grads << " (" << grad_at
               << "), weights after " << steps << " steps within " << weights << " (" << weight_at << ") of serial");
  CHECK(loss <= 1e-5);
  CHECK(grads <= 1e-5);
  CHECK(weights <= 1e-5);
  CHECK(ref.losses.back() < ref.losses.front());  // it trains
}

// One Trainer step's collectives on every rank, per group, and each rank's pipeline rank (the
// plan's traffic_by_rank index).
struct StepTraffic {
  std::vector<plan::Traffic> by_rank;
  std::vector<int> pp_rank;
};
template <class Model, class Policy, class Sched>
StepTraffic step_traffic(const TrainerConfig& hp, const GptInit& init, const std::vector<int>& tok,
                         const std::vector<int>& tgt, int B, int T) {
  using M = typename Model::mesh;
  StepTraffic out{std::vector<plan::Traffic>(M::size), std::vector<int>(M::size)};
  std::mutex mu;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(Counting<host::Comm>(world));
    Trainer<Model, Policy, Sched> t(ctx, hp, init);
    auto counts = [&] {
      return plan::Traffic{ctx.template comm<Axis::tp>().counts(), ctx.template comm<Axis::cp>().counts(),
                           ctx.template comm<typename M::expert_group>().counts(), ctx.template comm<Axis::pp>().counts(),
                           ctx.template comm<typename M::grad_group>().counts(),
                           ctx.template comm<typename M::expert_data_group>().counts()};
    };
    const plan::Traffic before = counts();
    t.step(1, tok, tgt, B, T);
    const plan::Traffic after = counts();
    std::lock_guard lock(mu);
    const auto r = static_cast<std::size_t>(ctx.rank());
    out.by_rank[r] = {after.tp - before.tp, after.cp - before.cp, after.ep - before.ep, after.pp - before.pp,
                      after.grad - before.grad, after.expert_data - before.expert_data};
    out.pp_rank[r] = ctx.coord()[Axis::pp];
  });
  return out;
}

// Every rank's TP, CP, PP and gradient-group collectives are the plan's for its pipeline rank.
template <class Plan>
void check_traffic(const StepTraffic& got) {
  for (std::size_t r = 0; r < got.by_rank.size(); ++r) {
    CAPTURE(r);
    const plan::Traffic& want = Plan::traffic_by_rank[static_cast<std::size_t>(got.pp_rank[r])];
    const plan::Traffic& x = got.by_rank[r];
    CHECK(x.tp == want.tp);
    CHECK(x.cp == want.cp);
    CHECK(x.pp == want.pp);
    CHECK(x.grad == want.grad);
    CHECK(x.ep == want.ep);  // dense: none; experts padded to capacity: exact
    CHECK(x.expert_data == want.expert_data);
  }
}

// The bytes Model's buffers hold on each rank after one forward and backward of [B, T] on
// its mesh (the process's count of live host buffers, divided by the ranks): what a plan's
// parameters, gradients, activations, recomputation and work buffers must add up to. Split:
// the backward as its input and weight halves (nn/weight_grads.hpp), which leave a tape of
// snapshots (the plan's deferred bytes) on top.
template <class Model>
std::size_t bytes_held_after_step(const GptInit& init, const std::vector<int>& tok, const std::vector<int>& tgt, int B,
                                  int T, bool split = false) {
  using M = typename Model::mesh;
  const std::size_t before = buffer_bytes_held<Host>();
  std::size_t held = 0;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Model model(ctx, init);
    model.forward(tok.data(), tgt.data(), B, T);
    if (split) model.backward_input(), model.backward_weight();
    else model.backward();
    ctx.world().barrier();
    if (ctx.rank() == 0) held = buffer_bytes_held<Host>() - before;
    ctx.world().barrier();
  });
  REQUIRE(held % M::size == 0);
  return held / M::size;
}

}  // namespace fived::test
