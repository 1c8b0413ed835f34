// The trainer on CUDA with NCCL, each rank a process (scripts/launch-local.sh 2), against the
// serial CUDA model trained by the one optimizer step on the same global batches, fp32, 3 steps
// on the warmup + cosine learning rate:
//   Mesh<DP<2>>  ZeRO-1, 2 micro-batches accumulated, selective recomputation
//   Mesh<PP<2>>  1F1B over 4 micro-batches, full recomputation
// every step's loss within 1e-5 relative, the gathered weights within 1e-4. Exits 77 without a GPU.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
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
constexpr int B = 4, T = 16, steps = 3;
const GptInit init{7, 0.05};
const TrainerConfig hp{
    .adamw = {.lr = 0, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f},
    .lr = WarmupCosine{.peak = 1e-2, .warmup = 1, .total = steps, .floor = 0.1}};

template <class M, class Policy, class Sched, class R>
void trainer_equals_serial() {
  constexpr int micro = Sched::table.micro_batches;
  using Serial = GPT<cfg<NoRecompute>, Mesh<>, float, Cuda>;
  auto ctx = make_mesh_context<M>(test::world().split(0, test::world().rank(), "world"));
  Trainer<GPT<cfg<R>, M, float, Cuda>, Policy, Sched> t(ctx, hp, init);
  Serial serial(init);
  DataParallel<Serial> sdp(serial, hp.adamw, micro);
  std::vector<int> tok, tgt;
  for (int s = 1; s <= steps; ++s) {
    CAPTURE(s);
    test::global_batch(s, micro, B, T, cfg<R>::vocab, tok, tgt);
    sdp.optimizer().hp.lr = hp.lr(s);
    const double lt = t.step(s, tok, tgt, B, T), ls = sdp.step(tok, tgt, B, T);
    CHECK(std::abs(lt - ls) <= 1e-5 * std::abs(ls));
  }
  CHECK(test::max_rel_error(t.serial_params(), serial.params_to_host()) <= 1e-4);
}

}  // namespace

TEST_CASE("the trainer on CUDA: Mesh<DP<2>> (ZeRO-1, selective) and Mesh<PP<2>> (1F1B, full) equal serial") {
  trainer_equals_serial<Mesh<DP<2>>, ZeRO<1>, Accumulate<2>, SelectiveRecompute>();
  trainer_equals_serial<Mesh<PP<2>>, NoZeRO, pipeline::OneFOneB<2, 4>, FullRecompute>();
}

int main(int argc, char** argv) { return test::nccl_doctest_main(argc, argv, "test_trainer_cuda"); }
