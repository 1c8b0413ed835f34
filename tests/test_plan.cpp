// The static planner (fived/plan/): its figures against ones worked out by hand, against the
// published ones, and against what fived itself allocates and sends.
//
//   - parameter counts: GPT-2 124M as ParamTable counts it, every part and TP/EP split of a
//     GPT and of its experts as ParamTable lays them out; Llama-3-405B and DeepSeek-V3 against
//     their papers (DeepSeek with the MLA correction worked out here)
//   - Llama-3-405B on Mesh<DP<128>, TP<8>, PP<16>>: every per-GPU figure and the traffic of
//     one pipeline rank, as arithmetic in this file
//   - activations against Korthikanti et al. 2022 (Megatron), with the differences named
//   - the demo GPT (examples/train_gpt) on Mesh<DP<2>, TP<2>>: DataParallel::memory() under
//     NoZeRO, ZeRO-1 and ZeRO-3, the bytes the model's buffers really hold for each
//     recomputation policy, and the collectives a Counting communicator sees in one step
//   - the bubble and the micro-batches in flight are pipeline/simulate.hpp's
//   - fits / require_fits in static_asserts

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/device/buffer.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/pipeline/schedule.hpp"
#include "fived/pipeline/stage_layers.hpp"
#include "fived/plan/fits.hpp"
#include "fived/plan/models.hpp"
#include "fived/plan/plan.hpp"
#include "fived/train/data_parallel.hpp"
#include "fived/train/trainer.hpp"
#include "support/trainer_checks.hpp"

using namespace fived;
using plan::Bytes;

namespace {

constexpr std::int64_t GiB = std::int64_t{1} << 30;

// ---- parameter counts ------------------------------------------------------------------------

static_assert(plan::gpt2_124m.parameters() == 124'439'808);
static_assert(plan::gpt2_124m.parameters() == ParamTable<GptSpecs<gpt_config>>::num_parameters);

// A GPT's buffer, laid out by the planner, is ParamTable's: size and every unit boundary.
template <class Specs, class Lay>
constexpr bool same_units() {
  using T = Specs;
  if (T::size != Lay::size || T::units != Lay::units) return false;
  for (int u = 0; u <= T::units; ++u)
    if (T::unit_begin(u) != Lay::unit_begin(u)) return false;
  return true;
}
template <class Cfg, int TP, int EP, int First, int Count>
constexpr bool part_matches() {
  constexpr plan::Transformer m = plan::from_gpt<Cfg>();
  constexpr plan::Blocks part{First, Count, First == 0, First + Count == Cfg::layers};
  using Part = Layers<First, Count>;
  return same_units<ParamTable<GptSpecs<Cfg, Part>, TP>, plan::UnitLayout<m, TP, EP, part, false>>() &&
         same_units<ParamTable<ExpertSpecs<Cfg, Part>, TP, EP>, plan::UnitLayout<m, TP, EP, part, true>>();
}

struct moe_untied : gpt_config {
  static constexpr int layers = 4, d_model = 64, heads = 4, vocab = 100, max_seq = 32, vocab_multiple = 32;
  static constexpr bool tied = false;
  static constexpr int experts = 4, top_k = 2, moe_every = 2;
};
static_assert(part_matches<gpt_config, 1, 1, 0, 12>() && part_matches<gpt_config, 2, 1, 0, 12>() &&
              part_matches<gpt_config, 4, 1, 0, 12>());
static_assert(part_matches<moe_untied, 1, 1, 0, 4>() && part_matches<moe_untied, 2, 2, 0, 4>() &&
              part_matches<moe_untied, 2, 4, 0, 4>());
// pipeline parts: the first (embedding), a middle one, the last (ln_f and the untied head)
static_assert(part_matches<moe_untied, 2, 2, 0, 1>() && part_matches<moe_untied, 2, 2, 1, 2>() &&
              part_matches<moe_untied, 2, 2, 3, 1>());
// An expert's capacity, ceil(factor·N·k/E), the layer's and the planner's: in double whatever
// type the config spells the factor in (an int factor of 1 for 3 tokens over 4 experts: 1 row).
static_assert(plan::expert_capacity(1.25, 20, 2, 4) == 13 && plan::expert_capacity(1.25, 16, 2, 4) == 10);
static_assert(plan::expert_capacity(1, 3, 1, 4) == 1 && plan::expert_capacity(1.1f, 20, 1, 2) == 12);
static_assert(plan::from_gpt<moe_untied>().parameters() == ParamTable<GptSpecs<moe_untied>>::num_parameters +
                                                               ParamTable<ExpertSpecs<moe_untied>>::num_parameters);

// The cut of the blocks into pipeline parts: as even as possible, the ends lighter; or the
// layout's own, e.g. the trainer's StageLayers (balanced by FLOPs: a large head moves blocks
// off the last stage), and then every part's buffer is that GPT part's.
struct ten_layers : gpt_config {
  static constexpr int layers = 10, d_model = 64, heads = 4, vocab = 1000, max_seq = 32, vocab_multiple = 64;
  static constexpr bool tied = false;
};
struct four_parts : plan::layout {
  using mesh = Mesh<PP<4>>;
  using schedule = pipeline::OneFOneB<4, 4>;
  static constexpr int sequence = 32;
};
static_assert(plan::Setup<plan::from_gpt<ten_layers>(), four_parts>::bounds == std::array<int, 5>{0, 2, 5, 8, 10});
using cut = StageLayers<GPT<ten_layers>, 4>;
struct trainer_parts : four_parts {
  static constexpr auto bounds = cut::bounds;
};
using CutPlan = plan::Plan<plan::from_gpt<ten_layers>(), trainer_parts>;
static_assert(CutPlan::bounds == cut::bounds && cut::count(3) < cut::count(0));
static_assert(CutPlan::part_state[0].parameters == 4 * ParamTable<GptSpecs<ten_layers, cut::part<0>>>::size &&
              CutPlan::part_state[1].parameters == 4 * ParamTable<GptSpecs<ten_layers, cut::part<1>>>::size &&
              CutPlan::part_state[2].parameters == 4 * ParamTable<GptSpecs<ten_layers, cut::part<2>>>::size &&
              CutPlan::part_state[3].parameters == 4 * ParamTable<GptSpecs<ten_layers, cut::part<3>>>::size);

TEST_CASE("Llama-3-405B and DeepSeek-V3 have their papers' parameter counts") {
  // Llama 3 405B: per layer q [C, C], k and v [C, 8*128] each, o [C, C], SwiGLU 3 [C, 53248], two RMSNorms.
  constexpr std::int64_t C = 16384, layer = C * C + 2 * C * 1024 + C * C + 3 * C * 53248 + 2 * C;
  static_assert(layer == 3'187'703'808);
  constexpr std::int64_t llama = 126 * layer + 2 * 128256 * C + C;  // + embedding, untied head, final norm
  static_assert(plan::llama3_405b.parameters() == llama);
  CHECK(llama == 405'853'388'800);  // "405B"

  // DeepSeek-V3 described with multi-head attention (kv_heads = heads): 4 C^2 per layer.
  constexpr std::int64_t D = 7168, attention = 4 * D * D, expert = 3 * D * 2048, norms = 2 * D;
  constexpr std::int64_t dense = attention + 3 * D * 18432 + norms;
  constexpr std::int64_t moe = attention + 256 * expert + 1 * expert + D * 256 + norms;  // routed, shared, router
  constexpr std::int64_t outer = 2 * 129280 * D + D;
  static_assert(plan::deepseek_v3.parameters() == 3 * dense + 58 * moe + outer);
  static_assert(plan::deepseek_v3.active_parameters() == 3 * dense + 58 * (moe - 248 * expert) + outer);
  // Multi-head latent attention instead (DeepSeek-V3's config): q_a [7168, 1536] + norm, q_b
  // [1536, 128 x 192], kv_a [7168, 512 + 64] + norm [512], kv_b [512, 128 x (128 + 128)], o [128 x 128, 7168].
  constexpr std::int64_t mla = D * 1536 + 1536 + 1536 * 128 * 192 + D * 576 + 512 + 512 * 128 * 256 + 128 * 128 * D;
  static_assert(mla == 187'107'328);
  constexpr std::int64_t total = plan::deepseek_v3.parameters() - 61 * (attention - mla);
  constexpr std::int64_t active = plan::deepseek_v3.active_parameters() - 61 * (attention - mla);
  MESSAGE("DeepSeek-V3: " << plan::deepseek_v3.parameters() << " parameters as MHA, " << total << " with MLA (paper: 671B); "
                          << active << " active (paper: 37B)");
  CHECK(total >= 671'000'000'000);
  CHECK(total < 671'500'000'000);
  CHECK(active >= 37'000'000'000);
  CHECK(active < 38'000'000'000);
}

// ---- Llama-3-405B, by hand --------------------------------------------------------------------

using LlamaFull = plan::Plan<plan::llama3_405b, plan::llama3_405b_run<pipeline::OneFOneB<16, 16>, FullRecompute>>;
using LlamaSelective = plan::Plan<plan::llama3_405b, plan::llama3_405b_run<pipeline::OneFOneB<16, 16>, SelectiveRecompute>>;

// 80 GB: full recomputation fits; selective does not (see examples/plan.cpp for why).
static_assert(plan::fits<LlamaFull>(80ull << 30));
static_assert(plan::require_fits<LlamaFull, (80ull << 30)>);
static_assert(plan::fits<plan::llama3_405b, plan::llama3_405b_run<pipeline::OneFOneB<16, 16>, FullRecompute>>(80ull << 30));
static_assert(!plan::fits<LlamaSelective>(80ull << 30));

TEST_CASE("Llama-3-405B on Mesh<DP<128>, TP<8>, PP<16>>, bf16, SP, ZeRO-1, 1F1B, full recompute: every figure by hand") {
  using P = LlamaFull;
  // 126 layers on 16 stages: 7, 8 x 14, 7 (Llama 3's one layer fewer on the first and last).
  CHECK(P::part(0).count == 7);
  CHECK(P::part(1).count == 8);
  CHECK(P::part(1).first == 7);
  CHECK(P::part(15).count == 7);

  // One layer on one TP rank (elements): q|k|v [16384, (128 + 2 x 8) x 128 / 8], o [2048, 16384],
  // SwiGLU 3 x [16384, 53248 / 8], two RMSNorm weights [16384] (replicated).
  constexpr std::int64_t C = 16384, t = 2;
  constexpr std::int64_t layer = C * 2304 + 2048 * C + 3 * C * 6656 + 2 * C;
  static_assert(layer == 398'491'648);
  // Pipeline rank 1 (8 layers) needs the most memory.
  CHECK(P::fullest_rank == 1);
  const plan::Memory& m = P::memory;
  constexpr std::int64_t N = 8 * layer;  // 3,187,933,184 parameters on this GPU
  CHECK(m.parameters == Bytes(t * N));   // 5.94 GiB
  CHECK(m.gradients == Bytes(t * N));
  // ZeRO-1 over DP 128: buckets of 4 MiB = 2,097,152 elements; a layer is 190 of them + 32,768,
  // all multiples of 128 x 64, so nothing is padded and rank 0 owns exactly N / 128.
  static_assert(layer == 190 * 2'097'152 + 32'768 && 2'097'152 % (128 * 64) == 0 && 32'768 % (128 * 64) == 0);
  CHECK(m.optimizer == Bytes(12 * (N / 128)));                  // fp32 m, v and master
  CHECK(m.staging == Bytes(t * (2'097'152 + 2'097'152 / 128)));  // one padded bucket + one piece
  CHECK(m.transient == 0);

  // Activations (N = 8192 tokens, n = 8192 / 8 = 1024 rows of the stream per TP rank).
  constexpr std::int64_t Nt = 8192, n = 1024, F = 6656;
  // A slot under full recomputation: ids and targets, the embedding output, each block's output.
  CHECK(m.activations == Bytes(2 * Nt * 4 + n * C * t + 8 * n * C * t));
  CHECK(m.in_flight == 15);  // 1F1B: P - rank
  CHECK(m.peak_activations == 15 * m.activations);
  // The one block recomputation runs in: ln_1 and ln_2 out + rstd, the gathered input of q|k|v,
  // q|k|v [N, 2304] (16 query heads and the one key/value head they share, read in place by the
  // attention kernels), the core output + log-sum-exp [N, 16] fp32, res2 and res3, the FFN's
  // gathered input, gate, up and their product [N, F/8] each.
  constexpr std::int64_t block = 2 * (n * C * t + n * 4) + Nt * C * t + Nt * 2304 * t + Nt * 2048 * t + Nt * 16 * 4 +
                                 2 * n * C * t + Nt * C * t + 3 * Nt * F * t;
  static_assert(block == 1'070'080'000);
  CHECK(m.recompute == Bytes(block));
  // Work: d(stream) x3 [n, C], d(h), d(gate) and d(up) [N, F], d(q|k|v) [N, 2304], the 64 rotary
  // frequencies fp32, SP's [N, C], 16 RMSNorm gradient partials [C], and the executor's 2 boundary
  // buffers [n, C] per slot in flight.
  CHECK(m.work == Bytes(3 * n * C * t + 3 * Nt * F * t + Nt * 2304 * t + 64 * 4 + Nt * C * t + 16 * C * t +
                        2 * 15 * n * C * t));
  // 19.0 GiB: the description this test checked before the Llama model existed (18.9 GiB) had no
  // d(h) beside d(gate | up), 104 MiB here, nor the frequencies.
  CHECK(m.total() == Bytes(20'396'900'608));
  MESSAGE("Llama-3-405B, 1F1B, full recompute: " << double(m.total()) / GiB << " GiB on pipeline rank 1");

  // Selective keeps each block but its core attention (q|k|v stays): 1,036,001,280 bytes per block.
  const plan::Memory& s = LlamaSelective::memory;
  CHECK(s.activations == Bytes(2 * Nt * 4 + n * C * t + 8 * (block - Nt * 2048 * t - Nt * 16 * 4)));
  CHECK(s.recompute == Bytes(Nt * 2048 * t + Nt * 16 * 4));
  CHECK(s.total() > Bytes(120 * GiB));

  // Traffic of pipeline rank 1 in one step (16 micro-batches).
  const plan::Traffic& x = P::traffic_by_rank[1];
  // TP with SP: per block and micro-batch 2 all-gathers [n, C] and 2 reduce-scatters [N, C] in
  // forward, again in the recomputed forward, and in backward; one all-reduce of the two norms'
  // gradients; and the step's gradient norm summed over TP (8 bytes).
  CHECK(x.tp.all_gather == Tally{6 * 8 * 16, 6 * 8 * 16 * n * C * t});
  CHECK(x.tp.reduce_scatter == Tally{6 * 8 * 16, 6 * 8 * 16 * Nt * C * t});
  CHECK(x.tp.all_reduce == Tally{8 * 16 + 1, 8 * 16 * 2 * C * t + 8});
  // PP: 16 activations forward and 16 gradients back, [n, C] each.
  CHECK(x.pp.send_recv.bytes == 32 * n * C * t);
  // DP: 8 x 191 buckets, reduce-scattered whole and gathered in 128 pieces.
  CHECK(x.grad.reduce_scatter == Tally{8 * 191, t * N});
  CHECK(x.grad.all_gather == Tally{8 * 191, t * N / 128});
  CHECK(x.grad.all_reduce == Tally{2, 16});  // the norm's sum under ZeRO, the mean loss
  CHECK(x.pp.all_reduce == Tally{2, 16});    // the norm's sum and the loss over the stages
  CHECK(x.cp.total_calls() + x.ep.total_calls() + x.expert_data.total_calls() == 0);
}

TEST_CASE("the bubble and the micro-batches in flight are the schedule's (pipeline/simulate.hpp)") {
  const pipeline::Figures one = pipeline::measure(pipeline::one_f_one_b(16, 16));
  CHECK(LlamaFull::bubble == one.bubble());
  CHECK(LlamaFull::bubble == doctest::Approx(15.0 / 31));  // (P - 1) / (M + P - 1)
  for (int r = 0; r < 16; ++r) CHECK(LlamaFull::by_rank[static_cast<std::size_t>(r)].in_flight == one.peak_activations[static_cast<std::size_t>(r)]);
  using Interleaved = plan::Plan<plan::llama3_405b, plan::llama3_405b_run<pipeline::Interleaved1F1B<16, 16, 2>, FullRecompute>>;
  const pipeline::Figures two = pipeline::measure(pipeline::interleaved_1f1b(16, 16, 2));
  CHECK(Interleaved::bubble == two.bubble());
  CHECK(Interleaved::bubble == doctest::Approx(15.0 / 47));  // (P - 1) / (V M + P - 1)
  CHECK(Interleaved::memory.in_flight == two.peak_activations[static_cast<std::size_t>(Interleaved::fullest_rank)]);
  using Dual = plan::Plan<plan::llama3_405b, plan::llama3_405b_run<pipeline::DualPipeV<16, 32>, FullRecompute>>;
  const pipeline::Figures v = pipeline::measure(pipeline::dualpipe_v(16, 32));
  CHECK(Dual::bubble == v.bubble());
  CHECK(Dual::bubble == doctest::Approx(15.0 / (6 * 32 + 15)));  // ZB-V's (P - 1) / (6M + P - 1)
  // A split backward keeps a slot until W, and a tape for each micro-batch between I and W.
  CHECK(Dual::memory.in_flight == v.peak_pending[static_cast<std::size_t>(Dual::fullest_rank)]);
  CHECK(Dual::memory.awaiting_w == v.peak_deferred[static_cast<std::size_t>(Dual::fullest_rank)]);
  CHECK(Dual::memory.peak_deferred == Dual::memory.awaiting_w * Dual::memory.deferred);
  CHECK(LlamaFull::memory.awaiting_w == 0);  // 1F1B does not split
  using H1 = plan::Plan<plan::llama3_405b, plan::llama3_405b_run<pipeline::ZBH1<16, 32>, FullRecompute>>;
  const pipeline::Figures h = pipeline::measure(pipeline::zb_h1(16, 32));
  for (int r = 0; r < 16; ++r) {
    const plan::Memory& m = H1::by_rank[static_cast<std::size_t>(r)];
    CHECK(m.in_flight == 16);                                       // every rank holds P slots until W,
    CHECK(m.in_flight == h.peak_pending[static_cast<std::size_t>(r)]);
    CHECK(m.awaiting_w == r + 1);                                   // and r + 1 tapes
    CHECK(m.awaiting_w == h.peak_deferred[static_cast<std::size_t>(r)]);
  }
}

TEST_CASE("production pipelines are planned from tables proven at compile time: M = 64 and 120 at P = 16") {
  // Llama-3-405B interleaved over 64 micro-batches (a 4x larger batch per DP rank than the paper's).
  using Llama64 = plan::Plan<plan::llama3_405b, plan::llama3_405b_run<pipeline::Interleaved1F1B<16, 64, 2>, FullRecompute>>;
  const pipeline::Figures i64 = pipeline::measure(pipeline::interleaved_1f1b(16, 64, 2));
  CHECK(Llama64::bubble == i64.bubble());
  CHECK(Llama64::bubble == doctest::Approx(15.0 / (2 * 64 + 15)));  // (P - 1) / (V M + P - 1)
  CHECK(Llama64::memory.in_flight == i64.peak_activations[static_cast<std::size_t>(Llama64::fullest_rank)]);
  // DeepSeek-V3 on ZB-V with its 120 micro-batches: ZB-V's bubble, 2P chunk pairs in flight whatever M.
  using DeepSeek = plan::Plan<plan::deepseek_v3, plan::deepseek_v3_run<FullRecompute>>;
  static_assert(std::is_same_v<plan::deepseek_v3_run<FullRecompute>::schedule, pipeline::ZBV<16, 120>>);
  CHECK(DeepSeek::bubble == doctest::Approx(15.0 / (6 * 120 + 15)));  // (P - 1) / (6M + P - 1)
  CHECK(DeepSeek::memory.in_flight == 2 * 16);
  CHECK(DeepSeek::bubble == pipeline::measure(pipeline::zb_v(16, 120)).bubble());
}

// ---- activations against Megatron's count ----------------------------------------------------

TEST_CASE("a GPT-3-like layer against Korthikanti et al. 2022: 34sbh + 5as^2b less the dropout masks and the s^2 term") {
  // GPT-3 175B's shape: h = 12288, a = 96, s = 2048, b = 1, GELU MLP of 4h, LayerNorm, biases.
  constexpr plan::Transformer g{.layers = 96, .d_model = 12288, .heads = 96, .kv_heads = 96, .d_ff = 4 * 12288,
                                .vocab = 50257, .padded_vocab = 51200, .positions = 2048};
  constexpr std::int64_t s = 2048, b = 1, h = 12288, a = 96, t = 8;
  // Without parallelism, bf16: fived keeps ln_1 out 2sbh, q|k|v 6sbh, core output 2sbh, res2
  // 2sbh, ln_2 out 2sbh, pre and GELU output 8sbh each, res3 2sbh = 32sbh, plus fp32 statistics
  // (mean and rstd of both norms, the log-sum-exp per head). Megatron counts 34sbh + 5as^2b: its
  // two dropout masks (sbh each) and the attention matrix, which flash-style attention never keeps.
  constexpr plan::Rows one{s * b, s * b, 1, 1, 1, false, 2, 4, plan::Recompute::none};
  CHECK(plan::block_bytes(g, 0, one) == Bytes(32 * s * b * h + (2 * 2 + a) * s * b * 4));
  // TP 8 with SP and selective recomputation: Megatron 34sbh/t. fived drops the core output
  // (2sbh/t) and its log-sum-exp, keeps no masks, and keeps the gathered inputs of q|k|v and of
  // the MLP whole, [s b, h] each: 30sbh/t + 4sbh.
  constexpr plan::Rows sel{s * b, s * b / t, t, 1, 1, true, 2, 4, plan::Recompute::selective};
  CHECK(plan::block_bytes(g, 0, sel) == Bytes(30 * s * b * h / t + 4 * s * b * h + 2 * 2 * (s * b / t) * 4));
  // Full recomputation: the block's input, 2sbh (Megatron), split over TP by SP: 2sbh/t.
  constexpr plan::Rows full{s * b, s * b / t, t, 1, 1, true, 2, 4, plan::Recompute::full};
  CHECK(plan::block_bytes(g, 0, full) == Bytes(2 * s * b * h / t));
  MESSAGE("GPT-3 layer, TP 8 + SP + selective: fived " << double(plan::block_bytes(g, 0, sel)) / (1 << 20)
                                                       << " MiB, Megatron 34sbh/t = " << double(34 * s * b * h / t) / (1 << 20)
                                                       << " MiB");
}

// ---- the demo GPT against fived itself ----------------------------------------------------------

template <class R, bool Tied = false, class Context = RingContext, int Eod = -1>
struct demo_cfg : gpt_config {  // examples/train_gpt's (untied); tied, as GPT-2
  static constexpr int layers = 4, d_model = 128, heads = 4, vocab = 256, max_seq = 128;
  static constexpr int vocab_multiple = 64;
  static constexpr bool tied = Tied;
  static constexpr int end_of_document = Eod;
  using recompute = R;
  using context_attention = Context;
};
using DemoMesh = Mesh<DP<2>, TP<2>>;
constexpr int demo_B = 8, demo_T = 64;  // train_gpt's default batch: 4 rows per DP rank

template <int Zero, class R = NoRecompute, class M = DemoMesh>
struct demo_run : plan::layout {
  using mesh = M;
  using recompute = R;
  static constexpr bool sequence_parallel = true;
  static constexpr int zero = Zero, element_bytes = 4, micro_batch = demo_B / M::dp, sequence = demo_T;
};
template <int Zero, class R = NoRecompute, bool Tied = false, class M = DemoMesh, class Context = RingContext,
          int Eod = -1>
using DemoPlan = plan::Plan<plan::from_gpt<demo_cfg<R, Tied, Context, Eod>>(), demo_run<Zero, R, M>>;
template <class R, bool Tied = false, class M = DemoMesh, class Context = RingContext, int Eod = -1>
using DemoModel = GPT<demo_cfg<R, Tied, Context, Eod>, M, float, Host, SequenceParallel>;
static_assert(plan::fits<DemoPlan<1>>(std::uint64_t{16} << 20), "the demo needs under 16 MiB per rank");

void batch(std::vector<int>& tok, std::vector<int>& tgt) {
  std::mt19937 rng(3);
  tok.resize(demo_B * demo_T), tgt.resize(demo_B * demo_T);
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int>(rng() % 256), tgt[i] = static_cast<int>(rng() % 256);
}

template <class Policy, int Zero, bool Tied = false>
void check_data_parallel_memory() {
  using Model = DemoModel<NoRecompute, Tied>;
  using D = DataParallel<Model, Policy>;
  using P = DemoPlan<Zero, NoRecompute, Tied>;
  // The same buckets: BucketPlan over ParamTable's layout and over the planner's.
  using A = typename D::plan;
  using B = typename P::template dense_buckets<0>;
  CHECK(A::count == B::count);
  CHECK(A::shard_total == B::shard_total);
  CHECK(A::max_padded == B::max_padded);
  CHECK(A::owned_total(0) == B::owned_total(0));
  std::vector<int> tok, tgt;
  batch(tok, tgt);
  typename D::Memory got{};
  host::run(DemoMesh::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<DemoMesh>(world);
    Model model(ctx, GptInit{.seed = 1});
    D dp(model, ctx, AdamWConfig{});
    dp.step(tok, tgt, demo_B, demo_T);       // for ZeRO-3's units in use
    if (ctx.rank() == 0) got = dp.memory();  // DP rank 0 owns the most of every bucket
  });
  CAPTURE(Zero);
  CAPTURE(Tied);
  CHECK(P::memory.parameters == got.params);
  CHECK(P::memory.gradients == got.grads);
  CHECK(P::memory.optimizer == got.optimizer);
  CHECK(P::memory.staging == got.staging);
  CHECK(P::memory.transient == got.transient_peak);  // ZeRO-2/3: units held while the step runs
}

TEST_CASE("the demo's training state is DataParallel::memory(): NoZeRO, ZeRO-1, -2, -3, untied and tied") {
  check_data_parallel_memory<NoZeRO, 0>();
  check_data_parallel_memory<ZeRO<1>, 1>();
  check_data_parallel_memory<ZeRO<2>, 2>();
  check_data_parallel_memory<ZeRO<3>, 3>();
  check_data_parallel_memory<ZeRO<2>, 2, true>();
  check_data_parallel_memory<ZeRO<3>, 3, true>();
}

// The bytes a rank's model buffers hold after a forward and backward (one slot), over the four
// ranks of a mesh, against the plan: parameters, gradients, the slot, the recomputation and
// work buffers (on CP, the ring's or the all-gather's). The only buffer the plan leaves out is
// the selection bias of a mixture of experts (E floats per MoE block; one float in a dense
// model).
// Eod: packed documents ending at that token (each slot keeps the tokens' document starts).
template <class R, class M = DemoMesh, class Context = RingContext, int Eod = -1>
void check_buffers_held() {
  using P = DemoPlan<0, R, false, M, Context, Eod>;
  std::vector<int> tok, tgt;
  batch(tok, tgt);
  const std::size_t before = buffer_bytes_held<Host>();
  std::size_t held = 0;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    DemoModel<R, false, M, Context, Eod> model(ctx, GptInit{.seed = 1});
    const std::size_t rows = static_cast<std::size_t>(ctx.coord().dp) * (demo_B / M::dp) * demo_T;
    model.forward(tok.data() + rows, tgt.data() + rows, demo_B / M::dp, demo_T);
    model.backward();
    ctx.world().barrier();
    if (ctx.rank() == 0) held = buffer_bytes_held<Host>() - before;
    ctx.world().barrier();
  });
  const plan::Memory& m = P::memory;
  const Bytes planned = m.parameters + m.gradients + m.peak_activations + m.recompute + m.work;
  CAPTURE(R::name);
  CAPTURE(Context::name);
  CHECK(m.in_flight == 1);
  CHECK(held == M::size * (planned + sizeof(float)));
}

TEST_CASE("the demo's activation and work buffers are what the model allocates, for every recomputation, and with "
          "packed documents") {
  check_buffers_held<NoRecompute>();
  check_buffers_held<NoRecompute, DemoMesh, RingContext, 10>();
  check_buffers_held<SelectiveRecompute>();
  check_buffers_held<FullRecompute>();
}

TEST_CASE("on CP 2 x TP 2 the ring's and the all-gather's work buffers are what the model allocates") {
  using CP2 = Mesh<CP<2>, TP<2>>;
  check_buffers_held<NoRecompute, CP2, RingContext>();
  check_buffers_held<SelectiveRecompute, CP2, RingContext>();
  check_buffers_held<NoRecompute, CP2, AllGatherContext>();
  check_buffers_held<NoRecompute, CP2, RingContext, 10>();  // packed documents (newlines end them)
}

// A split backward's snapshots (nn/weight_grads.hpp): a micro-batch's backward_input and
// backward_weight leave the model one tape (kept for the next, its arena sized by this one),
// and the plan's deferred_bytes is its size.
template <class R>
void check_deferred_bytes() {
  using P = DemoPlan<0, R>;
  std::vector<int> tok, tgt;
  batch(tok, tgt);
  std::size_t tape = 0;
  host::run(DemoMesh::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<DemoMesh>(world);
    DemoModel<R> model(ctx, GptInit{.seed = 1});
    const std::size_t rows = static_cast<std::size_t>(ctx.coord().dp) * (demo_B / 2) * demo_T;
    auto forward = [&] { model.forward(tok.data() + rows, tgt.data() + rows, demo_B / 2, demo_T); };
    forward();
    ctx.world().barrier();
    const std::size_t before = buffer_bytes_held<Host>();
    ctx.world().barrier();
    model.backward_input(), model.backward_weight();
    ctx.world().barrier();
    if (ctx.rank() == 0) tape = buffer_bytes_held<Host>() - before;
    ctx.world().barrier();  // no rank frees its model before rank 0 has read
  });
  CAPTURE(R::name);
  CHECK(P::memory.deferred > 0);
  CHECK(tape == DemoMesh::size * P::memory.deferred);
}

TEST_CASE("a split backward's snapshots for W are the plan's deferred bytes, for every recomputation") {
  check_deferred_bytes<NoRecompute>();
  check_deferred_bytes<SelectiveRecompute>();
  check_deferred_bytes<FullRecompute>();
}

// The layout of a trainer's run, for the planner.
template <class M, class Policy, class Sched, class R, int B, int T, bool Tied = false>
struct trainer_run : plan::layout {
  using mesh = M;
  using schedule = Sched;
  using recompute = R;
  static constexpr bool sequence_parallel = M::tp > 1;
  static constexpr int zero = Policy::stage, element_bytes = 4, micro_batch = B / M::dp, sequence = T;
  // the trainer's cut of the blocks (FlopCost), which the plan then follows
  static constexpr auto bounds =
      StageLayers<GPT<demo_cfg<R, Tied>>, Sched::table.shape.ranks * Sched::table.shape.chunks>::bounds;
};

// One trainer step of the demo GPT on mesh M, every group's collectives counted on every rank,
// against the plan of the same run: calls and bytes, kind by kind, for TP, CP, PP and DP x CP
// (host values included). Dense: an expert all-to-all's bytes depend on the routing. Tied: the
// first and last stage swap their pieces of wte's gradient.
template <class M, class Policy, class Sched, class R = NoRecompute, bool Tied = false>
void check_step_traffic() {
  using SP = std::conditional_t<(M::tp > 1), SequenceParallel, NoSequenceParallel>;
  using Model = GPT<demo_cfg<R, Tied>, M, float, Host, SP>;
  constexpr int micro = Sched::table.micro_batches, B = 4, T = 32;
  using P = plan::Plan<plan::from_gpt<demo_cfg<R, Tied>>(), trainer_run<M, Policy, Sched, R, B, T, Tied>>;
  std::vector<int> tok(static_cast<std::size_t>(micro * B * T)), tgt(tok.size());
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int>(i * 7 % 256), tgt[i] = static_cast<int>(i * 13 % 256);
  const TrainerConfig hp{.adamw = {.max_norm = 1.0f}, .lr = WarmupCosine{.peak = 1e-3}};
  const test::StepTraffic got = test::step_traffic<Model, Policy, Sched>(hp, GptInit{.seed = 1}, tok, tgt, B, T);
  CAPTURE(M::name());
  test::check_traffic<P>(got);
  for (const plan::Traffic& x : got.by_rank) {
    CHECK(x.ep.total_calls() == 0);
    CHECK(x.tp.total_calls() + x.cp.total_calls() + x.pp.total_calls() + x.grad.total_calls() > 0);
  }
}

TEST_CASE("a trainer step's collectives are the plan's, group by group, on every rank of seven meshes (two tied)") {
  // TP with SP, 4 blocks (Megatron's counts, as tests/test_tp_gpt.cpp checks them): forward
  // RS 1 + 8, AG 8 + 1, AR 3 (the loss); backward RS 1 + 8, AG 8 + 1, AR 4 + 1 (LayerNorms).
  using P = DemoPlan<1>;
  CHECK(P::traffic.tp.reduce_scatter.calls == 18);
  CHECK(P::traffic.tp.all_gather.calls == 18);
  CHECK(P::traffic.tp.all_reduce.calls == 8 + 1);  // + the gradient norm's sum over TP
  check_step_traffic<Mesh<DP<2>, TP<2>>, ZeRO<1>, Accumulate<2>>();
  check_step_traffic<Mesh<PP<2>, DP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 4>>();
  check_step_traffic<Mesh<CP<2>, TP<2>>, NoZeRO, Accumulate<1>, SelectiveRecompute>();  // the ring twice forward
  check_step_traffic<Mesh<DP<2>, TP<2>>, ZeRO<3>, Accumulate<2>, FullRecompute>();     // blocks again in backward
  check_step_traffic<Mesh<DP<2>, PP<2>, CP<2>, TP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 4>>();
  // Tied wte: one more send_recv over PP on the first and last stage, of what this DP rank owns of it
  check_step_traffic<Mesh<PP<2>, DP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 4>, NoRecompute, true>();
  check_step_traffic<Mesh<PP<4>>, NoZeRO, pipeline::OneFOneB<4, 4>, NoRecompute, true>();  // stages 1, 2: none
  using Tied = plan::Plan<plan::from_gpt<demo_cfg<NoRecompute, true>>(),
                          trainer_run<Mesh<PP<2>, DP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 4>, NoRecompute, 4, 32, true>>;
  CHECK(Tied::tied_swap_elements(0) == 256 * 128 / 2);  // wte [256, 128], half of it per DP rank
  CHECK(Tied::tied_swap_elements(1) == Tied::tied_swap_elements(0));
}

}  // namespace
