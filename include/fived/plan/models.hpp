#pragma once
// Published model configurations as plan::Transformer values, for planning runs of them
// (examples/plan.cpp, tests/test_plan.cpp). Their parameter counts against the papers:
//
//   gpt2_124m     fived's gpt_config: 124,439,808, what Hugging Face counts for "gpt2"
//   llama3_405b   405,853,388,800: Llama 3's "405B" (Dubey et al. 2024, Table 3: 126 layers,
//                 d_model 16384, FFN 53248, 128 heads, 8 KV heads, vocabulary 128K; the
//                 Hugging Face checkpoint's vocabulary is 128,256)
//   deepseek_v3   672,149,632,000 total, 38.6B active per token, against the paper's 671B and
//                 37B (DeepSeek-AI 2024, without the multi-token-prediction module). The
//                 difference is the attention: DeepSeek-V3 uses multi-head latent attention
//                 (low-rank q and k|v projections, 187.1M parameters per layer), which this
//                 description approximates by multi-head attention with kv_heads = heads
//                 (4·C² = 205.5M per layer): +18.4M per layer, +1.12B over 61 layers, which
//                 is the whole gap. Its activations are approximated the same way (q, k, v
//                 of 56 channels per head instead of MLA's 192/192/128).

#include "fived/mesh/mesh.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/recompute.hpp"
#include "fived/pipeline/schedules.hpp"
#include "fived/plan/layout.hpp"
#include "fived/plan/model.hpp"

namespace fived::plan {

inline constexpr Transformer gpt2_124m = from_gpt<gpt_config>();

inline constexpr Transformer llama3_405b{.layers = 126,
                                         .d_model = 16384,
                                         .heads = 128,
                                         .kv_heads = 8,
                                         .d_ff = 53248,
                                         .gated = true,
                                         .vocab = 128256,
                                         .padded_vocab = 128256,
                                         .tied = false,
                                         .biases = false,
                                         .norm = Norm::rms_norm,
                                         .positions = 0};

// Llama 3's 8K pre-training layout (Dubey et al. 2024: TP 8, PP 16, DP 128 on 16K GPUs, bf16,
// a micro-batch of one 8192-token sequence); the schedule and the recomputation are the caller's.
template <class Schedule, class R>
struct llama3_405b_run : layout {
  using mesh = Mesh<DP<128>, TP<8>, PP<16>>;
  using schedule = Schedule;
  using recompute = R;
  static constexpr bool sequence_parallel = true;
  static constexpr int zero = 1, element_bytes = 2, micro_batch = 1, sequence = 8192;
};

// 61 layers, the first 3 dense (FFN 18432), then 256 routed experts (top 8) and 1 shared
// expert of width 2048 in each block; MLA approximated as above.
inline constexpr Transformer deepseek_v3{.layers = 61,
                                         .d_model = 7168,
                                         .heads = 128,
                                         .kv_heads = 128,
                                         .d_ff = 18432,
                                         .gated = true,
                                         .vocab = 129280,
                                         .padded_vocab = 129280,
                                         .tied = false,
                                         .biases = false,
                                         .norm = Norm::rms_norm,
                                         .positions = 0,
                                         .experts = 256,
                                         .top_k = 8,
                                         .moe_every = 1,
                                         .dense_first = 3,
                                         .expert_d_ff = 2048,
                                         .shared_experts = 1};

// DeepSeek-V3's layout (DeepSeek-AI 2024): PP 16, EP 64 carved out of DP 128 (2048 GPUs),
// ZeRO-1, no TP, bf16, micro-batches of one 4096-token sequence, 120 of them per step (its
// 15360-sequence batch over DP 128). ZB-V is the V-shaped schedule nearest DualPipe.
template <class R, class Schedule = pipeline::ZBV<16, 120>>
struct deepseek_v3_run : layout {
  using mesh = Mesh<DP<128>, PP<16>, EP<64>>;
  using schedule = Schedule;
  using recompute = R;
  static constexpr int zero = 1, element_bytes = 2, micro_batch = 1, sequence = 4096;
};

}  // namespace fived::plan
