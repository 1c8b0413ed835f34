// Parallel equals serial on CUDA with NCCL: each rank a process (scripts/launch-local.sh, one
// GPU is enough), the mesh's model and DataParallel against the serial CUDA model
// (GPT<cfg, Mesh<>, T, Cuda> with DataParallel<serial>) that every rank also trains on the
// same global batches. One test case per mesh, picked with doctest's -tc; every rank of a
// launch must run the same one:
//
//   scripts/launch-local.sh 2 build/tests/cuda/test_mesh_cuda -tc="TP 2*"
//   scripts/launch-local.sh 4 build/tests/cuda/test_mesh_cuda -tc="DP 2 x TP 2*"
//
// Each case, for fp32 and bf16 (bf16 model, fp32 masters):
//   - TP meshes: the loss and every gradient tensor of one forward/backward, gathered over TP
//     into the serial layout, against the serial model's;
//   - 5 steps with accumulation 2 and clipping: the loss of every step, then every weight
//     tensor (per tensor ||par - ser|| / ||ser||);
//   - steps 2-5 allocate no device buffer (buffer_allocations<Cuda>: the step's workspaces
//     were all sized before), the kernels' stream-ordered scratch takes no memory from
//     the driver (the default pool's reserved bytes stay as they were after step 1), and the
//     pages ZeRO-2/3 give back are reused (no chunk created: device/cuda_pages.hpp);
//   - ZeRO-2/3: between steps the model's gradient buffer (ZeRO-3: and its parameters)
//     holds no device memory (this model's buffers are smaller than one chunk).
// And on DP 2 x TP 2 with ZeRO-1, steps replayed as a CUDA graph equal plain steps bit for bit
// (graph_equals_plain).
// Bounds: fp32 loss 1e-4 relative, gradients 1e-3 (max |diff| / max |ser| per tensor),
// weights 1e-3; bf16 loss 2e-2, gradients 5e-2, weights 5e-2 (bf16 rounds each rank's
// partial sums: the runs differ by bf16 rounding of different sums). AdamW's eps is 1e-2 so
// that its step is a smooth function of the gradient and the weights test the gradients.
//
// Without a GPU every rank exits 77 (skipped) before NCCL is touched.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <fived/comm/nccl.hpp>
#include <fived/comm/nccl_bootstrap.hpp>
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
constexpr int B = 4, T = 16, accum = 2, steps = 5;
const GptInit init{7, 0.05};
const AdamWConfig hp{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-2f, .weight_decay = 0.1f, .max_norm = 0.5f};

struct Bounds {
  double loss, grad, weights;
};
template <class E>
constexpr Bounds bounds = std::is_same_v<E, bf16> ? Bounds{2e-2, 5e-2, 5e-2} : Bounds{1e-4, 1e-3, 1e-3};

void global_batch(int step, int n, std::vector<int>& tok, std::vector<int>& tgt) {
  test::global_batch(step, n, B, T, cfg::vocab, tok, tgt);
}

using Serial = GPT<cfg>;  // the serial layout every comparison is made in


template <class A, class B_>
double tensor_l2_error(const std::vector<A>& got, const std::vector<B_>& ref, const ParamInfo& t) {
  double d2 = 0, r2 = 0;
  for (std::size_t i = t.offset; i < t.end(); ++i) {
    const double a = test::as_double(got[i]), b = test::as_double(ref[i]);
    d2 += (a - b) * (a - b);
    r2 += b * b;
  }
  return r2 > 0 ? std::sqrt(d2 / r2) : std::sqrt(d2);
}

template <class M, class Policy, class E, class SP>
void parallel_equals_serial() {
  using Par = GPT<cfg, M, E, Cuda, SP>;
  using Ser = GPT<cfg, Mesh<>, E, Cuda>;
  constexpr Bounds bound = bounds<E>;
  auto ctx = make_mesh_context<M>(test::world().split(0, test::world().rank(), "world"));
  CAPTURE(ctx.rank());
  std::vector<int> tok, tgt;

  if constexpr (M::extent(Axis::tp) > 1) {  // one forward/backward, every gradient
    Par p(ctx, init);
    Ser s(init);
    global_batch(0, 1, tok, tgt);
    const double lp = p.forward(tok.data(), tgt.data(), B, T), ls = s.forward(tok.data(), tgt.data(), B, T);
    p.backward();
    s.backward();
    CHECK(std::abs(lp - ls) <= bound.loss * std::abs(ls));
    const std::vector<E> gp = p.gather_grads(), gs = s.grads_to_host();
    REQUIRE(gp.size() == gs.size());
    for (const ParamInfo& t : Serial::layout::tensors) {
      CAPTURE(t.name());
      CHECK(test::max_rel_error(gp, gs, t.offset, t.size()) <= bound.grad);
    }
  }

  Par p(ctx, init);
  Ser s(init);
  DataParallel<Par, Policy> dp(p, ctx, hp, accum);
  DataParallel<Ser> serial(s, hp, accum);
  std::size_t after_first = 0;
  std::uint64_t pool_after_first = 0;
  std::size_t chunks_after_first = 0;
  for (int step = 0; step < steps; ++step) {
    CAPTURE(step);
    global_batch(step, accum, tok, tgt);
    const double lp = dp.step(tok, tgt, B, T), ls = serial.step(tok, tgt, B, T);
    CHECK(std::abs(lp - ls) <= bound.loss * std::abs(ls));
    if (step == 0) {
      after_first = buffer_allocations<Cuda>().load();
      pool_after_first = kernels::cuda::scratch_pool_reserved();
      chunks_after_first = fived::cuda::page_stats().chunks_created;
    }
  }
  CHECK(buffer_allocations<Cuda>().load() == after_first);
  CHECK(kernels::cuda::scratch_pool_reserved() == pool_after_first);  // the kernels' scratch: no memory from the driver
  CHECK(fived::cuda::page_stats().chunks_created == chunks_after_first);  // released pages reused, not grown
  if constexpr (Policy::stage >= 2) {  // between steps the model's buffers hold what ZeRO keeps of them: nothing
    fived::cuda::settle_pages();
    CHECK(fived::cuda::resident_bytes(std::span<const E>(p.grads())) == 0);
    if constexpr (Policy::stage == 3) CHECK(fived::cuda::resident_bytes(std::span<const E>(p.params())) == 0);
  }

  std::vector<E> wp;
  if constexpr (Policy::stage == 3) {
    static_assert(M::extent(Axis::tp) == 1, "ZeRO-3 weights are read with full_params, the serial layout at TP 1");
    wp = dp.full_params();
  } else {
    wp = p.gather_params();
  }
  const std::vector<E> ws = s.params_to_host();
  REQUIRE(wp.size() == ws.size());
  for (const ParamInfo& t : Serial::layout::tensors) {
    CAPTURE(t.name());
    CHECK(tensor_l2_error(wp, ws, t) <= bound.weights);
  }
}

// Steps replayed as a CUDA graph (nn/step_graph.hpp) on the mesh against plain steps of the
// same mesh: the TP and SP collectives on the model's stream, the gradients' reductions and
// ZeRO-1's gathers on the communication stream are all in the graph. Two models, each on a
// context of its own (a communicator follows one model's streams), stepped in turn with a
// new batch and learning rate each step: the same losses and weights, bit for bit, and no
// buffer allocated after the first step.
template <class M, class Policy, class E>
void graph_equals_plain() {
  using Par = GPT<cfg, M, E, Cuda, SequenceParallel>;
  auto ctx_plain = make_mesh_context<M>(test::world().split(0, test::world().rank(), "world"));
  auto ctx_graph = make_mesh_context<M>(test::world().split(0, test::world().rank(), "world"));
  CAPTURE(ctx_plain.rank());
  Par plain_model(ctx_plain, init), graph_model(ctx_graph, init);
  DataParallel<Par, Policy> plain(plain_model, ctx_plain, hp, accum), graphed(graph_model, ctx_graph, hp, accum);
  graphed.set_step_graph(true);
  std::vector<int> tok, tgt;
  std::size_t after_first = 0;
  for (int step = 0; step < 8; ++step) {
    CAPTURE(step);
    global_batch(step, accum, tok, tgt);
    plain.optimizer().hp.lr = graphed.optimizer().hp.lr = 1e-2 / (1 + step);
    const double lp = plain.step(tok, tgt, B, T), lg = graphed.step(tok, tgt, B, T);
    CHECK(lp == lg);
    CHECK(graph_model.ops().step_graph_captured() == (step >= 1));
    if (step == 0) after_first = buffer_allocations<Cuda>().load();
  }
  CHECK(buffer_allocations<Cuda>().load() == after_first);
  const std::vector<E> wp = plain_model.gather_params(), wg = graph_model.gather_params();
  REQUIRE(wp.size() == wg.size());
  CHECK(std::memcmp(wp.data(), wg.data(), wp.size() * sizeof(E)) == 0);
}

}  // namespace

TEST_CASE("TP 2 (sequence parallel) equals serial on CUDA: 2 ranks") {
  using M = Mesh<TP<2>>;
  parallel_equals_serial<M, NoZeRO, float, SequenceParallel>();
  parallel_equals_serial<M, NoZeRO, bf16, SequenceParallel>();
}

TEST_CASE("DP 2 with ZeRO-1 equals serial on CUDA: 2 ranks") {
  parallel_equals_serial<Mesh<DP<2>>, ZeRO<1>, float, NoSequenceParallel>();
  parallel_equals_serial<Mesh<DP<2>>, ZeRO<1>, bf16, NoSequenceParallel>();
}

TEST_CASE("DP 2 with ZeRO-3 (and ZeRO-2) equals serial on CUDA: 2 ranks") {
  parallel_equals_serial<Mesh<DP<2>>, ZeRO<2>, float, NoSequenceParallel>();
  parallel_equals_serial<Mesh<DP<2>>, ZeRO<3>, float, NoSequenceParallel>();
  parallel_equals_serial<Mesh<DP<2>>, ZeRO<3>, bf16, NoSequenceParallel>();
}

TEST_CASE("DP 2 x TP 2 with ZeRO-1 equals serial on CUDA: 4 ranks") {
  using M = Mesh<DP<2>, TP<2>>;
  parallel_equals_serial<M, ZeRO<1>, float, SequenceParallel>();
  parallel_equals_serial<M, ZeRO<1>, bf16, SequenceParallel>();
}

TEST_CASE("Graph steps on DP 2 x TP 2 with ZeRO-1 equal plain steps bit for bit: 4 ranks") {
  using M = Mesh<DP<2>, TP<2>>;
  graph_equals_plain<M, ZeRO<1>, float>();
  graph_equals_plain<M, ZeRO<1>, bf16>();
}

int main(int argc, char** argv) { return test::nccl_doctest_main(argc, argv, "test_mesh_cuda"); }
