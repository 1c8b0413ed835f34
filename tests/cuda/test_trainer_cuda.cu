// The trainer on CUDA with NCCL, each rank a process (scripts/launch-local.sh), against the
// serial CUDA model trained by the one optimizer step on the same global batches, fp32, 3 steps
// on the warmup + cosine learning rate. One test case per world size (ctest runs each with its
// own number of processes):
//   2 ranks  Mesh<DP<2>>  ZeRO-1, 2 micro-batches accumulated, selective recomputation
//            Mesh<DP<2>>  ZeRO-3
//            Mesh<PP<2>>  1F1B over 4 micro-batches, full recomputation; tied GPT-2 (wte's
//                         gradient summed over the stages on the device), its steps replayed
//                         as a CUDA graph
//            Mesh<TP<2>>  sequence parallel
//            Mesh<CP<2>>  ring attention over zig-zag chunks
//   4 ranks  Mesh<DP<2>, TP<2>>  ZeRO-1, sequence parallel; the same with EP 2 and the MoE
//   8 ranks  Mesh<DP<2>, PP<2>, TP<2>>, 1F1B, dense; and with an EP<2> view: a mixture of experts (4 experts,
//            top-2) in every other block, 1F1B, ZeRO-1, sequence parallel
// every step's loss within 1e-5 relative, the gathered weights (experts too) within 1e-4; then
// Trainer::evaluate on a held-out batch within 1e-5 of the serial model's forwards, and one
// more step (plain: an evaluation gives a step graph up) within 1e-5. Exits 77 without a GPU.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include <fived/comm/nccl.hpp>
#include <fived/nn/cuda/ops.hpp>  // before gpt.hpp: Ops<T, Cuda>
#include <fived/mesh/context.hpp>
#include <fived/nn/gpt.hpp>
#include <fived/train/trainer.hpp>

#include "nccl_test_main.hpp"
#include "../support/batches.hpp"
#include "../support/compare.hpp"

using namespace fived;

namespace {

template <class R>
struct cfg : gpt_config {
  static constexpr int layers = 2, d_model = 64, heads = 4, vocab = 101, max_seq = 32, vocab_multiple = 16;
  static constexpr bool tied = false;
  using recompute = R;
};
template <class R>
struct tied_cfg : cfg<R> {
  static constexpr bool tied = true;
};
template <class R>
struct moe_cfg : cfg<R> {
  static constexpr int layers = 4, experts = 4, top_k = 2, moe_every = 2, mlp_ratio = 2;
  static constexpr double aux_loss_coef = 0.05;
};
constexpr int B = 4, T = 16, steps = 3;
const GptInit init{7, 0.05};
const TrainerConfig hp{
    .adamw = {.lr = 0, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f},
    .lr = WarmupCosine{.peak = 1e-2, .warmup = 1, .total = steps, .floor = 0.1}};

// Cfg<R>: the model's configuration with recomputation R (the serial reference keeps
// everything). The serial model takes each step's micro-batches as data_ranks pieces of
// B/data_ranks rows: what the data ranks see (the experts' balancing loss is per piece).
// graph: the trainer replays its second step as a CUDA graph from the third on.
template <class M, class Policy, class Sched, class R, template <class> class Cfg = cfg, class SP = NoSequenceParallel>
void trainer_equals_serial(int data_ranks = 1, bool graph = false) {
  constexpr int micro = Sched::table.micro_batches;
  using Serial = GPT<Cfg<NoRecompute>, Mesh<>, float, Cuda>;
  auto ctx = make_mesh_context<M>(test::world().split(0, test::world().rank(), "world"));
  TrainerConfig config = hp;
  config.step_graph = graph;
  Trainer<GPT<Cfg<R>, M, float, Cuda, SP>, Policy, Sched> t(ctx, config, init);
  Serial serial(init);
  DataParallel<Serial> sdp(serial, hp.adamw, micro * data_ranks);
  std::vector<int> tok, tgt;
  for (int s = 1; s <= steps; ++s) {
    CAPTURE(s);
    test::global_batch(s, micro, B, T, Cfg<R>::vocab, tok, tgt);
    sdp.optimizer().hp.lr = hp.lr(s);
    const double lt = t.step(s, tok, tgt, B, T), ls = sdp.step(tok, tgt, B / data_ranks, T);
    std::fprintf(stderr, "rank %d of %d: step %d, loss %.6f (serial %.6f)\n", test::world().rank(), M::size, s, lt, ls);
    CHECK(std::abs(lt - ls) <= 1e-5 * std::abs(ls));
  }
  CHECK(t.step_graph_captured() == graph);
  CHECK(test::max_rel_error(t.serial_params(), serial.params_to_host()) <= 1e-4);
  if constexpr (Serial::has_experts)
    CHECK(test::max_rel_error(t.serial_expert_params(), serial.expert_params_to_host()) <= 1e-4);

  // A held-out loss on the mesh (Trainer::evaluate: forwards only) is the serial model's on
  // the same rows; the step after it (a plain one: the graph was given up) equals serial too.
  test::global_batch(1000, micro, B, T, Cfg<R>::vocab, tok, tgt);
  const double held = t.evaluate(tok, tgt, B, T);
  serial.set_training(false);
  double serial_held = 0;
  for (int k = 0; k < micro * data_ranks; ++k) {
    const std::size_t off = static_cast<std::size_t>(k) * (B / data_ranks) * T;
    serial_held += serial.forward(tok.data() + off, tgt.data() + off, B / data_ranks, T) / (micro * data_ranks);
  }
  serial.set_training(true);
  std::fprintf(stderr, "rank %d of %d: held-out loss %.6f (serial %.6f)\n", test::world().rank(), M::size, held,
               serial_held);
  CHECK(std::abs(held - serial_held) <= 1e-5 * std::abs(serial_held));
  test::global_batch(steps + 1, micro, B, T, Cfg<R>::vocab, tok, tgt);
  sdp.optimizer().hp.lr = hp.lr(steps + 1);
  const double lt = t.step(steps + 1, tok, tgt, B, T), ls = sdp.step(tok, tgt, B / data_ranks, T);
  CHECK(std::abs(lt - ls) <= 1e-5 * std::abs(ls));
}

}  // namespace

TEST_CASE("2 ranks: the trainer on CUDA on DP 2 (ZeRO-1 and ZeRO-3), PP 2 (1F1B), TP 2 (SP) and CP 2 equals serial") {
  trainer_equals_serial<Mesh<DP<2>>, ZeRO<1>, Accumulate<2>, SelectiveRecompute>();
  trainer_equals_serial<Mesh<DP<2>>, ZeRO<3>, Accumulate<1>, NoRecompute>();
  trainer_equals_serial<Mesh<PP<2>>, NoZeRO, pipeline::OneFOneB<2, 4>, FullRecompute>();
  trainer_equals_serial<Mesh<TP<2>>, NoZeRO, Accumulate<1>, NoRecompute, cfg, SequenceParallel>();
  trainer_equals_serial<Mesh<CP<2>>, NoZeRO, Accumulate<1>, NoRecompute>();
}
// A case of its own, after the others: a step captured as a CUDA graph is new on a GPU, and
// a throw here must not cost the cases above.
TEST_CASE("2 ranks: the trainer on CUDA on PP 2 (1F1B, tied embedding and head), each step a CUDA graph, equals "
          "serial") {
  trainer_equals_serial<Mesh<PP<2>>, NoZeRO, pipeline::OneFOneB<2, 4>, NoRecompute, tied_cfg>(1, true);
}

TEST_CASE("4 ranks: the trainer on CUDA on DP 2 x TP 2 (ZeRO-1, SP) equals serial") {
  trainer_equals_serial<Mesh<DP<2>, TP<2>>, ZeRO<1>, Accumulate<2>, SelectiveRecompute, cfg, SequenceParallel>();
}
TEST_CASE("4 ranks: the trainer on CUDA on DP 2 x TP 2 with EP 2 (MoE, ZeRO-1, SP) equals serial") {
  trainer_equals_serial<Mesh<DP<2>, TP<2>, EP<2>>, ZeRO<1>, Accumulate<2>, SelectiveRecompute, moe_cfg,
                        SequenceParallel>(2);
}
TEST_CASE("8 ranks: the trainer on CUDA on DP 2 x PP 2 x TP 2 (1F1B, ZeRO-1, SP) equals serial") {
  trainer_equals_serial<Mesh<DP<2>, PP<2>, TP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 4>, SelectiveRecompute, cfg,
                        SequenceParallel>();
}

TEST_CASE("8 ranks: the trainer on CUDA on DP 2 x PP 2 x TP 2 with EP 2 (MoE, 1F1B, ZeRO-1, SP) equals serial") {
  trainer_equals_serial<Mesh<DP<2>, PP<2>, TP<2>, EP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 4>, SelectiveRecompute,
                        moe_cfg, SequenceParallel>(2);
}

int main(int argc, char** argv) { return test::nccl_doctest_main(argc, argv, "test_trainer_cuda"); }
