#pragma once
// Part of the model contract (model/contract.hpp): a model describes itself to the planner
// with `static constexpr plan::Transformer plan_shape()`; this is that description.
//
// plan::Transformer: what the planner (plan/plan.hpp) needs to know about a decoder-only
// transformer, as one constexpr aggregate, so that models fived does not build (Llama's GQA
// and SwiGLU, DeepSeek's shared experts) can be planned next to the ones it does.
//
//   constexpr fived::plan::Transformer gpt2 = fived::plan::from_gpt<fived::gpt_config>();  // nn/gpt_shape.hpp
//   static_assert(gpt2.parameters() == 124'439'808);          // what Hugging Face counts
//
// A block is pre-norm attention then an FFN (or a mixture of experts), or the two side by
// side from one norm (parallel_blocks: GPT-J, PaLM); the model is the
// token embedding (+ learned positions), the blocks, a final norm and the output head (tied
// to the embedding, or its own matrix). Counts come in two kinds:
//   parameters()            the whole model as Hugging Face counts it (the real vocabulary)
//   *_elements(tp, ep)      what one rank's flat buffer holds of a part: the padded
//                           vocabulary, matrices split over TP, whole experts over EP, exactly
//                           as nn/param_table.hpp lays them out for fived's GPT
// Being a structural type, a Transformer is a template argument: Plan<llama3_405b, layout>.

#include <cstdint>

namespace fived::plan {

enum class Norm : std::uint8_t {
  layer_norm,  // weight and bias [C], mean and rstd per row (GPT-2)
  rms_norm,    // weight [C], rstd per row (Llama, DeepSeek)
};

// A routed expert's capacity for N tokens of a rank: ceil(factor·N·k/E) rows, computed in
// double whatever type a config spells the factor in. The one formula of the layer
// (nn/moe.hpp) and of the planner.
constexpr std::int64_t expert_capacity(double factor, std::int64_t N, int k, int E) {
  const double x = factor * static_cast<double>(N) * k / E;
  const auto whole = static_cast<std::int64_t>(x);
  return whole + (static_cast<double>(whole) < x ? 1 : 0);  // ceil (x >= 0)
}

struct Transformer {
  int layers = 12;
  int d_model = 768;         // C
  int heads = 12;            // query heads; head size C / heads
  int kv_heads = 12;         // key/value heads: = heads for MHA, fewer for GQA
  int d_ff = 3072;           // F: the dense FFN's hidden width
  bool gated = false;        // SwiGLU (gate, up, down: 3 matrices) rather than GELU (2)
  int vocab = 50257;         // the real vocabulary (what files and parameter counts hold)
  int padded_vocab = 50304;  // rows of the embedding and the head in the buffers
  bool tied = true;          // the head reads the embedding's matrix
  bool biases = true;        // linear layers have biases (GPT-2 yes, Llama no)
  Norm norm = Norm::layer_norm;
  int positions = 1024;  // rows of a learned position embedding (GPT-2's wpe); 0 for RoPE
  // x + attn(norm(x)) + ffn(norm(x)): one norm a block, no stream kept between attention and
  // the FFN (examples/parallel_blocks.hpp); otherwise pre-norm, one after the other.
  bool parallel_blocks = false;
  // Under context parallelism: keys and values round the CP ring, or all-gathered at once
  // (nn/allgather_attention.hpp).
  bool allgather_context = false;
  // Packed documents (context/documents.hpp): each slot keeps every token's document start.
  bool documents = false;

  // Mixture of experts: block l has one when experts > 0, l >= dense_first and
  // (l - dense_first) % moe_every == moe_every - 1 (fived: every moe_every-th block;
  // DeepSeek-V3: all but the first three). Its router is [C, E] without bias; each of the E
  // routed experts and of the shared ones is an FFN of width expert_d_ff (gated like the
  // dense one). Shared experts see every token: they live with the dense tensors (split over
  // TP like the dense FFN); the routed ones in the expert buffer (whole experts over EP).
  int experts = 0, top_k = 0, moe_every = 1, dense_first = 0, expert_d_ff = 0, shared_experts = 0;
  bool balancing_loss = false;  // the Switch loss: its statistics are all-reduced over CP
  // Each routed expert takes at most ceil(capacity_factor·N·top_k/E) of a rank's N tokens' rows
  // (0: dropless). Padded to that capacity (pad_to_capacity), every expert's rows are exactly
  // that many whatever the routing, so the plan of its activations and exchanges is exact.
  // With a capacity and no padding the experts' buffers are made for the most rows that can
  // arrive (expert_rows), so their plan is exact too; the exchanges are planned for N·top_k
  // rows, balanced. Dropless, both assume N·top_k rows, balanced over the experts.
  double capacity_factor = 0;
  bool pad_to_capacity = false;

  constexpr int head_dim() const { return d_model / heads; }
  // Rows in an MoE block's dispatch order (and at its experts, over EP) for N tokens of a rank:
  // N·top_k, or E·capacity when padded.
  constexpr std::int64_t dispatch_rows(std::int64_t N) const {
    return pad_to_capacity ? std::int64_t{experts} * expert_capacity(capacity_factor, N, top_k, experts) : N * top_k;
  }
  // Rows at one rank's experts, what their inputs' and activations' buffers hold, for N tokens
  // on each of the ep ranks that send to them: with a capacity the most that can arrive (each
  // rank sends each expert at most capacity rows, and no more than its N·top_k), padded
  // exactly E·capacity; dropless N·top_k, balanced (those buffers grow when more arrive).
  constexpr std::int64_t expert_rows(std::int64_t N, int ep) const {
    if (capacity_factor <= 0) return N * top_k;
    const std::int64_t most = std::int64_t{experts} * expert_capacity(capacity_factor, N, top_k, experts);
    return pad_to_capacity || most < ep * N * top_k ? most : ep * N * top_k;
  }
  constexpr bool is_moe(int layer) const {
    return experts > 0 && layer >= dense_first && (layer - dense_first) % moe_every == moe_every - 1;
  }
  constexpr int moe_layers() const {
    int n = 0;
    for (int l = 0; l < layers; ++l) n += is_moe(l) ? 1 : 0;
    return n;
  }
  // Columns of the fused q|k|v projection (whole model): heads queries, kv_heads keys and values.
  constexpr std::int64_t qkv_width() const { return std::int64_t{heads + 2 * kv_heads} * head_dim(); }
  // Key/value heads on one TP rank: kv_heads / TP, or with TP above them one, kept by TP /
  // kv_heads ranks (nn/rotary_attention.hpp); and that rank's columns of q|k|v.
  constexpr int local_kv_heads(int tp) const { return kv_heads >= tp ? kv_heads / tp : 1; }
  constexpr std::int64_t local_qkv_width(int tp) const {
    return attention_width() / tp + std::int64_t{2} * local_kv_heads(tp) * head_dim();
  }
  constexpr std::int64_t attention_width() const { return std::int64_t{heads} * head_dim(); }  // core output
  constexpr int norm_vectors() const { return norm == Norm::layer_norm ? 2 : 1; }
  constexpr int block_norms() const { return parallel_blocks ? 1 : 2; }
  constexpr int ffn_matrices() const { return gated ? 3 : 2; }

  // ---- one rank's buffer elements (the layout of nn/param_table.hpp) ---------------------

  constexpr std::int64_t norm_elements() const { return std::int64_t{norm_vectors()} * d_model; }
  // q|k|v [C, qkv/TP] and its bias (columns over TP), the output projection
  // [heads·head_dim/TP, C] (rows over TP) and its bias [C] (replicated).
  constexpr std::int64_t attention_elements(int tp) const {
    const std::int64_t C = d_model, qkv = local_qkv_width(tp), out = attention_width() / tp;
    return C * qkv + out * C + (biases ? qkv + C : 0);
  }
  // An FFN of width F: c_fc (gate and up when gated) columns over TP, c_proj rows over TP.
  constexpr std::int64_t ffn_elements(int width, int tp) const {
    const std::int64_t C = d_model, f = width / tp;
    return ffn_matrices() * C * f + (biases ? (ffn_matrices() - 1) * f + C : 0);
  }
  constexpr std::int64_t router_elements() const { return std::int64_t{d_model} * experts; }
  // Block l's tensors in the dense buffer: its norms, attention, the FFN or the router and
  // the shared experts.
  constexpr std::int64_t block_elements(int layer, int tp) const {
    return block_norms() * norm_elements() + attention_elements(tp) +
           (is_moe(layer) ? router_elements() + shared_experts * ffn_elements(expert_d_ff, tp) : ffn_elements(d_ff, tp));
  }
  // Block l's routed experts on one rank: E/EP whole experts, each split over TP.
  constexpr std::int64_t block_expert_elements(int layer, int tp, int ep) const {
    return is_moe(layer) ? std::int64_t{experts / ep} * ffn_elements(expert_d_ff, tp) : 0;
  }
  // wte [Vp/TP, C] and wpe [positions, C] (replicated).
  constexpr std::int64_t embedding_elements(int tp) const {
    return std::int64_t{padded_vocab / tp} * d_model + std::int64_t{positions} * d_model;
  }
  // The final norm and an untied head [Vp/TP, C]; a tied head on a part without the
  // embedding (the last pipeline stage) holds its own copy of wte, of the same size.
  constexpr std::int64_t final_elements(int tp, bool with_embedding = true) const {
    return norm_elements() + (tied && with_embedding ? 0 : std::int64_t{padded_vocab / tp} * d_model);
  }

  // ---- the whole model, as Hugging Face counts it ------------------------------------------

  constexpr std::int64_t parameters() const { return count(experts); }
  // What one token runs through: top_k routed experts instead of all of them.
  constexpr std::int64_t active_parameters() const { return count(top_k); }

 private:
  constexpr std::int64_t count(int routed) const {
    const std::int64_t C = d_model, V = vocab;
    std::int64_t n = V * C + std::int64_t{positions} * C + norm_elements() + (tied ? 0 : V * C);
    for (int l = 0; l < layers; ++l)
      n += block_elements(l, 1) + (is_moe(l) ? std::int64_t{routed} * ffn_elements(expert_d_ff, 1) : 0);
    return n;
  }
};

// A contiguous part of the model (a pipeline stage or model chunk): blocks [first, first +
// count), with the embedding when it starts the model and the final norm + head when it ends it.
struct Blocks {
  int first = 0, count = 0;
  bool embedding = true, head = true;
};

// Any model type that describes itself to the planner (the model contract's optional
// `static constexpr plan::Transformer plan_shape()`, docs/model.md): fived's GPT, or a model
// written outside fived (examples/parallel_blocks.hpp).
template <class Model>
constexpr Transformer from_model() {
  static_assert(requires { Model::plan_shape(); },
                "plan::from_model<Model>: the model type declares no `static constexpr plan::Transformer "
                "plan_shape()` (its architecture's, docs/model.md), so the planner cannot read it");
  return Model::plan_shape();
}

}  // namespace fived::plan
