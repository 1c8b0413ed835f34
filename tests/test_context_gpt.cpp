// Context parallelism in the model: ring attention with the zig-zag split against the
// serial model, on the host backend (ranks as threads). Every case trains the same global
// batches for 3 steps (clipped AdamW) and compares every step's loss, the last step's
// gradients (reduced over DP x CP) and the weights after the last step.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/pipeline/executor.hpp"
#include "fived/pipeline/schedules.hpp"
#include "fived/pipeline/stage_layers.hpp"
#include "fived/train/data_parallel.hpp"
#include "support/batches.hpp"
#include "support/compare.hpp"

using namespace fived;

namespace {

struct tied_cfg : gpt_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, vocab = 53, max_seq = 48, vocab_multiple = 16;
};
struct untied_cfg : tied_cfg {
  static constexpr bool tied = false;
};
// Documents packed into the rows (context/documents.hpp), token 2 ending each.
struct packed_cfg : tied_cfg {
  static constexpr int end_of_document = 2;
};
struct packed_gather_cfg : packed_cfg {
  using context_attention = AllGatherContext;
};
struct packed_untied_cfg : untied_cfg {
  static constexpr int end_of_document = 2;
};

constexpr int B = 4, steps = 3;
const GptInit init{5, 0.05};
const AdamWConfig hp{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f};

// The batch of step s: random ids, with Cfg's documents if it has them (test::packed_batch).
template <class Cfg>
void batch(int s, int micro, int T, std::vector<int>& tok, std::vector<int>& tgt) {
  test::packed_batch(s, micro, B, T, Cfg::vocab, Cfg::end_of_document, tok, tgt);
}

struct Result {
  std::vector<double> losses;
  std::vector<float> weights, grads;  // the serial layout
};

// Batches: whose batches (its documents, if any) the model trains on.
template <class Cfg, class Batches = Cfg>
Result serial_run(int T, int micro) {
  GPT<Cfg> m(init);
  DataParallel<GPT<Cfg>> dp(m, hp, micro);
  Result r;
  std::vector<int> tok, tgt;
  for (int s = 0; s < steps; ++s) {
    batch<Batches>(s, micro, T, tok, tgt);
    r.losses.push_back(dp.step(tok, tgt, B, T));
  }
  r.weights.assign(m.params().begin(), m.params().end());
  r.grads.assign(m.grads().begin(), m.grads().end());
  return r;
}

// The whole model on every rank of M (TP splits it; DP and CP replicate it).
template <class Cfg, class M, class Policy = NoZeRO, class SP = NoSequenceParallel>
Result mesh_run(int T) {
  using Model = GPT<Cfg, M, float, Host, SP>;
  Result out;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Model m(ctx, init);
    DataParallel<Model, Policy> dp(m, ctx, hp);
    const bool keep = ctx.rank() == 0;
    std::vector<int> tok, tgt;
    for (int s = 0; s < steps; ++s) {
      batch<Cfg>(s, 1, T, tok, tgt);
      const double loss = dp.step(tok, tgt, B, T);
      if (keep) out.losses.push_back(loss);
    }
    // full_params(): under ZeRO-3 the model's buffer holds only what a step gathers
    const std::vector<float> mine = dp.full_params();
    std::copy(mine.begin(), mine.end(), m.params().begin());
    const std::vector<float> w = m.gather_params(), g = m.gather_grads();
    if (keep) out.weights = w, out.grads = g;
  });
  return out;
}

void check_equal(const Result& got, const Result& ref, bool grads) {
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    const auto i = static_cast<std::size_t>(s);
    CHECK(std::abs(got.losses[i] - ref.losses[i]) <= 1e-5 * ref.losses[i]);
  }
  if (grads) CHECK(test::max_rel_error(got.grads, ref.grads) <= 1e-5);
  CHECK(test::max_rel_error(got.weights, ref.weights) <= 1e-5);
}

}  // namespace

TEST_CASE("CP 2 and 4: loss, gradients and weights after 3 AdamW steps equal the serial model, two sequence lengths") {
  for (int T : {16, 24}) {  // 24: not a power of two (chunks of 6 at CP 2, of 3 at CP 4)
    CAPTURE(T);
    const Result ref = serial_run<tied_cfg>(T, 1);
    check_equal(mesh_run<tied_cfg, Mesh<CP<2>>>(T), ref, true);
    check_equal(mesh_run<tied_cfg, Mesh<CP<4>>>(T), ref, true);
  }
}

TEST_CASE("a sequence length that does not cut into 2·CP chunks is an error that says what to change") {
  host::run(2, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<CP<2>>>(world);
    GPT<tied_cfg, Mesh<CP<2>>> m(ctx, init);
    std::vector<int> tok(2 * 10, 1);
    CHECK_THROWS_WITH_AS(m.forward(tok.data(), tok.data(), 2, 10),
                         "context parallelism over CP = 2 cuts every sequence into 2 x CP = 4 equal chunks, and the "
                         "sequence length 10 is not a multiple of 4: pad or crop the sequences to a multiple of 4",
                         std::invalid_argument);
  });
}

TEST_CASE("Mesh<DP<2>, CP<2>, TP<2>> (SP): 3 steps equal the serial model, without ZeRO and with ZeRO-1") {
  using M = Mesh<DP<2>, CP<2>, TP<2>>;
  const Result ref = serial_run<tied_cfg>(16, 1);
  check_equal(mesh_run<tied_cfg, M, NoZeRO, SequenceParallel>(16), ref, true);
  check_equal(mesh_run<tied_cfg, M, ZeRO<1>, SequenceParallel>(16), ref, false);
}

TEST_CASE("CP with ZeRO-2 and ZeRO-3 (the gradients reduce-scattered and, ZeRO-3, the weights gathered over DP x "
          "CP): Mesh<DP<2>, CP<2>> and Mesh<DP<2>, CP<2>, TP<2>> (SP), 3 steps equal the serial model") {
  const Result ref = serial_run<tied_cfg>(16, 1);
  check_equal(mesh_run<tied_cfg, Mesh<DP<2>, CP<2>>, ZeRO<2>>(16), ref, false);
  check_equal(mesh_run<tied_cfg, Mesh<DP<2>, CP<2>>, ZeRO<3>>(16), ref, false);
  check_equal(mesh_run<tied_cfg, Mesh<DP<2>, CP<2>, TP<2>>, ZeRO<3>, SequenceParallel>(16), ref, false);
}

namespace {
template <int stage, class Cfg = untied_cfg>
using PPStage = GPT<Cfg, Mesh<PP<2>, CP<2>>, float, Host, NoSequenceParallel,
                    typename StageLayers<GPT<Cfg>, 2, UniformCost>::template part<stage>>;

template <int stage, class Cfg, class Ctx>
void pp_rank(Ctx& ctx, Result& out, int T) {
  using Sched = pipeline::OneFOneB<2, 4>;
  constexpr int micro = Sched::table.micro_batches;
  PPStage<stage, Cfg> m(ctx, init);
  DataParallel<PPStage<stage, Cfg>> dp(m, ctx, hp, micro);
  auto exec = pipeline::make_executor(Sched::table, stage, ctx.template comm<Axis::pp>(), std::tie(m), std::tie(dp));
  std::vector<int> tok, tgt;
  const bool keep = ctx.coord()[Axis::cp] == 0;
  for (int s = 0; s < steps; ++s) {
    batch<Cfg>(s, micro, T, tok, tgt);
    const double loss = exec.step(tok, tgt, B, T);
    if (keep) out.losses.push_back(loss);
  }
  if (!keep) return;
  const std::vector<float> w = m.params_to_host(), g = m.grads_to_host();
  using Serial = GPT<Cfg>;
  for (const ParamInfo& t : PPStage<stage, Cfg>::layout::tensors) {
    const ParamInfo& to = Serial::layout::tensors[static_cast<std::size_t>(*Serial::layout::find(t.name()))];
    std::copy_n(w.begin() + static_cast<std::ptrdiff_t>(t.offset), t.size(),
                out.weights.begin() + static_cast<std::ptrdiff_t>(to.offset));
    std::copy_n(g.begin() + static_cast<std::ptrdiff_t>(t.offset), t.size(),
                out.grads.begin() + static_cast<std::ptrdiff_t>(to.offset));
  }
}
}  // namespace

namespace {
template <class Cfg>
void check_pp_cp(int T) {
  const Result ref = serial_run<Cfg>(T, 4);
  std::vector<Result> stages(2);
  for (Result& r : stages) r.weights.assign(ref.weights.size(), 0.0f), r.grads.assign(ref.grads.size(), 0.0f);
  using M = Mesh<PP<2>, CP<2>>;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    if (ctx.coord()[Axis::pp] == 0) pp_rank<0, Cfg>(ctx, stages[0], T);
    else pp_rank<1, Cfg>(ctx, stages[1], T);
  });
  Result got = stages[0];
  for (std::size_t i = 0; i < got.weights.size(); ++i)  // each tensor on one stage, zeros on the other
    got.weights[i] += stages[1].weights[i], got.grads[i] += stages[1].grads[i];
  CHECK(stages[1].losses == stages[0].losses);
  check_equal(got, ref, true);
}
}  // namespace

TEST_CASE("Mesh<PP<2>, CP<2>>: 1F1B over 4 micro-batches for 3 steps equals the serial model") {
  check_pp_cp<untied_cfg>(24);
}

// Packed documents (context/documents.hpp): a document's start may lie in another rank's
// chunk, and a past chunk may hold keys that some rows see and others do not.
TEST_CASE("packed documents under CP 2 and 4 (ring and all-gather), DP 2 x CP 2 x TP 2 (SP) and PP 2 x CP 2: loss, "
          "gradients and weights equal the serial model's over the same documents") {
  for (int T : {16, 24}) {
    CAPTURE(T);
    const Result ref = serial_run<packed_cfg>(T, 1);
    // The documents change the model's answer: the same ids as one sequence a row give another loss.
    CHECK(std::abs(ref.losses[0] - serial_run<tied_cfg, packed_cfg>(T, 1).losses[0]) > 1e-4);
    check_equal(mesh_run<packed_cfg, Mesh<CP<2>>>(T), ref, true);
    check_equal(mesh_run<packed_cfg, Mesh<CP<4>>>(T), ref, true);
    check_equal(mesh_run<packed_gather_cfg, Mesh<CP<2>>>(T), serial_run<packed_gather_cfg>(T, 1), true);
    check_equal(mesh_run<packed_gather_cfg, Mesh<CP<4>>>(T), serial_run<packed_gather_cfg>(T, 1), true);
  }
  check_equal(mesh_run<packed_cfg, Mesh<DP<2>, CP<2>, TP<2>>, NoZeRO, SequenceParallel>(16),
              serial_run<packed_cfg>(16, 1), true);
  check_pp_cp<packed_untied_cfg>(24);
}
