// The pipeline executor on CUDA with NCCL, each rank a process (scripts/launch-local.sh 2):
// PP 2 with GPipe, 1F1B and ZB-H1 (the backward split into I and W, nn/weight_grads.hpp) against the serial CUDA model trained by DataParallel on the
// same global batches, fp32: every step's loss within 1e-5 relative, the weights after 3
// steps within 1e-4 (max |diff| / max |serial| over the model; different GEMM shapes per
// stage may sum in another order). Exits 77 without a GPU.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include <fived/comm/nccl.hpp>
#include <fived/comm/nccl_bootstrap.hpp>
#include <fived/nn/cuda/ops.hpp>  // before gpt.hpp: Ops<T, Cuda>
#include <fived/mesh/context.hpp>
#include <fived/nn/gpt.hpp>
#include <fived/pipeline/executor.hpp>
#include <fived/pipeline/schedules.hpp>
#include <fived/pipeline/stage_layers.hpp>
#include <fived/train/data_parallel.hpp>

#include "nccl_test_main.hpp"
#include "../support/batches.hpp"

using namespace fived;

namespace {

struct cfg : gpt_config {
  static constexpr int layers = 4, d_model = 64, heads = 4, vocab = 101, max_seq = 32, vocab_multiple = 16;
  static constexpr bool tied = false;
};
using Serial = GPT<cfg, Mesh<>, float, Cuda>;
using PPMesh = Mesh<PP<2>>;
template <int stage>
using Stage = GPT<cfg, PPMesh, float, Cuda, NoSequenceParallel, StageLayers<GPT<cfg>, 2, UniformCost>::part<stage>>;
constexpr int B = 4, T = 16, steps = 3;
const GptInit init{7, 0.05};
const AdamWConfig hp{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-2f, .weight_decay = 0.1f, .max_norm = 0.5f};

void global_batch(int step, int n, std::vector<int>& tok, std::vector<int>& tgt) {
  test::global_batch(step, n, B, T, cfg::vocab, tok, tgt);
}

template <class Sched, int stage>
void run_stage(MeshContext<PPMesh, nccl::Comm>& ctx) {
  constexpr int micro = Sched::table.micro_batches;
  Stage<stage> model(ctx, init);
  DataParallel<Stage<stage>> dp(model, ctx, hp, micro);
  Serial serial(init);
  DataParallel<Serial> sdp(serial, hp, micro);
  auto exec = pipeline::make_executor(Sched::table, stage, ctx.comm<Axis::pp>(), std::tie(model), std::tie(dp));
  std::vector<int> tok, tgt;
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    global_batch(s, micro, tok, tgt);
    const double lp = exec.step(tok, tgt, B, T), ls = sdp.step(tok, tgt, B, T);
    CHECK(std::abs(lp - ls) <= 1e-5 * std::abs(ls));
  }
  const std::vector<float> w = model.params_to_host(), ws = serial.params_to_host();
  double diff = 0, scale = 0;
  for (const ParamInfo& t : Stage<stage>::layout::tensors) {
    const ParamInfo& to = Serial::layout::tensors[static_cast<std::size_t>(*Serial::layout::find(t.name()))];
    for (std::size_t i = 0; i < t.size(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(w[t.offset + i]) - ws[to.offset + i]));
      scale = std::max(scale, std::abs(static_cast<double>(ws[to.offset + i])));
    }
  }
  CHECK(diff <= 1e-4 * scale);
}

template <class Sched>
void pipeline_equals_serial() {
  auto ctx = make_mesh_context<PPMesh>(test::world().split(0, test::world().rank(), "world"));
  if (ctx.coord()[Axis::pp] == 0) run_stage<Sched, 0>(ctx);
  else run_stage<Sched, 1>(ctx);
}

}  // namespace

TEST_CASE("PP 2 on CUDA: GPipe, 1F1B and ZB-H1 (split backward) equal the serial CUDA model") {
  pipeline_equals_serial<pipeline::GPipe<2, 2>>();
  pipeline_equals_serial<pipeline::OneFOneB<2, 4>>();
  pipeline_equals_serial<pipeline::ZBH1<2, 4>>();
}

int main(int argc, char** argv) { return test::nccl_doctest_main(argc, argv, "test_pipeline_cuda"); }
