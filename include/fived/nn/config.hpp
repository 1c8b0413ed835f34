#pragma once
// GPT model configuration: a struct of static constants.
//
//   struct tiny : fived::gpt_config {           // GPT-2 124M defaults, override by hiding
//     static constexpr int layers = 2, d_model = 64, heads = 4, vocab = 256, max_seq = 64;
//   };
//
// A configuration is read through `gpt_dims<Cfg>`, which checks it (static_assert with a
// sentence) and derives the sizes the model needs (head size, padded vocabulary, ...).
// Nothing in a configuration is a run-time value: every parameter offset follows from it
// at compile time (nn/param_table.hpp).

#include <type_traits>

#include "fived/nn/recompute.hpp"

namespace fived {

// How a mixture of experts keeps its experts' loads even (besides the auxiliary loss, whose
// coefficient is aux_loss_coef): with AuxLossFreeBias each MoE layer keeps a bias per expert,
// added to the scores for the top-k selection only (not to the gates), and moved after every
// step by bias_update_rate * sign(mean load - load), the loads summed over every rank that
// routes tokens (DeepSeek-V3's auxiliary-loss-free balancing).
struct NoRouterBias {
  static constexpr bool bias = false;
};
struct AuxLossFreeBias {
  static constexpr bool bias = true;
};

// How attention runs under context parallelism (CP > 1; each rank holds two zig-zag chunks
// of every sequence): RingContext passes the keys and values round the CP ring
// (nn/ring_attention.hpp); AllGatherContext gathers them all at once and reduce-scatters
// their gradients (nn/allgather_attention.hpp: Llama 3's long-context choice).
struct RingContext {
  static constexpr const char* name = "ring";
};
struct AllGatherContext {
  static constexpr const char* name = "all-gather";
};

// GPT-2 124M ("gpt2" on Hugging Face). Derive and hide the members to change them.
struct gpt_config {
  // What backward recomputes instead of keeping (nn/recompute.hpp): NoRecompute,
  // SelectiveRecompute (attention's core) or FullRecompute (each block).
  using recompute = NoRecompute;
  using context_attention = RingContext;  // or AllGatherContext (context parallelism only)

  static constexpr int layers = 12;      // transformer blocks
  static constexpr int d_model = 768;    // C: width of the residual stream
  static constexpr int heads = 12;       // attention heads; head size = d_model / heads
  static constexpr int vocab = 50257;    // V: real vocabulary (token ids are in [0, V))
  static constexpr int max_seq = 1024;   // rows of the position embedding
  static constexpr bool tied = true;     // lm_head shares wte (GPT-2); false adds lm_head.weight
  static constexpr int mlp_ratio = 4;    // MLP hidden width = mlp_ratio * d_model
  // The embedding and the logits use a vocabulary padded up to a multiple of this (GPU
  // friendly GEMM shapes; a multiple of TP for the vocab-parallel loss later). Padded rows
  // are zero, get zero gradient and never count in the loss. 1 turns padding off.
  static constexpr int vocab_multiple = 128;
  // Documents packed into a row (context/documents.hpp): the token id that ends a document
  // (GPT-2's <|endoftext|> is 50256), after which attention starts afresh, block-causal as
  // Megatron's reset_attention_mask; -1: every row is one sequence (plain causal attention).
  static constexpr int end_of_document = -1;

  // Mixture of experts (nn/moe.hpp): experts > 0 replaces the MLP of every moe_every-th block
  // (blocks moe_every-1, 2*moe_every-1, ...) by `experts` MLPs of the same width, each token
  // sent to top_k of them by a linear router. 0 experts: a dense model.
  static constexpr int experts = 0;
  static constexpr int top_k = 2;
  static constexpr int moe_every = 1;
  static constexpr bool router_sigmoid = false;    // scores: softmax over the experts, or sigmoid
  static constexpr bool renormalize_gates = true;  // gates = the chosen scores / their sum
  static constexpr double aux_loss_coef = 0.01;    // Switch load-balancing loss; 0 turns it off
  using balancing = NoRouterBias;                  // or AuxLossFreeBias
  static constexpr double bias_update_rate = 1e-3;
  static constexpr double capacity_factor = 0;     // 0: dropless; else each expert takes at most
                                                   // ceil(factor * tokens * top_k / experts) of a rank's
                                                   // assignments, the rest are dropped
  // With a capacity: every expert's rows padded to it (empty slots are zero rows), so every
  // size after routing is static and the step waits for no count (GShard's layout; Megatron's
  // moe_pad_expert_input_to_capacity). Costs the padding's FLOPs and traffic.
  static constexpr bool pad_to_capacity = false;
};

// Everything the model derives from a configuration, checked once here.
template <class Cfg>
struct gpt_dims {
  static constexpr int layers = Cfg::layers;
  static constexpr int d_model = Cfg::d_model;
  static constexpr int heads = Cfg::heads;
  static constexpr int vocab = Cfg::vocab;
  static constexpr int max_seq = Cfg::max_seq;
  static constexpr bool tied = Cfg::tied;
  static constexpr int mlp_ratio = Cfg::mlp_ratio;
  static constexpr int vocab_multiple = Cfg::vocab_multiple;
  static constexpr int end_of_document = Cfg::end_of_document;
  static constexpr bool documents = end_of_document >= 0;  // whether rows hold packed documents
  using recompute = typename Cfg::recompute;

  using context_attention = typename Cfg::context_attention;
  static_assert(std::is_same_v<context_attention, RingContext> || std::is_same_v<context_attention, AllGatherContext>,
                "gpt config: context_attention must be fived::RingContext or fived::AllGatherContext");
  static_assert(RecomputePolicy<recompute>,
                "gpt config: recompute must be fived::NoRecompute, SelectiveRecompute or FullRecompute");
  static_assert(layers >= 1, "gpt config: layers must be at least 1");
  static_assert(d_model >= 1, "gpt config: d_model must be at least 1");
  static_assert(heads >= 1, "gpt config: heads must be at least 1");
  static_assert(d_model % heads == 0, "gpt config: heads must divide d_model (every head gets d_model / heads columns)");
  static_assert(vocab >= 2, "gpt config: vocab must be at least 2");
  static_assert(max_seq >= 1, "gpt config: max_seq must be at least 1");
  static_assert(mlp_ratio >= 1, "gpt config: mlp_ratio must be at least 1");
  static_assert(vocab_multiple >= 1, "gpt config: vocab_multiple must be at least 1 (1 means no padding)");
  static_assert(end_of_document >= -1 && end_of_document < vocab,
                "gpt config: end_of_document must be a token id in [0, vocab) (the token that ends a packed "
                "document) or -1 (every row one sequence)");

  static constexpr int experts = Cfg::experts;
  static constexpr int top_k = Cfg::top_k;
  static constexpr int moe_every = Cfg::moe_every;
  static_assert(experts >= 0, "gpt config: experts must be 0 (dense) or more");
  static_assert(experts == 0 || (top_k >= 1 && top_k <= experts),
                "gpt config: top_k must be between 1 and the number of experts");
  static_assert(moe_every >= 1, "gpt config: moe_every must be at least 1 (1: every block has experts)");
  static_assert(Cfg::aux_loss_coef >= 0 && Cfg::capacity_factor >= 0 && Cfg::bias_update_rate >= 0,
                "gpt config: aux_loss_coef, capacity_factor and bias_update_rate cannot be negative");
  static_assert(!Cfg::pad_to_capacity || Cfg::capacity_factor > 0,
                "gpt config: pad_to_capacity pads every expert's rows to its capacity: set capacity_factor > 0 "
                "(e.g. 1.25), or pad_to_capacity = false for dropless routing");
  // Whether block `layer` has a mixture of experts instead of the MLP.
  static constexpr bool is_moe(int layer) { return experts > 0 && layer % moe_every == moe_every - 1; }
  // Whether blocks [first, first + count) include one with experts (moe) or one with the MLP.
  static constexpr bool any_block(int first, int count, bool moe) {
    for (int l = first; l < first + count; ++l)
      if (is_moe(l) == moe) return true;
    return false;
  }

  static constexpr int head_size = d_model / heads;
  static constexpr int d_ff = mlp_ratio * d_model;  // MLP hidden width
  // The vocabulary rounded up to a multiple of vocab_multiple (50257 -> 50304 for GPT-2).
  static constexpr int padded_vocab = (vocab + vocab_multiple - 1) / vocab_multiple * vocab_multiple;

  // Parameter counts must fit the offsets' type comfortably; guard the int products used
  // by the kernels (rows * columns of one tensor).
  static_assert(static_cast<long long>(padded_vocab) * d_model < (1LL << 31),
                "gpt config: padded_vocab * d_model must fit in a 32-bit int (kernel sizes are int)");
  static_assert(static_cast<long long>(d_model) * d_ff < (1LL << 31),
                "gpt config: d_model * mlp_ratio * d_model must fit in a 32-bit int (kernel sizes are int)");
};

// The padded vocabulary of a configuration (see gpt_config::vocab_multiple).
template <class Cfg>
inline constexpr int padded_vocab = gpt_dims<Cfg>::padded_vocab;

static_assert(padded_vocab<gpt_config> == 50304);

}  // namespace fived
