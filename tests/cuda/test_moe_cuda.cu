// Mixture of experts with expert parallelism on CUDA with NCCL, each rank a process
// (scripts/launch-local.sh 2): GPT<cfg, Mesh<DP<2>, EP<2>>, float, Cuda> (4 experts, top-2,
// Switch balancing loss), trained by DataParallel (which drives the expert buffers over the
// expert-data group itself), against the serial CUDA model that every rank also trains on the
// same global batches, fp32, NoZeRO. Data rank r reads rows [r*B/2, (r+1)*B/2) of each global
// batch, and the load-balancing loss is a statistic of a replica's micro-batch, so the serial
// model is fed the same rows as 2 micro-batches of B/2 (accumulation 2): the model the mesh
// computes (as tests/test_moe.cpp on the host).
//
// Checked on every rank: every step's loss within 1e-4 relative, the balancing loss of the
// serial model's last micro-batch (data rank 1's rows) against data rank 1's; after 3 steps
// the last step's gradients and the weights, per tensor within 1e-3 (max |diff| / max |serial|:
// the dense gradients are all-reduced instead of accumulated, and each expert's GEMMs take the
// rows of both data ranks at once). Dense tensors are replicated over DP (TP 1), so they are
// compared whole; each EP rank holds 2 of the 4 experts, compared with the matching slice of the
// serial model's expert buffer (expert_layout::slice). AdamW's eps is 1e-2, as in
// test_mesh_cuda.cu: its step is then a smooth function of the gradient, so summation-order
// noise in a near-zero gradient cannot turn into a full lr-sized step.
// A second case keeps every token away from EP rank 1's experts (the selection bias): the
// empty exchanges still meet, and the same comparisons hold. Exits 77 without a GPU.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <span>
#include <vector>

#include <fived/comm/nccl.hpp>
#include <fived/nn/cuda/ops.hpp>  // before gpt.hpp: Ops<T, Cuda>
#include <fived/mesh/context.hpp>
#include <fived/nn/gpt.hpp>
#include <fived/train/data_parallel.hpp>

#include "nccl_test_main.hpp"
#include "../support/batches.hpp"
#include "../support/compare.hpp"

using namespace fived;

namespace {

struct cfg : gpt_config {
  static constexpr int layers = 2, d_model = 64, heads = 4, vocab = 101, max_seq = 32, vocab_multiple = 16;
  static constexpr int experts = 4, top_k = 2, mlp_ratio = 2;
  static constexpr double aux_loss_coef = 0.05;
};
using Serial = GPT<cfg, Mesh<>, float, Cuda>;
using EPMesh = Mesh<DP<2>, EP<2>>;
using Model = GPT<cfg, EPMesh, float, Cuda>;
using EL = Model::expert_layout;
static_assert(Model::has_experts && Serial::has_experts);
static_assert(EL::size * 2 == Serial::expert_layout::size, "each EP rank holds half of the experts");
static_assert(Model::layout::size == Serial::layout::size, "TP 1: the dense buffer is the serial one");

constexpr int B = 4, T = 16, steps = 3, data_ranks = 2;
const GptInit init{7, 0.05};
const AdamWConfig hp{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-2f, .weight_decay = 0.1f, .max_norm = 0.5f};
constexpr double loss_bound = 1e-4, grad_bound = 1e-3, weight_bound = 1e-3;

// Per tensor of `tensors` (a layout's): max |got - ref| / max |ref| within bound.
template <class Tensors>
void check_tensors(const Tensors& tensors, const std::vector<float>& got, const std::vector<float>& ref, double bound) {
  REQUIRE(got.size() == ref.size());
  for (const ParamInfo& t : tensors) {
    CAPTURE(t.name());
    CHECK(test::max_rel_error(got, ref, t.offset, t.size()) <= bound);
  }
}

// Every dense tensor whole (TP 1), and the experts this EP rank holds against the matching
// slice of the serial model's expert buffer: gradients, then weights.
template <class Par, class Ser>
void check_against_serial(Par& model, Ser& serial) {
  using L = typename Par::expert_layout;
  auto mine = [&](const std::vector<float>& all) {
    std::vector<float> v(L::size);
    L::slice(std::span<const float>(all), std::span<float>(v), 0, model.ep_rank());
    return v;
  };
  check_tensors(Ser::layout::tensors, model.grads_to_host(), serial.grads_to_host(), grad_bound);
  check_tensors(Ser::layout::tensors, model.params_to_host(), serial.params_to_host(), weight_bound);
  check_tensors(L::tensors, model.expert_grads_to_host(), mine(serial.expert_grads_to_host()), grad_bound);
  check_tensors(L::tensors, model.expert_params_to_host(), mine(serial.expert_params_to_host()), weight_bound);
}

// Step s of the global batch on the mesh (dp) and, as data_ranks micro-batches, on the serial
// model (sdp): the same loss.
template <class Par, class Ser>
void step_both(Par& dp, Ser& sdp, int s, int vocab) {
  CAPTURE(s);
  std::vector<int> tok, tgt;
  test::global_batch(s, 1, B, T, vocab, tok, tgt);
  const double lm = dp.step(tok, tgt, B, T), ls = sdp.step(tok, tgt, B / data_ranks, T);
  CHECK(std::abs(lm - ls) <= loss_bound * std::abs(ls));
}

}  // namespace

TEST_CASE("EP 2 (DP 2) on CUDA: 4 experts top-2 with the balancing loss equal the serial CUDA model") {
  auto ctx = make_mesh_context<EPMesh>(test::world().split(0, test::world().rank(), "world"));
  CAPTURE(ctx.rank());
  Model model(ctx, init);
  DataParallel<Model> dp(model, ctx, hp);
  Serial serial(init);
  DataParallel<Serial> sdp(serial, hp, data_ranks);  // one micro-batch per data rank
  CAPTURE(model.ep_rank());
  CAPTURE(dp.data_rank());

  for (int s = 0; s < steps; ++s) {
    step_both(dp, sdp, s, cfg::vocab);
    // The balancing loss is this rank's micro-batch's; the serial model's last is data rank 1's.
    CHECK(model.aux_loss() > 0);
    if (dp.data_rank() == data_ranks - 1) CHECK(std::abs(model.aux_loss() - serial.aux_loss()) <= loss_bound * serial.aux_loss());
  }

  check_against_serial(model, serial);
}

namespace {

// DeepSeek-V3's selection bias, set so that no token picks experts 2 and 3: EP rank 1, which
// holds them, receives no rows in either MoE block, and EP rank 0 sends it none, in forward
// and backward.
struct biased_cfg : gpt_config {
  static constexpr int layers = 2, d_model = 64, heads = 4, vocab = 101, max_seq = 32, vocab_multiple = 16;
  static constexpr int experts = 4, top_k = 1, mlp_ratio = 2;
  using balancing = AuxLossFreeBias;
};
const std::vector<float> keep_away{0, 0, -10, -10};

}  // namespace

TEST_CASE("EP 2 on CUDA: experts and a rank that get no tokens still join every collective, equal to serial") {
  using BSerial = GPT<biased_cfg, Mesh<>, float, Cuda>;
  using BModel = GPT<biased_cfg, EPMesh, float, Cuda>;
  auto ctx = make_mesh_context<EPMesh>(test::world().split(0, test::world().rank(), "world"));
  CAPTURE(ctx.rank());
  BModel model(ctx, init);
  BSerial serial(init);
  for (int m = 0; m < 2; ++m) model.set_router_bias(m, keep_away), serial.set_router_bias(m, keep_away);
  DataParallel<BModel> dp(model, ctx, hp);
  DataParallel<BSerial> sdp(serial, hp, data_ranks);
  for (int s = 0; s < steps; ++s) step_both(dp, sdp, s, biased_cfg::vocab);
  const std::vector<double> loads = serial.expert_loads();  // 2 blocks x 4 experts
  REQUIRE(loads.size() == 8);
  CHECK(loads[2] + loads[3] + loads[6] + loads[7] == 0);
  CHECK(loads[0] + loads[1] > 0);
  if (model.ep_rank() == 1)  // its experts took nothing: no gradient
    for (float g : model.expert_grads_to_host()) REQUIRE(g == 0.0f);

  check_against_serial(model, serial);
}

namespace {
struct padded_cfg : cfg {  // static routing: a step waits for no count, so it is captured as a CUDA graph
  static constexpr double capacity_factor = 1.25;
  static constexpr bool pad_to_capacity = true;
};
}  // namespace

// Last: a step captured as a CUDA graph is new on a GPU, and a rank that throws here goes on to
// no other case's collectives while its peer may still wait in the graph's.
TEST_CASE("EP 2 on CUDA: experts padded to capacity, steps replayed as a CUDA graph, equal the serial model") {
  using PSerial = GPT<padded_cfg, Mesh<>, float, Cuda>;
  using PModel = GPT<padded_cfg, EPMesh, float, Cuda>;
  auto ctx = make_mesh_context<EPMesh>(test::world().split(0, test::world().rank(), "world"));
  CAPTURE(ctx.rank());
  PModel model(ctx, init);
  DataParallel<PModel> dp(model, ctx, hp);
  dp.set_step_graph(true);  // step 1 plain, step 2 captured (NCCL's all-to-alls in it), then replayed
  PSerial serial(init);
  DataParallel<PSerial> sdp(serial, hp, data_ranks);
  for (int s = 0; s < steps + 1; ++s) step_both(dp, sdp, s, cfg::vocab);
  CHECK(model.ops().step_graph_captured());
  check_against_serial(model, serial);
}

int main(int argc, char** argv) { return test::nccl_doctest_main(argc, argv, "test_moe_cuda"); }
