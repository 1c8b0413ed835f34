// The backward split in two (the zero-bubble schedules' I and W, nn/weight_grads.hpp):
// backward_input then backward_weight make exactly backward()'s gradients.
//
// Each model runs two micro-batches in two slots, once whole (F0 B0 F1 B1) and once split
// as a zero-bubble pipeline runs them (F0 I0 F1 I1 W0 W1): between I0 and W0 the second
// micro-batch's forward and input half overwrite every buffer the slots share (the layers'
// output gradients, the recomputed activations), so W0 must read its snapshots. Losses and
// every gradient (dense and experts) are compared bit for bit, over GPT-2 and Llama blocks,
// the recomputation policies, TP with SP, CP's ring, grouped-query attention with TP above the
// key/value heads (a weight gradient with its own all-reduce) and experts on EP.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstddef>
#include <stdexcept>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/nn/llama.hpp"
#include "support/batches.hpp"

using namespace fived;

namespace {

template <class R = NoRecompute>
struct gpt_cfg : gpt_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, vocab = 53, max_seq = 48, vocab_multiple = 16;
  using recompute = R;
};
template <class R = NoRecompute>
struct gpt_untied : gpt_cfg<R> {
  static constexpr bool tied = false;
};
template <class R = NoRecompute>
struct gpt_moe : gpt_cfg<R> {  // experts in the second block, with the balancing loss
  static constexpr int experts = 4, top_k = 2, moe_every = 2, mlp_ratio = 2;
  static constexpr double aux_loss_coef = 0.05;
};
template <class R = NoRecompute>
struct llama_cfg : llama_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, kv_heads = 2, ffn = 48, vocab = 61, max_seq = 32;
  static constexpr int vocab_multiple = 16;
  using recompute = R;
};
template <class R = NoRecompute>
struct llama_moe : llama_cfg<R> {  // SwiGLU experts
  static constexpr int experts = 4, top_k = 2, moe_every = 2;
};
template <class R = NoRecompute>
struct llama_ring : llama_cfg<R> {
  using context_attention = RingContext;
};

constexpr int B = 2, T = 16;
const GptInit init{7, 0.05};

struct Run {
  std::vector<double> losses;
  std::vector<float> grads, expert_grads;
  std::size_t allocations = 0;  // buffers allocated by the forwards and backwards (this process)
};

template <class Model>
Run two_micro_batches(Model& m, bool split) {
  std::vector<int> tok, tgt;
  test::global_batch(0, 2, B, T, Model::V, tok, tgt);
  const std::size_t n = static_cast<std::size_t>(B) * T;
  m.set_slots(2);
  m.zero_grad();
  Run r;
  const std::size_t before = buffer_allocations<Host>();
  auto forward = [&](int k) {
    r.losses.push_back(m.forward(tok.data() + k * n, tgt.data() + k * n, B, T, {}, k));
    r.losses.push_back(m.aux_loss(k));
  };
  if (split) {
    forward(0), m.backward_input({}, 0);
    forward(1), m.backward_input({}, 1);
    m.backward_weight({}, 0), m.backward_weight({}, 1);
  } else {
    forward(0), m.backward({}, 0);
    forward(1), m.backward({}, 1);
  }
  r.allocations = buffer_allocations<Host>() - before;
  r.grads = m.gather_grads();
  if constexpr (Model::has_experts) r.expert_grads = m.expert_grads_to_host();
  return r;
}

template <class Model>
void same_on_this_rank(Model& whole, Model& split) {
  const Run ref = two_micro_batches(whole, false);
  const Run got = two_micro_batches(split, true);
  CHECK(got.losses == ref.losses);
  CHECK(got.grads == ref.grads);
  CHECK(got.expert_grads == ref.expert_grads);
  bool nonzero = false;
  for (float g : ref.grads) nonzero = nonzero || g != 0.0f;
  CHECK(nonzero);
  // Again: the same gradients, and with the tapes' arenas sized now, a serial dense model
  // (the only one in this process; experts' rows depend on the routing) allocates nothing.
  const Run again = two_micro_batches(split, true);
  CHECK(again.grads == got.grads);
  if (Model::mesh::size == 1 && !Model::has_experts) CHECK(again.allocations == 0);
}

template <template <class...> class Family, class Cfg, class M = Mesh<>, class SP = NoSequenceParallel>
void split_equals_whole() {
  using Model = Family<Cfg, M, float, Host, SP>;
  CAPTURE(Model::describe());
  if constexpr (M::size == 1) {
    Model whole(init), split(init);
    same_on_this_rank(whole, split);
  } else {
    host::run(M::size, [&](host::Comm& world) {
      auto ctx = make_mesh_context<M>(world);
      Model whole(ctx, init), split(ctx, init);
      same_on_this_rank(whole, split);
    });
  }
}

template <class Cfg, class M = Mesh<>, class SP = NoSequenceParallel>
void gpt() {
  split_equals_whole<GPT, Cfg, M, SP>();
}
template <class Cfg, class M = Mesh<>, class SP = NoSequenceParallel>
void llama() {
  split_equals_whole<Llama, Cfg, M, SP>();
}

}  // namespace

TEST_CASE("GPT-2 serial, tied and untied, every recomputation policy: backward_input + backward_weight = backward") {
  gpt<gpt_cfg<>>();
  gpt<gpt_untied<>>();
  gpt<gpt_cfg<SelectiveRecompute>>();
  gpt<gpt_cfg<FullRecompute>>();
}

TEST_CASE("GPT-2 on Mesh<TP<2>> with SP (LayerNorm gradients all-reduced at W) and on Mesh<CP<2>> (the ring)") {
  gpt<gpt_untied<>, Mesh<TP<2>>, SequenceParallel>();
  gpt<gpt_cfg<FullRecompute>, Mesh<TP<2>>, SequenceParallel>();
  gpt<gpt_cfg<SelectiveRecompute>, Mesh<CP<2>>>();
}

TEST_CASE("a mixture of experts: GPT-2's on Mesh<CP<2>, TP<2>, EP<2>>, Llama's SwiGLU experts on Mesh<DP<2>, EP<2>>") {
  gpt<gpt_moe<>, Mesh<CP<2>, TP<2>, EP<2>>, SequenceParallel>();
  gpt<gpt_moe<FullRecompute>>();
  llama<llama_moe<>, Mesh<DP<2>, EP<2>>>();
}

TEST_CASE("Llama: serial, Mesh<TP<4>> (2 key/value heads on 2 ranks each: the weight half all-reduces), CP's ring") {
  llama<llama_cfg<>>();
  llama<llama_cfg<SelectiveRecompute>, Mesh<TP<4>>, SequenceParallel>();
  llama<llama_ring<FullRecompute>, Mesh<CP<2>>>();
}

TEST_CASE("a split backward out of order is an error that says what to call") {
  GPT<gpt_cfg<>> m(init);
  std::vector<int> tok, tgt;
  test::global_batch(0, 1, B, T, 53, tok, tgt);
  CHECK_THROWS_AS(m.backward_weight(), std::logic_error);  // nothing left by backward_input
  CHECK_THROWS_AS(m.backward_input(), std::logic_error);   // no forward to go back from
  m.forward(tok.data(), tgt.data(), B, T);
  m.backward_input();
  CHECK_THROWS_AS(m.forward(tok.data(), tgt.data(), B, T), std::logic_error);  // its slot still waits for W
  CHECK_THROWS_AS(m.backward_input(), std::logic_error);
  m.backward_weight();
  CHECK_NOTHROW(m.forward(tok.data(), tgt.data(), B, T));
}
