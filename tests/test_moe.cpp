// Mixture of experts and expert parallelism on the host backend (ranks as threads).
//
// The serial model (all experts on one rank) is checked against finite differences, router
// and experts, with the load-balancing loss. Every mesh run trains the same global batches
// for 3 clipped AdamW steps and is compared with the serial model fed the same rows as
// micro-batches, one per data rank (the load-balancing loss is a statistic of a replica's
// micro-batch, so that is the serial model the mesh computes): every step's loss, the last
// step's dense and expert gradients, and the weights after the last step.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/io/safetensors.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/pipeline/executor.hpp"
#include "fived/pipeline/schedules.hpp"
#include "fived/pipeline/stage_layers.hpp"
#include "fived/train/data_parallel.hpp"
#include "support/batches.hpp"
#include "support/allocations.hpp"
#include "support/compare.hpp"

using namespace fived;

namespace {

template <int E, int K, bool Renormalize = true>
struct moe_cfg : gpt_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, vocab = 53, max_seq = 32, vocab_multiple = 16;
  static constexpr int experts = E, top_k = K, mlp_ratio = 2;
  static constexpr bool renormalize_gates = Renormalize;
  static constexpr double aux_loss_coef = 0.05;
};
using top1_4 = moe_cfg<4, 1, false>;  // Switch: the gate is the score
using top2_4 = moe_cfg<4, 2>;
using top1_8 = moe_cfg<8, 1, false>;
using top2_8 = moe_cfg<8, 2>;

// MoE in the second block only, untied (pipeline stages), selection bias.
struct half_cfg : moe_cfg<4, 2> {
  static constexpr int moe_every = 2;
  static constexpr bool tied = false;
  using balancing = AuxLossFreeBias;
};

struct capped_4 : top2_4 {
  static constexpr double capacity_factor = 1.0;  // each expert takes at most N·k/E of a rank's rows
};
struct padded_4 : capped_4 {
  static constexpr bool pad_to_capacity = true;  // every expert's rows padded to its capacity
};
struct padded_8 : top2_8 {
  static constexpr double capacity_factor = 1.25;
  static constexpr bool pad_to_capacity = true;
};
struct capped_8 : padded_8 {
  static constexpr bool pad_to_capacity = false;
};
struct biased_8 : top1_8 {
  using balancing = AuxLossFreeBias;
};
struct skewed_4 : top1_4 {
  using balancing = AuxLossFreeBias;
  static constexpr double aux_loss_coef = 0, bias_update_rate = 0.02;
};

constexpr int B = 4, T = 8, steps = 3;
const GptInit init{5, 0.05};
const AdamWConfig hp{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f};

struct Result {
  std::vector<double> losses;
  std::vector<float> weights, grads, expert_weights, expert_grads;  // serial layouts
};

// The serial model, fed the global batch's rows as `data_ranks` micro-batches per global one.
template <class Cfg>
Result serial_run(int data_ranks, int micro = 1) {
  GPT<Cfg> m(init);
  DataParallel<GPT<Cfg>> dp(m, hp, micro * data_ranks);
  Result r;
  std::vector<int> tok, tgt;
  for (int s = 0; s < steps; ++s) {
    test::global_batch(s, micro, B, T, Cfg::vocab, tok, tgt);
    r.losses.push_back(dp.step(tok, tgt, B / data_ranks, T));
  }
  r.weights.assign(m.params().begin(), m.params().end());
  r.grads.assign(m.grads().begin(), m.grads().end());
  r.expert_weights.assign(m.expert_params().begin(), m.expert_params().end());
  r.expert_grads.assign(m.expert_grads().begin(), m.expert_grads().end());
  return r;
}

// Every rank of M holds the model's dense part (split over TP) and its experts (split over
// EP and TP); the experts of every (EP, TP) rank with expert-data rank 0 are assembled.
template <class Cfg, class M, class Policy = NoZeRO, class SP = NoSequenceParallel>
Result mesh_run(const std::vector<float>& bias = {}) {
  using Model = GPT<Cfg, M, float, Host, SP>;
  using EL = typename Model::expert_layout;
  Result out;
  std::vector<std::vector<float>> ew(M::tp * M::ep), eg(M::tp * M::ep);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Model m(ctx, init);
    if constexpr (Cfg::balancing::bias)
      if (!bias.empty()) m.set_router_bias(0, bias);
    DataParallel<Model, Policy> dp(m, ctx, hp);
    const bool keep = ctx.rank() == 0;
    std::vector<int> tok, tgt;
    for (int s = 0; s < steps; ++s) {
      test::global_batch(s, 1, B, T, Cfg::vocab, tok, tgt);
      const double loss = dp.step(tok, tgt, B, T);
      if (keep) out.losses.push_back(loss);
    }
    const std::vector<float> w = m.gather_params(), g = m.gather_grads();
    if (keep) out.weights = w, out.grads = g;
    if (M::expert_data_group::index(ctx.rank()) == 0) {
      const std::size_t piece = static_cast<std::size_t>(m.ep_rank() * M::tp + m.tp_rank());
      ew[piece] = Policy::stage == 3 && M::expert_data_group::size > 1 ? std::vector<float>() : m.expert_params_to_host();
      eg[piece] = m.expert_grads_to_host();
    }
  });
  std::vector<float> all_w, all_g;
  for (std::size_t i = 0; i < ew.size(); ++i) {
    all_w.insert(all_w.end(), ew[i].begin(), ew[i].end());
    all_g.insert(all_g.end(), eg[i].begin(), eg[i].end());
  }
  out.expert_weights.assign(EL::serial::size, 0.0f);
  out.expert_grads.assign(EL::serial::size, 0.0f);
  if (all_w.size() == EL::size * ew.size()) EL::assemble(std::span<const float>(all_w), std::span<float>(out.expert_weights));
  if (all_g.size() == EL::size * eg.size()) EL::assemble(std::span<const float>(all_g), std::span<float>(out.expert_grads));
  return out;
}

void check_equal(const Result& got, const Result& ref, bool grads) {
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    const auto i = static_cast<std::size_t>(s);
    CHECK(std::abs(got.losses[i] - ref.losses[i]) <= 1e-5 * ref.losses[i]);
  }
  if (grads) {
    CHECK(test::max_rel_error(got.grads, ref.grads) <= 1e-5);
    CHECK(test::max_rel_error(got.expert_grads, ref.expert_grads) <= 1e-5);
  }
  CHECK(test::max_rel_error(got.weights, ref.weights) <= 1e-5);
  CHECK(test::max_rel_error(got.expert_weights, ref.expert_weights) <= 1e-5);
}

}  // namespace

template <class cfg>
void gradient_check() {
  using Model = GPT<cfg, Mesh<>, double>;
  Model m(GptInit{3, 0.2});
  constexpr int b = 2, t = 6;
  std::vector<int> tok(b * t), tgt(b * t);
  for (int i = 0; i < b * t; ++i) tok[i] = (i * 11 + 2) % cfg::vocab, tgt[i] = (i * 5 + 1) % cfg::vocab;
  auto total = [&] { m.forward(tok.data(), tgt.data(), b, t); return m.loss() + m.aux_loss(); };
  (void)total();
  const double aux = m.aux_loss();
  CHECK(aux > 0);
  m.zero_grad();
  m.backward();
  const std::vector<double> dense = m.grads_to_host(), experts = m.expert_grads_to_host();
  // the loss of a perturbed model (routing must not change: the choice is a step function)
  auto numeric = [&](std::span<double> p, std::size_t i) {
    const double eps = 1e-6, x = p[i];
    p[i] = x + eps;
    const double up = total();
    p[i] = x - eps;
    const double down = total();
    p[i] = x;
    return (up - down) / (2 * eps);
  };
  double worst = 0;
  int checked = 0;
  for (const ParamInfo& info : Model::layout::tensors) {
    if (info.name().find("router") == std::string::npos && info.name().find("ln_2") == std::string::npos) continue;
    for (std::size_t j = 0; j < info.size(); j += 3, ++checked)
      worst = std::max(worst, std::abs(numeric(m.params(), info.offset + j) - dense[info.offset + j]));
  }
  for (const ParamInfo& info : Model::expert_layout::tensors)
    for (std::size_t j = 0; j < info.size(); j += 7, ++checked)
      worst = std::max(worst, std::abs(numeric(m.expert_params(), info.offset + j) - experts[info.offset + j]));
  CAPTURE(checked);
  CHECK(checked > 500);
  CHECK(worst < 1e-7);
}

struct sigmoid_3 : moe_cfg<8, 3> {
  static constexpr bool router_sigmoid = true;
};

TEST_CASE("serial MoE: router, LayerNorm and expert gradients (with the balancing loss) against finite differences") {
  gradient_check<moe_cfg<4, 2>>();      // softmax, gates renormalised over the top 2
  gradient_check<moe_cfg<4, 1, false>>();  // Switch: the gate is the score
  gradient_check<sigmoid_3>();           // sigmoid scores, top 3 of 8, renormalised
}

TEST_CASE("EP 2 and 4, 4 and 8 experts, top-1 and top-2: 3 steps equal the serial model") {
  check_equal(mesh_run<top1_4, Mesh<DP<2>, EP<2>>>(), serial_run<top1_4>(2), true);
  check_equal(mesh_run<top2_4, Mesh<DP<2>, EP<2>>>(), serial_run<top2_4>(2), true);
  check_equal(mesh_run<top1_8, Mesh<DP<4>, EP<4>>>(), serial_run<top1_8>(4), true);
  check_equal(mesh_run<top2_8, Mesh<DP<4>, EP<4>>>(), serial_run<top2_8>(4), true);
  check_equal(mesh_run<top2_8, Mesh<DP<4>, EP<2>>>(), serial_run<top2_8>(4), true);  // expert data 2
}

TEST_CASE("a capacity factor drops what is over each expert's capacity, alike on the mesh and serially") {
  GPT<capped_4> m(init);
  std::vector<int> tok, tgt;
  test::global_batch(0, 1, B, T, capped_4::vocab, tok, tgt);
  DataParallel<GPT<capped_4>> dp(m, hp);
  dp.step(tok, tgt, B, T);
  double kept = 0;
  for (double x : m.expert_loads()) kept += x;
  CHECK(kept < 2.0 * B * T * capped_4::top_k);  // two MoE blocks: some assignments were dropped
  check_equal(mesh_run<capped_4, Mesh<DP<2>, EP<2>>>(), serial_run<capped_4>(2), true);
}

// Padding changes no value: an empty slot is a zero row, whose output no token reads and
// whose gradient is zero, so a padded model takes the capacity path's steps to the bit.
void check_same_bits(const Result& got, const Result& ref) {
  CHECK(got.losses == ref.losses);
  CHECK(got.weights == ref.weights);
  CHECK(got.grads == ref.grads);
  CHECK(got.expert_weights == ref.expert_weights);
  CHECK(got.expert_grads == ref.expert_grads);
}

TEST_CASE("pad_to_capacity: the capacity path's steps bit for bit, serially and on EP meshes equal to serial") {
  check_same_bits(serial_run<padded_4>(2), serial_run<capped_4>(2));
  check_same_bits(serial_run<padded_8>(4), serial_run<capped_8>(4));
  check_equal(mesh_run<padded_4, Mesh<DP<2>, EP<2>>>(), serial_run<padded_4>(2), true);
  check_equal(mesh_run<padded_8, Mesh<DP<4>, EP<2>>>(), serial_run<padded_8>(4), true);  // expert data 2
  check_equal(mesh_run<padded_8, Mesh<DP<2>, TP<2>, EP<2>>, NoZeRO, SequenceParallel>(), serial_run<padded_8>(2), true);
}

// One forward and backward on DP 2 x EP 2, run plain, then again as the host's capture of a
// step graph (nn/step_graph.hpp: a call that waits for the device is refused there). Returns
// whether the capture went through, and the EP group's collectives of the plain pass.
template <class Cfg>
std::pair<bool, CommCounts> forward_backward_captured() {
  using M = Mesh<DP<2>, EP<2>>;
  using Model = GPT<Cfg, M, float, Host>;
  bool captured = true;
  CommCounts ep{};
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(Counting<host::Comm>(world));
    Model m(ctx, init);
    std::vector<int> tok, tgt;
    test::global_batch(0, 1, B, T, Cfg::vocab, tok, tgt);
    const std::size_t rows = static_cast<std::size_t>(ctx.coord().dp) * (B / 2) * T;
    m.ops().use_step_graph = true;
    for (int pass = 0; pass < 2; ++pass) {  // the first step of a shape runs plain, the second is captured
      const CommCounts before = ctx.template comm<typename M::expert_group>().counts();
      m.ops().begin_graph_step(1);
      try {
        m.enqueue_forward(tok.data() + rows, tgt.data() + rows, B / 2, T);  // (forward() reads the loss)
        m.backward();
        m.ops().launch_graph_step();
      } catch (const std::logic_error& e) {
        CAPTURE(std::string(e.what()));
        CHECK(std::string(e.what()).find("dispatch_plan inside a step captured as a graph") != std::string::npos);
        m.ops().abandon_graph_step();
        if (ctx.rank() == 0) captured = false;
        break;  // (every rank refuses at the same call, before any collective of the captured pass)
      }
      if (pass == 0 && ctx.rank() == 0) ep = ctx.template comm<typename M::expert_group>().counts() - before;
    }
  });
  return {captured, ep};
}

// Buffers allocated (process-wide) during the first of 6 steps on Mesh<DP<2>, EP<2>>, and
// during the 5 after it (the batches differ, so do the rows each EP rank's experts take).
// Padded experts receive the same rows every step; the capped ones' buffers grew before
// they were made for the bound (9 allocations in the 5 later steps).
template <class Cfg>
test::Allocations allocations_by_step() {
  using M = Mesh<DP<2>, EP<2>>;
  using Model = GPT<Cfg, M, float, Host, NoSequenceParallel>;
  test::Allocations counted;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Model m(ctx, init);
    DataParallel<Model, ZeRO<1>> dp(m, ctx, hp);
    std::vector<int> tok, tgt;
    const test::Allocations a = test::allocations_by_step(world, 6, [&](int s) {
      test::global_batch(s, 1, B, T, Cfg::vocab, tok, tgt);
      dp.step(tok, tgt, B, T);
    });
    if (world.rank() == 0) counted = a;
  });
  return counted;
}

TEST_CASE("experts with a capacity, padded or not, allocate no buffer after the first step: the rows at an EP rank's "
          "experts change from step to step, their buffers are made for the most that can arrive") {
  const test::Allocations capped = allocations_by_step<capped_8>(), padded = allocations_by_step<padded_8>();
  CHECK(capped.first > 0);
  CHECK(capped.later == 0);
  CHECK(padded.first > 0);
  CHECK(padded.later == 0);
}

TEST_CASE("pad_to_capacity: a forward and backward wait for nothing and exchange no counts; dropless waits") {
  const auto [padded, padded_ep] = forward_backward_captured<padded_4>();
  CHECK(padded);
  CHECK(padded_ep.all_to_all.calls == 0);  // no counts: every size is static
  CHECK(padded_ep.all_to_all_v.calls == 2 * 4);  // 2 MoE blocks: rows out and back, forward and backward
  // each exchange: E·capacity rows of C floats, capacity = ceil(1.0 · 16 rows · 2 / 4 experts) = 8
  CHECK(padded_ep.all_to_all_v.bytes == 2 * 4 * (4 * 8) * padded_4::d_model * 4);
  const auto [dropless, dropless_ep] = forward_backward_captured<capped_4>();
  CHECK_FALSE(dropless);  // its routing reads the counts
  CHECK(dropless_ep.all_to_all.calls == 2);
}

TEST_CASE("experts and ranks that get no tokens: every collective still joined, results equal serial") {
  // The selection bias keeps every token away from experts 2..7: EP ranks 1..3 receive no
  // rows and EP rank 0 sends its peers none, in forward and backward.
  using cfg = biased_8;
  const std::vector<float> bias{0, 0, -10, -10, -10, -10, -10, -10};
  GPT<cfg> serial(init);
  serial.set_router_bias(0, bias);
  DataParallel<GPT<cfg>> dp(serial, hp, 4);
  Result ref;
  std::vector<int> tok, tgt;
  for (int s = 0; s < steps; ++s) {
    test::global_batch(s, 1, B, T, cfg::vocab, tok, tgt);
    ref.losses.push_back(dp.step(tok, tgt, B / 4, T));
  }
  const std::vector<double> loads = serial.expert_loads();
  REQUIRE(loads.size() == 16);  // 2 MoE blocks x 8 experts; the bias is on block 0
  CHECK(std::accumulate(loads.begin() + 2, loads.begin() + 8, 0.0) == 0);
  ref.weights.assign(serial.params().begin(), serial.params().end());
  ref.grads.assign(serial.grads().begin(), serial.grads().end());
  ref.expert_weights.assign(serial.expert_params().begin(), serial.expert_params().end());
  ref.expert_grads.assign(serial.expert_grads().begin(), serial.expert_grads().end());
  check_equal(mesh_run<cfg, Mesh<DP<4>, EP<4>>>(bias), ref, true);
}

TEST_CASE("Mesh<DP<2>, TP<2>> with EP<2> carved from DP (different groups), SP, no ZeRO and ZeRO-1") {
  using M = Mesh<DP<2>, TP<2>, EP<2>>;
  static_assert(M::expert_group::members(0)[1] == 2, "EP pairs ranks across DP, TP rank fixed");
  const Result ref = serial_run<top2_4>(2);
  check_equal(mesh_run<top2_4, M, NoZeRO, SequenceParallel>(), ref, true);
  check_equal(mesh_run<top2_4, M, ZeRO<1>, SequenceParallel>(), ref, false);
  check_equal(mesh_run<top2_4, M, NoZeRO, NoSequenceParallel>(), ref, true);
}

TEST_CASE("ZeRO-1/2 over DP 4 with EP 2: the expert buffer sharded over its expert-data group of 2") {
  const Result ref = serial_run<top2_8>(4);
  check_equal(mesh_run<top2_8, Mesh<DP<4>, EP<2>>, ZeRO<1>>(), ref, false);
  check_equal(mesh_run<top2_8, Mesh<DP<4>, EP<2>>, ZeRO<2>>(), ref, false);
}

TEST_CASE("the auxiliary-loss-free bias moves a skewed router's loads towards balance") {
  using cfg = skewed_4;
  GPT<cfg> m(init);
  m.set_router_bias(0, std::vector<float>{0.6f, 0, 0, 0});  // expert 0 takes nearly everything
  m.set_router_bias(1, std::vector<float>{0.6f, 0, 0, 0});
  AdamWConfig still = hp;
  still.lr = 0;  // only the bias moves
  DataParallel<GPT<cfg>> dp(m, still, 1);
  auto imbalance = [&] {  // the most loaded expert over the mean, over both MoE blocks
    const std::vector<double> l = m.expert_loads();
    double worst = 0;
    for (int blk = 0; blk < 2; ++blk) {
      const double sum = std::accumulate(l.begin() + blk * 4, l.begin() + blk * 4 + 4, 0.0);
      worst = std::max(worst, *std::max_element(l.begin() + blk * 4, l.begin() + blk * 4 + 4) / (sum / 4));
    }
    return worst;
  };
  // Each step's move, exactly: rate * sign(mean load - load) for each expert of each block.
  auto moved_by_rule = [&](const std::vector<float> (&before)[2]) {
    const std::vector<double> l = m.expert_loads();
    for (int blk = 0; blk < 2; ++blk) {
      const std::vector<float> after = m.router_bias(blk);
      const double mean = std::accumulate(l.begin() + blk * 4, l.begin() + blk * 4 + 4, 0.0) / 4;
      for (int e = 0; e < 4; ++e) {
        const double d = mean - l[static_cast<std::size_t>(blk * 4 + e)];
        const float step = static_cast<float>(cfg::bias_update_rate) * static_cast<float>((d > 0) - (d < 0));
        if (after[static_cast<std::size_t>(e)] != before[blk][static_cast<std::size_t>(e)] + step) return false;
      }
    }
    return true;
  };
  std::vector<int> tok, tgt;
  std::vector<double> seen;
  for (int s = 0; s < 40; ++s) {
    test::global_batch(s, 1, B, T, cfg::vocab, tok, tgt);
    const std::vector<float> before[2] = {m.router_bias(0), m.router_bias(1)};
    dp.step(tok, tgt, B, T);
    CAPTURE(s);
    REQUIRE(moved_by_rule(before));
    seen.push_back(imbalance());
  }
  CAPTURE(seen.front());
  CAPTURE(seen.back());
  CHECK(seen.front() > 3.0);  // skewed: expert 0 has over 3x the mean load
  CHECK(seen.back() < 2.0);
  CHECK(m.router_bias(0)[0] < 0.6f - 0.1f);  // moved down, the others up
  CHECK(m.router_bias(0)[1] > 0.0f);
}

namespace {
template <int stage>
using PPStage = GPT<half_cfg, Mesh<DP<2>, PP<2>, EP<2>>, float, Host, NoSequenceParallel,
                    StageLayers<GPT<half_cfg>, 2, UniformCost>::part<stage>>;

template <int stage, class Ctx>
void pp_rank(Ctx& ctx, Result& out) {
  using Sched = pipeline::OneFOneB<2, 2>;
  constexpr int micro = Sched::table.micro_batches;
  using Model = PPStage<stage>;
  Model m(ctx, init);
  DataParallel<Model> dp(m, ctx, hp, micro);
  auto exec = pipeline::make_executor(Sched::table, stage, ctx.template comm<Axis::pp>(), std::tie(m), std::tie(dp));
  std::vector<int> tok, tgt;
  const bool keep = ctx.coord()[Axis::dp] == 0;
  for (int s = 0; s < steps; ++s) {
    test::global_batch(s, micro, B, T, half_cfg::vocab, tok, tgt);
    const double loss = exec.step(tok, tgt, B, T);
    if (keep) out.losses.push_back(loss);
  }
  using Serial = GPT<half_cfg>;
  const std::vector<float> w = m.params_to_host(), g = m.grads_to_host();
  if (keep)
    for (const ParamInfo& t : Model::layout::tensors) {
      const ParamInfo& to = Serial::layout::tensors[static_cast<std::size_t>(*Serial::layout::find(t.name()))];
      std::copy_n(w.begin() + static_cast<std::ptrdiff_t>(t.offset), t.size(), out.weights.begin() + static_cast<std::ptrdiff_t>(to.offset));
      std::copy_n(g.begin() + static_cast<std::ptrdiff_t>(t.offset), t.size(), out.grads.begin() + static_cast<std::ptrdiff_t>(to.offset));
    }
  if constexpr (Model::has_experts) {  // stage 1 holds the MoE block: each EP rank its half of the experts
    using EL = typename Model::expert_layout;
    const std::vector<float> ew = m.expert_params_to_host(), eg = m.expert_grads_to_host();
    std::vector<float> fw(EL::serial::size), fg(EL::serial::size), mine(EL::serial::size);
    std::vector<float> pieces_w(EL::size * 2, 0.0f), pieces_g(EL::size * 2, 0.0f);
    std::copy(ew.begin(), ew.end(), pieces_w.begin() + static_cast<std::ptrdiff_t>(EL::size * m.ep_rank()));
    std::copy(eg.begin(), eg.end(), pieces_g.begin() + static_cast<std::ptrdiff_t>(EL::size * m.ep_rank()));
    EL::assemble(std::span<const float>(pieces_w), std::span<float>(fw));
    EL::assemble(std::span<const float>(pieces_g), std::span<float>(fg));
    // each rank fills its own experts' elements (the other half is zero): summed by the caller
    for (std::size_t i = 0; i < fw.size(); ++i) out.expert_weights[i] += fw[i], out.expert_grads[i] += fg[i];
  }
}
}  // namespace

TEST_CASE("Mesh<DP<2>, PP<2>> with EP<2>: 1F1B, MoE on the second stage, selection bias; equals serial") {
  const Result ref = serial_run<half_cfg>(2, 2);
  using M = Mesh<DP<2>, PP<2>, EP<2>>;
  std::vector<Result> ranks(M::size);
  for (Result& r : ranks) {
    r.weights.assign(ref.weights.size(), 0.0f), r.grads.assign(ref.grads.size(), 0.0f);
    r.expert_weights.assign(ref.expert_weights.size(), 0.0f), r.expert_grads.assign(ref.expert_grads.size(), 0.0f);
  }
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    if (ctx.coord()[Axis::pp] == 0) pp_rank<0>(ctx, ranks[static_cast<std::size_t>(ctx.rank())]);
    else pp_rank<1>(ctx, ranks[static_cast<std::size_t>(ctx.rank())]);
  });
  Result got = ranks[0];  // dp 0, pp 0
  const Result& last = ranks[2];  // dp 0, pp 1
  const Result& last_other = ranks[3];  // dp 1, pp 1: the other EP rank's experts
  for (std::size_t i = 0; i < got.weights.size(); ++i) got.weights[i] += last.weights[i], got.grads[i] += last.grads[i];
  for (std::size_t i = 0; i < got.expert_weights.size(); ++i) {
    got.expert_weights[i] = last.expert_weights[i] + last_other.expert_weights[i];
    got.expert_grads[i] = last.expert_grads[i] + last_other.expert_grads[i];
  }
  CHECK(ranks[2].losses == ranks[0].losses);
  check_equal(got, ref, true);
}

TEST_CASE("a GPT with experts saves one file (its experts stacked, under fived's names: GPT-2 has no Hugging Face "
          "mixture) and loads it back bit for bit; split over EP, save says how to save it instead") {
  using cfg = top2_4;
  GPT<cfg> a(init), b(GptInit{init.seed + 1, init.std});
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "fived_moe_gpt.safetensors";
  a.save(path);
  const io::SafetensorsFile f = io::SafetensorsFile::read(path);
  REQUIRE(f.find("h.0.mlp.experts.c_fc.weight") != nullptr);
  CHECK(f.find("h.0.mlp.experts.c_fc.weight")->shape == std::vector<std::int64_t>{cfg::experts * cfg::d_model, 2 * cfg::d_model});
  CHECK(f.find("h.1.mlp.router.weight")->shape == std::vector<std::int64_t>{cfg::d_model, cfg::experts});
  CHECK(!std::equal(a.expert_params().begin(), a.expert_params().end(), b.expert_params().begin()));
  b.load(path);
  CHECK(std::equal(a.params().begin(), a.params().end(), b.params().begin(), b.params().end()));
  CHECK(std::equal(a.expert_params().begin(), a.expert_params().end(), b.expert_params().begin(), b.expert_params().end()));
  std::filesystem::remove(path);

  using M = Mesh<DP<2>, EP<2>>;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    GPT<cfg, M> m(ctx, init);
    CHECK_THROWS_WITH_AS(m.save(path), doctest::Contains("Trainer::save_weights"), std::logic_error);
  });
  CHECK(!std::filesystem::exists(path));
}
