// Context parallelism on CUDA with NCCL, each rank a process (scripts/launch-local.sh 2):
// GPT<cfg, Mesh<CP<2>>, float, Cuda> trained by DataParallel (which averages over DP x CP)
// against the serial CUDA model on the same global batches, fp32, for T = 16 and 24:
// every step's loss within 1e-5 relative, the last step's gradients and the weights after
// 3 steps within 1e-4 (max |diff| / max |serial|: the ring sums attention in another order).
// Exits 77 without a GPU.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
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
};
using Serial = GPT<cfg, Mesh<>, float, Cuda>;
using CPMesh = Mesh<CP<2>>;
using Model = GPT<cfg, CPMesh, float, Cuda>;
constexpr int B = 4, steps = 3;
const GptInit init{7, 0.05};
const AdamWConfig hp{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f};

void cp2_equals_serial(int T) {
  CAPTURE(T);
  auto ctx = make_mesh_context<CPMesh>(test::world().split(0, test::world().rank(), "world"));
  Model model(ctx, init);
  DataParallel<Model> dp(model, ctx, hp);
  Serial serial(init);
  DataParallel<Serial> sdp(serial, hp);
  std::vector<int> tok, tgt;
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    test::global_batch(s, 1, B, T, cfg::vocab, tok, tgt);
    const double lc = dp.step(tok, tgt, B, T), ls = sdp.step(tok, tgt, B, T);
    CHECK(std::abs(lc - ls) <= 1e-5 * std::abs(ls));
  }
  CHECK(test::max_rel_error(model.grads_to_host(), serial.grads_to_host()) <= 1e-4);
  CHECK(test::max_rel_error(model.params_to_host(), serial.params_to_host()) <= 1e-4);
}

}  // namespace

TEST_CASE("CP 2 on CUDA: ring attention equals the serial CUDA model (T = 16 and 24)") {
  cp2_equals_serial(16);
  cp2_equals_serial(24);
}

int main(int argc, char** argv) { return test::nccl_doctest_main(argc, argv, "test_context_cuda"); }
