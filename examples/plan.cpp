// The static planner's answers, before any step: bytes per GPU, communication per step and
// the pipeline bubble of compiled configurations, one column per variant (fived/plan/).
//
//   build/examples/plan                           every configuration
//   build/examples/plan --config llama3-405b      demo | gpt2 | llama3-405b | deepseek-v3
//   build/examples/plan --config demo --device-gib 24 --ranks
//
// Every figure is a constant computed by the compiler (plan::Plan<model, layout>); this
// program only prints them. Memory is that of the pipeline rank that needs most; traffic the
// largest of any pipeline rank, per group and kind of collective, in calls and the bytes this
// rank sends (as comm/counting.hpp counts them). GiB = 2^30 bytes.
//
// Against published figures (tests/test_plan.cpp checks the numbers):
//
// Llama-3-405B (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3): 126 layers on
// 16 pipeline stages with one layer fewer on the first and the last, TP 8, PP 16, DP 128 at
// 8K tokens, 16M-token batches (2048 sequences: 16 micro-batches of one sequence per DP rank).
//   parameters   405.85B here, the paper's "405B" (Hugging Face's checkpoint: 405,853,388,800).
//   state        a middle stage holds 8 layers, 3,187,933,184 parameters: 2 + 2 bytes each in
//                bf16 (5.94 GiB each) and 12/128 for ZeRO-1's fp32 moments and masters
//                (0.28 GiB): the Ultra-scale Playbook's 2Ψ + 2Ψ + 12Ψ/N_d, with no fp32
//                gradient copy (fived accumulates gradients in bf16).
//   activations  full recomputation keeps each layer's input, [s·b/t, h] in bf16 = 2·s·b·h/t
//                bytes: Korthikanti et al. 2022's 2·s·b·h per layer, sharded by SP (32 MiB).
//                Selective: Megatron keeps 34·s·b·h/t per GPT-style layer (544 MiB at this
//                shape); fived keeps 988 MiB per Llama layer (the selective column's slot
//                holds 8): SwiGLU's three hidden tensors of 3.25·h/t, and above all the
//                gathered inputs of q|k|v and of the FFN, [s·b, h] each = 4·s·b·h bytes not
//                divided by t, which Megatron gathers again in backward instead of keeping;
//                it keeps no dropout masks (no dropout) and no s² term (flash-style attention
//                keeps the log-sum-exp). For a GPT-3 175B layer at TP 8 with SP and selective
//                recomputation that is 186 MiB against Megatron's 102 MiB (the test prints
//                it). So on 80 GB, 1F1B (15-16 micro-batches in flight on the first ranks)
//                fits with full recomputation only; Megatron's own figure, 16 x 8 x 544 MiB
//                = 68 GiB of activations, would leave little room either.
// DeepSeek-V3 (DeepSeek-AI 2024): 671B parameters, 37B active; trained on PP 16 (DualPipe),
// EP 64 over 8 nodes, ZeRO-1 DP, no TP, 4K sequences.
//   parameters   672.15B total and 38.68B active here: the attention is described as
//                multi-head (kv_heads = heads), 18.4M parameters per layer more than its
//                multi-head latent attention, 1.12B over 61 layers, which is the whole
//                difference (671.03B and 37.55B with MLA's 187.1M per layer).
//   layout       Mesh<DP<128>, PP<16>, EP<64>> (2048 GPUs, EP carved out of DP: an
//                expert-data group of 2), ZB-V as the V-shaped schedule nearest DualPipe,
//                120 micro-batches (DeepSeek's 15360-sequence batch over DP 128), the table
//                proven at compile time like every other. ZB-V holds 2P chunk pairs
//                whatever M, so memory does not depend on it; the bubble is 15/735.
//   memory       the paper gives no per-GPU figures to compare with. Here: an MoE block keeps
//                N·k = 32768 rows of C twice (the experts' outputs and the rows received) and
//                the experts' hidden rows (3 x [32768, 2048]), with attention about 1.7 GiB
//                per block and micro-batch, so without
//                recomputation 32 chunk pairs in flight (2P) do not fit 80 GB; with full
//                recomputation they do. The fullest rank then holds the first and the last
//                chunk (V shape): its slot is the head's logits [4096, 129280], and the plan
//                counts the largest chunk's slot for all 32 pairs, an upper bound there.
//                DeepSeek itself recomputes RMSNorm and MLA's up-projections and stores some
//                activations in FP8, which this planner does not model.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <fived/mesh/mesh.hpp>
#include <fived/nn/config.hpp>
#include <fived/nn/llama.hpp>
#include <fived/nn/recompute.hpp>
#include <fived/pipeline/schedules.hpp>
#include <fived/plan/fits.hpp>
#include <fived/plan/models.hpp>
#include <fived/plan/plan.hpp>

using namespace fived;
namespace plan = fived::plan;

namespace {

// ---- the configurations ------------------------------------------------------------------

// examples/train_gpt's model and mesh: TP with SP, DP with ZeRO-1, fp32, its default batch
// of 32 sequences of 20 (16 per DP rank).
struct demo_config : gpt_config {
  static constexpr int layers = 2, d_model = 64, heads = 4, vocab = 256, max_seq = 128;
  static constexpr int vocab_multiple = 64;
  static constexpr bool tied = false;
};
template <class R>
struct demo_run : plan::layout {
  using mesh = Mesh<DP<2>, TP<2>>;
  using recompute = R;
  static constexpr bool sequence_parallel = true;
  static constexpr int zero = 1, element_bytes = 4, micro_batch = 16, sequence = 20;
};

// GPT-2 124M data-parallel on 8 GPUs, bf16, ZeRO-1, llm.c's micro-batch of 16 x 1024.
template <class R>
struct gpt2_run : plan::layout {
  using mesh = Mesh<DP<8>>;
  using recompute = R;
  static constexpr int zero = 1, element_bytes = 2, micro_batch = 16, sequence = 1024;
};

// ---- a plan's figures, as values to print -------------------------------------------------

struct Column {
  std::string title;
  plan::Memory memory;
  plan::Traffic traffic;
  double bubble = 0;
  int rank = 0, chunks = 1;
  std::vector<plan::Bytes> rank_totals;
};

template <class P>
Column column(std::string title) {
  Column c{std::move(title), P::memory, P::traffic, P::bubble, P::fullest_rank, P::V, {}};
  for (const plan::Memory& m : P::by_rank) c.rank_totals.push_back(m.total());
  return c;
}

struct Config {
  std::string name, model, layout;
  std::int64_t parameters = 0, active = 0;
  std::vector<Column> columns;
};

template <class L>
std::string describe_layout(const char* schedule) {
  using S = typename L::mesh;
  std::string s = S::name() + ", " + (L::element_bytes == 2 ? "bf16" : L::element_bytes == 4 ? "fp32" : "fp64");
  if (L::sequence_parallel && S::tp > 1) s += ", SP";
  s += L::zero == 0 ? ", no ZeRO" : ", ZeRO-" + std::to_string(L::zero);
  s += ", micro-batch " + std::to_string(L::micro_batch) + " x " + std::to_string(L::sequence);
  s += ", " + std::string(schedule);
  return s;
}

Config make(std::string_view name) {
  if (name == "demo") {
    constexpr plan::Transformer m = plan::from_gpt<demo_config>();
    return {"demo", "examples/train_gpt's GPT (4 layers, d_model 128, 4 heads, vocab 256, max_seq 128)",
            describe_layout<demo_run<NoRecompute>>("1 micro-batch"), m.parameters(), m.active_parameters(),
            {column<plan::Plan<m, demo_run<NoRecompute>>>("no recompute"),
             column<plan::Plan<m, demo_run<SelectiveRecompute>>>("selective"),
             column<plan::Plan<m, demo_run<FullRecompute>>>("full")}};
  }
  if (name == "gpt2") {
    constexpr plan::Transformer m = plan::gpt2_124m;
    return {"gpt2", "GPT-2 124M (fived's gpt_config)", describe_layout<gpt2_run<NoRecompute>>("1 micro-batch"),
            m.parameters(), m.active_parameters(),
            {column<plan::Plan<m, gpt2_run<NoRecompute>>>("no recompute"),
             column<plan::Plan<m, gpt2_run<SelectiveRecompute>>>("selective"),
             column<plan::Plan<m, gpt2_run<FullRecompute>>>("full")}};
  }
  if (name == "llama3-405b") {
    constexpr plan::Transformer m = plan::from_model<Llama<llama3_405b_config>>();  // the model type itself
    using one = pipeline::OneFOneB<16, 16>;
    using two = pipeline::Interleaved1F1B<16, 16, 2>;
    using two_of_64 = pipeline::Interleaved1F1B<16, 64, 2>;  // a 4x larger batch per DP rank
    return {"llama3-405b", "Llama-3-405B (126 layers, d_model 16384, 128 heads, 8 KV heads, SwiGLU 53248)",
            describe_layout<plan::llama3_405b_run<one, FullRecompute>>("16 micro-batches"), m.parameters(),
            m.active_parameters(),
            {column<plan::Plan<m, plan::llama3_405b_run<one, FullRecompute>>>("1F1B, full"),
             column<plan::Plan<m, plan::llama3_405b_run<one, SelectiveRecompute>>>("1F1B, selective"),
             column<plan::Plan<m, plan::llama3_405b_run<two, FullRecompute>>>("interleaved V2, full"),
             column<plan::Plan<m, plan::llama3_405b_run<two, SelectiveRecompute>>>("interleaved V2, sel."),
             column<plan::Plan<m, plan::llama3_405b_run<two_of_64, FullRecompute>>>("V2, M 64, full")}};
  }
  if (name == "deepseek-v3") {
    constexpr plan::Transformer m = plan::deepseek_v3;
    return {"deepseek-v3", "DeepSeek-V3-like MoE (61 layers, 3 dense, 256 experts top-8 + 1 shared, MLA as MHA)",
            describe_layout<plan::deepseek_v3_run<NoRecompute>>("ZB-V, 120 micro-batches"), m.parameters(),
            m.active_parameters(),
            {column<plan::Plan<m, plan::deepseek_v3_run<NoRecompute>>>("ZB-V, no recompute"),
             column<plan::Plan<m, plan::deepseek_v3_run<SelectiveRecompute>>>("ZB-V, selective"),
             column<plan::Plan<m, plan::deepseek_v3_run<FullRecompute>>>("ZB-V, full")}};
  }
  return {};
}

// ---- printing -----------------------------------------------------------------------------

std::string bytes(plan::Bytes b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char s[32];
  std::snprintf(s, sizeof s, u == 0 ? "%.0f %s" : "%.2f %s", v, unit[u]);
  return s;
}

constexpr int label_width = 30, cell_width = 22;

template <class F>
void row(const Config& c, const char* label, F&& cell) {
  std::printf("  %-*s", label_width, label);
  for (const Column& col : c.columns) std::printf("%*s", cell_width, cell(col).c_str());
  std::printf("\n");
}

// 405853388800 -> "405,853,388,800"
std::string grouped(std::int64_t v) {
  std::string d = std::to_string(v), s;
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (i > 0 && (d.size() - i) % 3 == 0) s += ',';
    s += d[i];
  }
  return s;
}

void print(const Config& c, double device_gib, bool ranks) {
  std::printf("%s: %s\n  %s parameters", c.name.c_str(), c.model.c_str(), grouped(c.parameters).c_str());
  if (c.active != c.parameters) std::printf(", %s active per token", grouped(c.active).c_str());
  std::printf("; %s\n\n", c.layout.c_str());
  row(c, "", [](const Column& k) { return k.title; });
  std::printf("  memory per GPU (fullest pipeline rank)\n");
  row(c, "  pipeline rank", [](const Column& k) { return std::to_string(k.rank); });
  row(c, "  parameters", [](const Column& k) { return bytes(k.memory.parameters); });
  row(c, "  gradients", [](const Column& k) { return bytes(k.memory.gradients); });
  row(c, "  optimizer state", [](const Column& k) { return bytes(k.memory.optimizer); });
  row(c, "  ZeRO staging", [](const Column& k) { return bytes(k.memory.staging); });
  bool transient = false;
  for (const Column& k : c.columns) transient = transient || k.memory.transient > 0;
  if (transient) row(c, "  ZeRO-2/3 units in use", [](const Column& k) { return bytes(k.memory.transient); });
  row(c, "  activations per micro-batch", [](const Column& k) { return bytes(k.memory.activations); });
  row(c, "  micro-batches in flight", [](const Column& k) {
    return std::to_string(k.memory.in_flight) + (k.chunks > 1 ? " chunk pairs" : "");
  });
  row(c, "  peak activations", [](const Column& k) { return bytes(k.memory.peak_activations); });
  row(c, "  recompute buffers", [](const Column& k) { return bytes(k.memory.recompute); });
  row(c, "  work buffers", [](const Column& k) { return bytes(k.memory.work); });
  row(c, "  total", [](const Column& k) { return bytes(k.memory.total()); });
  const std::string fits = "  fits " + std::to_string(static_cast<int>(device_gib)) + " GiB";
  row(c, fits.c_str(), [&](const Column& k) {
    return std::string(static_cast<double>(k.memory.total()) <= device_gib * 1073741824.0 ? "yes" : "no");
  });
  if (ranks) {
    std::printf("  total per pipeline rank\n");
    for (std::size_t r = 0; r < c.columns.front().rank_totals.size(); ++r) {
      const std::string label = "  rank " + std::to_string(r);
      row(c, label.c_str(), [&](const Column& k) { return bytes(k.rank_totals[r]); });
    }
  }

  std::printf("  communication per step (calls, bytes sent; busiest pipeline rank)\n");
  struct Group {
    const char* name;
    CommCounts plan::Traffic::*member;
  };
  const Group groups[] = {{"TP", &plan::Traffic::tp},   {"CP", &plan::Traffic::cp},
                          {"EP", &plan::Traffic::ep},   {"PP", &plan::Traffic::pp},
                          {"DPxCP", &plan::Traffic::grad}, {"expert DP", &plan::Traffic::expert_data}};
  struct Kind {
    const char* name;
    Tally CommCounts::*member;
  };
  const Kind kinds[] = {{"all-reduce", &CommCounts::all_reduce},     {"reduce-scatter", &CommCounts::reduce_scatter},
                        {"all-gather", &CommCounts::all_gather},     {"all-to-all", &CommCounts::all_to_all},
                        {"all-to-all-v", &CommCounts::all_to_all_v}, {"send/recv", &CommCounts::send_recv}};
  bool any = false;
  for (const Group& g : groups)
    for (const Kind& k : kinds) {
      bool used = false;
      for (const Column& col : c.columns) used = used || (col.traffic.*g.member.*k.member).calls > 0;
      if (!used) continue;
      any = true;
      const std::string label = "  " + std::string(g.name) + " " + k.name;
      row(c, label.c_str(), [&](const Column& col) {
        const Tally& t = col.traffic.*g.member.*k.member;
        return std::to_string(t.calls) + " / " + bytes(static_cast<plan::Bytes>(t.bytes));
      });
    }
  if (!any) std::printf("    none\n");
  row(c, "bubble (F = 1, B = 2)", [](const Column& k) {
    char s[16];
    std::snprintf(s, sizeof s, "%.1f%%", 100 * k.bubble);
    return std::string(s);
  });
  std::printf("\n");
}

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "%s\nusage: plan [--config demo|gpt2|llama3-405b|deepseek-v3|all] [--device-gib G (80)] [--ranks]\n",
               msg.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string which = "all";
  double device_gib = 80;
  bool ranks = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage("error: " + std::string(a) + " needs a value");
      return argv[++i];
    };
    if (a == "--config") which = value();
    else if (a == "--device-gib") {
      const std::string v = value();
      char* end = nullptr;
      device_gib = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !(device_gib > 0)) usage("error: --device-gib takes a positive number");
    } else if (a == "--ranks") ranks = true;
    else if (a == "--help" || a == "-h") usage("the static planner: bytes per GPU, traffic per step and bubble");
    else usage("error: unknown option " + std::string(a));
  }
  const std::vector<std::string> names =
      which == "all" ? std::vector<std::string>{"demo", "gpt2", "llama3-405b", "deepseek-v3"}
                     : std::vector<std::string>{which};
  for (const std::string& n : names) {
    const Config c = make(n);
    if (c.columns.empty()) usage("error: no configuration named '" + n + "'");
    print(c, device_gib, ranks);
  }
}
