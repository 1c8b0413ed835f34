// Activation recomputation (nn/recompute.hpp) changes no value and saves what it says.
//
// Each policy is run beside NoRecompute on the same mesh and the same batches: the losses and
// every gradient must be equal bit for bit (the recomputed forward is the same arithmetic on
// the same inputs). Two slots in flight (a pipeline's pattern: F0 F1 B1 B0) check that the
// buffers FullRecompute and SelectiveRecompute share between slots are refilled before use.
// The memory a policy saves is measured from the host buffers the model holds.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/train/data_parallel.hpp"
#include "support/batches.hpp"
#include "support/compare.hpp"

using namespace fived;

namespace {

template <class R>
struct dense_cfg : gpt_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, vocab = 53, max_seq = 48, vocab_multiple = 16;
  using recompute = R;
};
// MoE in the second block (top-2 of 4, balancing loss): the dispatch and its all-to-all run again.
template <class R>
struct moe_cfg : dense_cfg<R> {
  static constexpr int experts = 4, top_k = 2, moe_every = 2, mlp_ratio = 2;
  static constexpr double aux_loss_coef = 0.05;
};

// Packed documents (context/documents.hpp): each slot's own documents, read again in backward.
template <class R>
struct packed_cfg : dense_cfg<R> {
  static constexpr int end_of_document = 2;
};

constexpr int B = 4, T = 16;
const GptInit init{5, 0.05};

struct Run {
  std::vector<double> losses;
  std::vector<float> grads, expert_grads;  // the serial layout / this rank's experts
  int ep_rank = 0, tp_rank = 0;
};

// Two micro-batches in two slots, F0 F1 B1 B0, then the gradients of both.
template <class Model>
Run two_in_flight(Model& m) {
  Run r;
  std::vector<int> tok, tgt;
  test::packed_batch(0, 2, B, T, Model::V, Model::config::end_of_document, tok, tgt);  // -1: no documents
  m.set_slots(2);
  m.zero_grad();
  const std::size_t n = static_cast<std::size_t>(B) * T;
  r.losses.push_back(m.forward(tok.data(), tgt.data(), B, T, {}, 0));
  r.losses.push_back(m.forward(tok.data() + n, tgt.data() + n, B, T, {}, 1));
  r.losses.push_back(m.aux_loss(0));
  r.losses.push_back(m.aux_loss(1));
  m.backward({}, 1);
  m.backward({}, 0);
  r.grads = m.gather_grads();
  if constexpr (Model::has_experts) r.expert_grads = m.expert_grads_to_host(), r.ep_rank = m.ep_rank();
  r.tp_rank = m.tp_rank();
  return r;
}

template <template <class> class Cfg, class R, class M = Mesh<>, class SP = NoSequenceParallel>
std::vector<Run> run_on_mesh() {
  using Model = GPT<Cfg<R>, M, float, Host, SP>;
  std::vector<Run> out(M::size);
  if constexpr (M::size == 1) {
    Model m(init);
    out[0] = two_in_flight(m);
  } else {
    host::run(M::size, [&](host::Comm& world) {
      auto ctx = make_mesh_context<M>(world);
      Model m(ctx, init);
      out[static_cast<std::size_t>(ctx.rank())] = two_in_flight(m);
    });
  }
  return out;
}

void check_same(const std::vector<Run>& got, const std::vector<Run>& ref) {
  REQUIRE(got.size() == ref.size());
  for (std::size_t r = 0; r < ref.size(); ++r) {
    CAPTURE(r);
    CHECK(got[r].losses == ref[r].losses);
    CHECK(got[r].grads == ref[r].grads);
    CHECK(got[r].expert_grads == ref[r].expert_grads);
    CHECK(!ref[r].grads.empty());
  }
}

template <template <class> class Cfg, class M = Mesh<>, class SP = NoSequenceParallel>
void every_policy_equals_none() {
  const std::vector<Run> none = run_on_mesh<Cfg, NoRecompute, M, SP>();
  check_same(run_on_mesh<Cfg, SelectiveRecompute, M, SP>(), none);
  check_same(run_on_mesh<Cfg, FullRecompute, M, SP>(), none);
}

}  // namespace

TEST_CASE("recomputation changes no loss and no gradient: serial, two slots in flight, with packed documents too") {
  every_policy_equals_none<dense_cfg>();
  every_policy_equals_none<moe_cfg>();
  every_policy_equals_none<packed_cfg>();
}

TEST_CASE("recomputation changes no gradient on Mesh<TP<2>> with SP and on Mesh<CP<2>, TP<2>> (the ring again, also "
          "over packed documents)") {
  every_policy_equals_none<dense_cfg, Mesh<TP<2>>, SequenceParallel>();
  every_policy_equals_none<dense_cfg, Mesh<CP<2>, TP<2>>, SequenceParallel>();
  every_policy_equals_none<packed_cfg, Mesh<CP<2>, TP<2>>, SequenceParallel>();
}

TEST_CASE("recomputation changes no gradient of a mixture of experts over Mesh<CP<2>, TP<2>, EP<2>> (the all-to-all again)") {
  every_policy_equals_none<moe_cfg, Mesh<CP<2>, TP<2>, EP<2>>, SequenceParallel>();
}

TEST_CASE("CP x EP: a mixture of experts on Mesh<CP<2>, TP<2>, EP<2>> equals the serial model") {
  const std::vector<Run> serial = run_on_mesh<moe_cfg, NoRecompute>();
  const std::vector<Run> mesh = run_on_mesh<moe_cfg, SelectiveRecompute, Mesh<CP<2>, TP<2>, EP<2>>, SequenceParallel>();
  // Each CP rank's loss is the mean over its own tokens: the pair's mean is the sequences'.
  for (std::size_t i = 0; i < 2; ++i) {
    const double mean = (mesh[0].losses[i] + mesh[2].losses[i]) / 2;  // CP ranks 0 and 1 of TP rank 0
    CHECK(std::abs(mean - serial[0].losses[i]) <= 1e-5 * serial[0].losses[i]);
  }
  // Gradients: each CP rank's are of its own mean loss; their average is the serial one.
  std::vector<float> avg(serial[0].grads.size());
  for (std::size_t i = 0; i < avg.size(); ++i) avg[i] = (mesh[0].grads[i] + mesh[2].grads[i]) / 2;
  CHECK(test::max_rel_error(avg, serial[0].grads) <= 1e-5);
  // Experts: CP rank r holds experts [2r, 2r + 2), split over TP; their gradient sums both CP
  // ranks' mean losses (DataParallel scales it by 1/EP), so it is twice the serial one.
  using EL = GPT<moe_cfg<NoRecompute>, Mesh<CP<2>, TP<2>, EP<2>>, float, Host, SequenceParallel>::expert_layout;
  std::vector<float> pieces(EL::size * 4), whole(EL::serial::size);
  for (const Run& r : mesh)
    std::copy(r.expert_grads.begin(), r.expert_grads.end(),
              pieces.begin() + static_cast<std::ptrdiff_t>(EL::size * static_cast<std::size_t>(r.ep_rank * 2 + r.tp_rank)));
  EL::assemble(std::span<const float>(pieces), std::span<float>(whole));
  for (float& g : whole) g /= 2;
  CHECK(test::max_rel_error(whole, serial[0].expert_grads) <= 1e-5);
}

TEST_CASE("what each policy keeps: the bytes saved are the core attention per block, or all but each block's output") {
  // The serial model's host buffers after one forward with two slots: parameters, gradients,
  // both slots' activations and the shared work buffers.
  auto held = []<class R>() {
    const std::size_t before = buffer_bytes_held<Host>();
    GPT<dense_cfg<R>> m(init);
    (void)two_in_flight(m);
    return buffer_bytes_held<Host>() - before;
  };
  const std::size_t none = held.template operator()<NoRecompute>();
  const std::size_t selective = held.template operator()<SelectiveRecompute>();
  const std::size_t full = held.template operator()<FullRecompute>();
  constexpr std::size_t N = B * T, C = 32, H = 4, F = 4 * C, L = 2, slots = 2, f = sizeof(float);
  // Selective: the core attention's output [N, C] and log-sum-exp [N, H] once instead of per block and slot.
  constexpr std::size_t core = (N * C + N * H) * f;
  CHECK(none - selective == (slots * L - 1) * core);
  // Full: of a block's ln_1 (out, mean, rstd), qkv, core, res2, ln_2, pre, h and res3 only res3 per
  // block and slot, and one whole block shared.
  // ln_1, ln_2 out and res2, res3 [N, C]; mean, rstd [N] twice; qkv [N, 3C]; core; pre, h [N, F].
  constexpr std::size_t block = (4 * N * C + 4 * N + 3 * N * C + 2 * N * F) * f + core;
  constexpr std::size_t kept = N * C * f;
  CHECK(none - full == (slots * L - 1) * block - slots * L * kept);
}
