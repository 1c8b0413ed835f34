#pragma once
// Bytes of activations one rank keeps, per micro-batch slot and shared, as constexpr
// functions of a model and one micro-batch's Rows (plan/layout.hpp). They mirror, buffer for
// buffer, what fived's decoder reserves: the Saved structs of nn/layernorm.hpp,
// nn/attention.hpp (with its Core), nn/mlp.hpp, nn/moe.hpp, nn/head.hpp, the block's Saved
// and Work (nn/gpt.hpp's PreNormBlock; parallel_blocks: examples/parallel_blocks.hpp), and
// the decoder's Slot and Work (nn/decoder.hpp). A change there is a change here.
//
// Notation: N = micro_batch·sequence/CP tokens on the rank, n = N/TP rows of the residual
// stream under sequence parallelism (else N), t bytes an element, st bytes a statistic.
//
//   per block    ln_1 out [n, C] + stats [n] (mean, rstd; RMSNorm: rstd)
//                attention: SP's gathered input [N, C]; q|k|v [N, (H/TP + 2·KVl)·hd] with KVl
//                           the rank's key/value heads (KV/TP, or 1 when TP is above KV);
//                           core output [N, H·hd/TP] + log-sum-exp [N, H/TP] stat
//                res2 [n, C]; ln_2 out [n, C] + stats
//                FFN: SP's gathered input [N, C]; pre-activation and GELU output
//                     [N, F/TP] each (SwiGLU: gate, up and their product, 3 of them)
//                or MoE: SP's gathered input; scores [N, E] stat; gates [N·k] stat; chosen
//                     expert, dispatch position, token of each row: int [N·k] x3; expert
//                     outputs y [N·k, C]; this rank's expert rows x [R, C], pre and h
//                     [R, Fe/TP] (SwiGLU: 3); the balancing gradient [E] float; shared
//                     experts as FFNs of width Fe over all N tokens
//                res3 [n, C]
//   per slot     token ids and targets int [N] each (and packed documents' starts), the embedding output [n, C], the
//                blocks, and with the head: ln_f out [n, C] + stats, SP's gathered input,
//                logits [N, Vp/TP], max, sum of exp, target logit [N] stat, losses [N] float
//   recompute    SelectiveRecompute keeps no core output or log-sum-exp per block: one
//                shared Core. FullRecompute keeps only res3 per block (the next block's
//                input): one shared block (attention, FFN and MoE if the part has them).
//   work         shared by the slots: the stream's gradient buffers [n, C] x3, d(hidden)
//                [N, F/TP] (SwiGLU: d(h), d(gate), d(up)), d(q|k|v), with rotary positions
//                the frequencies [hd/2] stat, SP's [N, C] and its norm gradient partials,
//                the ring's or the all-gather's buffers under CP, the MoE's.
//
// R, the rows this rank's experts receive, is data dependent: dropless, the plan takes the
// balanced case, R = N·k (every rank receives as many rows as it sends); with a capacity,
// the most that can arrive (Transformer::expert_rows), which the model's buffers are made for. With micro_batch·sequence = T
// tokens, TP = 1 and no MoE, a GELU block keeps 2 + 6 + 2 + 2 + 2 + 8 + 8 + 2 = 32·T·C
// bytes in bf16 plus its statistics; Megatron's count (Korthikanti et al. 2022) is
// 34·s·b·h + 5·a·s²·b: the 2 more are its two dropout masks (fived has no dropout) and the
// s² term is the attention matrix, which flash-style attention never stores (the log-sum-exp
// [N, H] replaces it). Under SP Megatron keeps 34·s·b·h/t; fived keeps the gathered inputs of
// c_attn and c_fc whole ([N, C] each, 4·s·b·h more), which Megatron gathers again in backward.

#include <cstdint>

#include "fived/plan/layout.hpp"
#include "fived/plan/model.hpp"

namespace fived::plan {

using Bytes = std::uint64_t;

namespace detail {
constexpr Bytes bytes(std::int64_t elements, int each) { return static_cast<Bytes>(elements) * static_cast<Bytes>(each); }
}  // namespace detail

// A norm's output [rows, C] and its statistics.
constexpr Bytes norm_bytes(const Transformer& m, std::int64_t rows, const Rows& a) {
  return detail::bytes(rows * m.d_model, a.t) + detail::bytes(rows * m.norm_vectors(), a.st);
}
// The core attention's output and log-sum-exp (Attention::Core).
constexpr Bytes core_bytes(const Transformer& m, const Rows& a) {
  return detail::bytes(a.N * (m.attention_width() / a.tp), a.t) + detail::bytes(a.N * (m.heads / a.tp), a.st);
}
// Attention::Saved (RotaryAttention's too): the gathered input, the local q|k|v, and the core
// unless it is recomputed.
constexpr Bytes attention_bytes(const Transformer& m, const Rows& a, bool keep_core) {
  return (a.sp ? detail::bytes(a.N * m.d_model, a.t) : 0) + detail::bytes(a.N * m.local_qkv_width(a.tp), a.t) +
         (keep_core ? core_bytes(m, a) : 0);
}
// MLP::Saved: the gathered input, and the FFN's hidden activations.
constexpr Bytes ffn_hidden_bytes(const Transformer& m, std::int64_t rows, int width, const Rows& a) {
  return detail::bytes(rows * (width / a.tp) * (m.gated ? 3 : 2), a.t);
}
constexpr Bytes mlp_bytes(const Transformer& m, const Rows& a) {
  return (a.sp ? detail::bytes(a.N * m.d_model, a.t) : 0) + ffn_hidden_bytes(m, a.N, m.d_ff, a);
}
// MoE::Saved, with D rows in dispatch order (dispatch_rows: N·k, or E·capacity when padded)
// and R at this rank's experts (expert_rows: with a capacity the most that can arrive;
// dropless N·k, balanced), plus the shared experts' hidden activations: scores [N, E] and
// gates [N·k], each assignment's expert and row, each row's token and output, the experts'
// inputs and activations, and the statistics (the balancing loss's gradient and the rows kept
// per expert, [E] each, the balance [2E]).
constexpr Bytes moe_bytes(const Transformer& m, const Rows& a) {
  const std::int64_t Nk = a.N * m.top_k, D = m.dispatch_rows(a.N), R = m.expert_rows(a.N, a.ep);
  return (a.sp ? detail::bytes(a.N * m.d_model, a.t) : 0) + detail::bytes(a.N * m.experts + Nk, a.st) +
         detail::bytes(2 * Nk + D, 4) + detail::bytes(D * m.d_model, a.t) + detail::bytes(R * m.d_model, a.t) +
         ffn_hidden_bytes(m, R, m.expert_d_ff, a) + detail::bytes(4 * m.experts, a.st) +
         m.shared_experts * ffn_hidden_bytes(m, a.N, m.expert_d_ff, a);
}
// Everything block `layer`'s forward leaves for its backward (BlockActs), core included or not.
constexpr Bytes whole_block_bytes(const Transformer& m, const Rows& a, bool mlp, bool moe, bool keep_core) {
  const int streams = m.parallel_blocks ? 1 : 2;  // res2 (between attention and the FFN) and res3
  return m.block_norms() * norm_bytes(m, a.n, a) + attention_bytes(m, a, keep_core) +
         detail::bytes(streams * a.n * m.d_model, a.t) +
         (mlp ? mlp_bytes(m, a) : 0) + (moe ? moe_bytes(m, a) : 0);
}
// What a slot keeps for block `layer` under the layout's recomputation.
constexpr Bytes block_bytes(const Transformer& m, int layer, const Rows& a) {
  if (a.recompute == Recompute::full) return detail::bytes(a.n * m.d_model, a.t);  // res3: the next block's input
  return whole_block_bytes(m, a, !m.is_moe(layer), m.is_moe(layer), a.recompute == Recompute::none);
}
// Head::Saved and ln_f.
constexpr Bytes head_bytes(const Transformer& m, const Rows& a) {
  return norm_bytes(m, a.n, a) + (a.sp ? detail::bytes(a.N * m.d_model, a.t) : 0) +
         detail::bytes(a.N * (m.padded_vocab / a.tp), a.t) + detail::bytes(3 * a.N, a.st) + detail::bytes(a.N, 4);
}
// One micro-batch slot of a part (Decoder::Slot): ids, the embedding's output, the blocks, the head.
constexpr Bytes slot_bytes(const Transformer& m, const Blocks& part, const Rows& a) {
  Bytes s = detail::bytes((m.documents ? 3 : 2) * a.N, 4) + detail::bytes(a.n * m.d_model, a.t);
  int moe = 0;
  for (int l = part.first; l < part.first + part.count; ++l) s += block_bytes(m, l, a), moe += m.is_moe(l) ? 1 : 0;
  if (moe > 0 && m.balancing_loss) s += detail::bytes(std::int64_t{moe} * 2 * m.experts, a.st);  // their balance, kept
  return s + (part.head ? head_bytes(m, a) : 0);
}

// The buffers recomputation runs in, one per part (Decoder::Work::rerun, or the block's Work::core).
constexpr Bytes recompute_bytes(const Transformer& m, const Blocks& part, const Rows& a) {
  bool mlp = false, moe = false;
  for (int l = part.first; l < part.first + part.count; ++l) (m.is_moe(l) ? moe : mlp) = true;
  if (a.recompute == Recompute::full) return whole_block_bytes(m, a, mlp, moe, true);
  if (a.recompute == Recompute::selective) return core_bytes(m, a);
  return 0;
}

// The decoder's and the block's Work of a part: what one forward or backward uses and leaves behind, shared by its
// slots. A SwiGLU FFN (Llama's) keeps d(h) [N, F/TP] and d(gate | up) [N, 2F/TP] where GELU has one d(h); d(core)
// reuses them. Rotary attention (no learned positions) adds the frequencies.
constexpr Bytes work_bytes(const Transformer& m, const Blocks& part, const Rows& a) {
  bool moe = false;
  for (int l = part.first; l < part.first + part.count; ++l) moe = moe || m.is_moe(l);
  const std::int64_t C = m.d_model, q = m.attention_width() / a.tp, qkv = m.local_qkv_width(a.tp);
  const std::int64_t kv = qkv - q;  // packed k|v columns of the local key/value heads
  Bytes w = detail::bytes(3 * a.n * C, a.t)                              // out, dres, dln
            + detail::bytes(a.N * (m.d_ff / a.tp) * (m.gated ? 3 : 1), a.t)  // dhidden (also d(core))
            + detail::bytes(a.N * qkv, a.t)                              // dqkv
            + (a.sp ? detail::bytes(a.N * C, a.t) : 0);                  // SP's gathered or partial rows
  if (m.positions == 0)  // RotaryAttention: the frequencies
    w += detail::bytes(m.head_dim() / 2, a.st);
  if (m.positions == 0 && m.kv_heads < a.tp)  // key/value heads on several ranks: their gradient and its slots
    w += detail::bytes(m.local_qkv_width(a.tp) * m.d_model + 2 * std::int64_t{m.kv_heads} * m.head_dim() * m.d_model, a.t);
  if (a.sp)  // SP: each unit's norm gradients, partial over TP until the unit's all-reduce
    w += detail::bytes((m.block_norms() * part.count + (part.head ? 1 : 0)) * m.norm_elements(), a.t);
  if (a.cp > 1 && !m.allgather_context)  // RingAttention::Work: k|v in hand and next, o, dq, d[k|v] x2 and a step's
    w += detail::bytes(2 * a.N * kv, a.t) +  // share, Dd, dqkv in stat
         detail::bytes(2 * a.N * q + 3 * a.N * kv + a.N * (m.heads / a.tp) + a.N * qkv, a.st);
  if (a.cp > 1 && m.allgather_context)  // AllGatherAttention::Work: k|v local and gathered, o, dq, d[k|v] gathered and
    w += detail::bytes((1 + a.cp) * a.N * kv, a.t) +  // local, Dd, dqkv in stat
         detail::bytes(2 * a.N * q + (a.cp + 1) * a.N * kv + a.N * (m.heads / a.tp) + a.N * qkv, a.st);
  if (moe) {  // MoE::Work: router logits, d(gate), rows in dispatch order, the experts' staging, y, d(h)
    const std::int64_t Nk = a.N * m.top_k, D = m.dispatch_rows(a.N), R = m.expert_rows(a.N, a.ep);
    w += detail::bytes(a.N * m.experts, a.t) + detail::bytes(Nk, a.st) + detail::bytes((D + 2 * R) * C, a.t) +
         detail::bytes(R * (m.expert_d_ff / a.tp) * (m.gated ? 3 : 1), a.t);  // d(h) (SwiGLU: and d(gate | up))
  }
  return w;
}

// What one micro-batch's split backward leaves for its weight half (nn/weight_grads.hpp's
// tape, Decoder::backward_input): a snapshot, rounded up to 256 bytes, of every operand a
// deferred weight gradient reads that backward overwrites. Per block: each norm's d(out)
// [n, C]; c_proj's d(out) [N, C] (gathered under SP) and c_attn's d(q|k|v); the FFN's d(out)
// [N, C] and d(hidden) [N, F/TP] (SwiGLU: d(gate | up), twice that); a MoE's d(y) and d(hidden)
// of each local expert's rows (padded EP·capacity of them; with a capacity the most that can
// arrive, split evenly; dropless N·k/El, balanced) and the router's d(logits) [N, E];
// under SelectiveRecompute the shared core output [N, H·hd/TP]; under FullRecompute also every
// saved input the weight half reads (each norm's input and statistics, each linear's input),
// since the block's saved activations are recomputed into shared buffers. The final norm's
// d(out) with the head, the gathered d(stream) [N, C] with the embedding.
constexpr Bytes snapshot(std::int64_t elements, int each) { return (detail::bytes(elements, each) + 255) / 256 * 256; }
constexpr Bytes deferred_ffn_bytes(const Transformer& m, std::int64_t rows, int width, const Rows& a, bool full) {
  const std::int64_t C = m.d_model, h = width / a.tp;
  return snapshot(rows * C, a.t) + snapshot(rows * h * (m.gated ? 2 : 1), a.t) +  // d(out), d(hidden)
         (full ? snapshot(rows * h, a.t) + snapshot(rows * C, a.t) : 0);          // h, the input
}
constexpr Bytes deferred_block_bytes(const Transformer& m, int layer, const Rows& a) {
  const bool full = a.recompute == Recompute::full;
  const std::int64_t C = m.d_model, q = m.attention_width() / a.tp;
  Bytes b = m.block_norms() * (snapshot(a.n * C, a.t) +
                               (full ? snapshot(a.n * C, a.t) + m.norm_vectors() * snapshot(a.n, a.st) : 0));
  b += snapshot(a.N * C, a.t) + snapshot(a.N * m.local_qkv_width(a.tp), a.t);  // c_proj's, c_attn's d(out)
  if (a.recompute != Recompute::none) b += snapshot(a.N * q, a.t);                // c_proj's input, the core
  if (full) b += snapshot(a.N * C, a.t);                                         // c_attn's input
  if (!m.is_moe(layer)) return b + deferred_ffn_bytes(m, a.N, m.d_ff, a, full);
  // Each local expert's rows: with a capacity the most that arrive split evenly (padded: exactly
  // EP·capacity each), dropless balanced.
  const int local = m.experts / a.ep;
  const std::int64_t rows = (m.capacity_factor > 0 ? m.expert_rows(a.N, a.ep) : a.N * m.top_k) / local;
  b += local * deferred_ffn_bytes(m, rows, m.expert_d_ff, a, full) + snapshot(a.N * m.experts, a.t) +
       (full ? snapshot(a.N * C, a.t) : 0);  // the router's d(logits) and input
  return b + m.shared_experts * deferred_ffn_bytes(m, a.N, m.expert_d_ff, a, full);
}
constexpr Bytes deferred_bytes(const Transformer& m, const Blocks& part, const Rows& a) {
  Bytes b = 0;
  for (int l = part.first; l < part.first + part.count; ++l) b += deferred_block_bytes(m, l, a);
  if (part.head) b += snapshot(a.n * m.d_model, a.t);
  if (part.embedding) b += snapshot(a.N * m.d_model, a.t);
  return b;
}

}  // namespace fived::plan
