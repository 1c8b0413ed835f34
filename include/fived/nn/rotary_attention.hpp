#pragma once
// Llama's causal self-attention: grouped-query heads with rotary positions, heads split
// over TP (Megatron).
//
//   q|k|v   ColumnParallel q_proj [C, C], k_proj and v_proj [KV hd, C] (torch.nn.Linear, no
//           biases): adjacent in the flat buffer, so one GEMM computes this rank's
//           [N, (C + 2 KV hd)/TP] (its H/TP query heads, then its KV/TP key and value heads)
//   rotary  queries and keys rotated in place by each row's position in its sequence (its
//           global position under context parallelism's zig-zag chunks; Ops::rotary_forward)
//   core    the causal attention of the local heads (nn/attention.hpp), each query head
//           reading its group's key/value head where it lies (no copies, as Hugging Face's
//           repeat_kv makes), or under CP the ring or the all-gather of the key/value heads
//           alone (the Context argument)
//   o_proj  RowParallel [C, C] -> the stream
//
// Each rank keeps the key/value heads its query heads read: KV / TP of them when TP divides
// the KV heads; with TP above them (Llama 3 70B's 8 KV heads at TP 16) one, shared by
// TP / KV consecutive ranks (its replicas, TpSplit::max_pieces), whose k_proj and v_proj
// gradients are summed over them once per backward: each rank puts its share in its head's
// slot of a [KV, 2 hd, C] buffer, one all-reduce over TP, each takes its slot back.
// Collectives per step on the TP group: as nn/attention.hpp, plus that all-reduce.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>

#include "fived/device/buffer.hpp"
#include "fived/nn/attention.hpp"
#include "fived/nn/linear.hpp"
#include "fived/nn/param_table.hpp"

namespace fived {

// self_attn.{q,k,v,o}_proj.weight: [C, C], [KVC, C], [KVC, C], [C, C] with KVC = KV heads x
// head size (k and v cut into at most KV pieces over TP); streams stream .. stream + 3.
constexpr std::array<TensorSpec, 4> rotary_attention_specs(int layer, int unit, int C, int KV, int KVC,
                                                           std::uint64_t stream) {
  return {matrix_spec("self_attn.q_proj.weight", layer, C, C, {0, 1}, unit, Init::normal, stream),
          matrix_spec("self_attn.k_proj.weight", layer, KVC, C, {0, 1, KV}, unit, Init::normal, stream + 1),
          matrix_spec("self_attn.v_proj.weight", layer, KVC, C, {0, 1, KV}, unit, Init::normal, stream + 2),
          matrix_spec("self_attn.o_proj.weight", layer, C, C, {1, 1}, unit, Init::normal_residual, stream + 3)};
}

template <class S, int Heads, int KVHeads, class Context = RingContext>
struct RotaryAttention {
  using T = typename S::value_type;
  using stat_t = typename S::stat_t;
  using Linear = TorchLinear;
  static_assert(Heads % KVHeads == 0, "grouped-query attention: the key/value heads must divide the query heads");
  static_assert(KVHeads % S::tp == 0 || S::tp % KVHeads == 0,
                "tensor parallelism and grouped-query attention: the TP extent must divide kv_heads or be a multiple "
                "of it (each rank keeps whole key/value heads)");
  static constexpr int replicas = S::tp > KVHeads ? S::tp / KVHeads : 1;  // ranks sharing a key/value head
  static constexpr int local_heads = Heads / S::tp, local_kv = replicas > 1 ? 1 : KVHeads / S::tp;
  // The core: local causal attention, or CP's ring or all-gather, over the local heads.
  using Attn = Attention<S, Heads, Context, local_kv>;
  using Core = typename Attn::Core;
  using ContextWork = typename Attn::ContextWork;
  // The gathered input under SP, the rotated q | k | v [N, raw_width], the core unless recomputed.
  using Saved = typename Attn::Saved;
  // q_proj, k_proj and v_proj as one [(C + 2 KVC)/TP, C] weight (the pieces lie back to back).
  struct Params {
    T *qkv, *o;
  };
  static Params bind(TensorCursor<T>& c, int C, int KVC) {
    const std::size_t q = static_cast<std::size_t>(C / S::tp) * C, kv = static_cast<std::size_t>(kv_rows(KVC)) * C;
    T* w = c.take();
    if (c.take() != w + q || c.take() != w + q + kv)
      throw std::logic_error("RotaryAttention: q_proj, k_proj and v_proj must be adjacent in the flat buffer");
    return {w, c.take()};
  }
  // This rank's rows of k_proj (and of v_proj), and its projection width C/TP + 2 of them.
  static constexpr int kv_rows(int KVC) { return KVC / KVHeads * local_kv; }
  static constexpr int raw_width(int C, int KVC) { return C / S::tp + 2 * kv_rows(KVC); }

  // With replicas: the projection's weight gradient before it is added, and the key/value
  // heads' slots [KV, 2 hd, C] summed over TP. Empty otherwise; shared by the slots.
  struct Work {
    Buffer<T, typename S::device> dw, slots;
    void reserve(typename S::ops_type& ops, int C, int KVC) {
      if constexpr (replicas > 1) {
        dw = ops.template make_buffer<T>(static_cast<std::size_t>(raw_width(C, KVC)) * C);
        slots = ops.template make_buffer<T>(2 * static_cast<std::size_t>(KVC) * C);
      }
    }
  };

  // y (the stream's rows) = o_proj(attention(rotary(q|k|v(x)))); x is the norm's output.
  // inv_freq [head size / 2]: the rotary frequencies. partial: [N, C] when SP.
  static void forward(S& s, Saved& a, Core& core, ContextWork& ring, T* y, const T* x, Params p, int C, int KVC,
                      const stat_t* inv_freq, T* partial) {
    const T* x_full = s.gather_rows(x, a.x_full.data(), C);
    ColumnParallel<S, Linear>::forward(s, a.qkv.data(), x_full, p.qkv, nullptr, C, raw_width(C, KVC));
    s.ops.rotary_forward(a.qkv.data(), inv_freq, s.rows(), local_heads, local_kv, C / Heads, s.positions());
    Attn::core_forward(s, a.qkv.data(), core, ring, C);
    RowParallel<S, Linear>::forward(s, y, core.atty.data(), p.o, nullptr, C / S::tp, C, partial);
  }
  static void core_forward(S& s, const Saved& a, Core& core, ContextWork& ring, int C) {
    Attn::core_forward(s, a.qkv.data(), core, ring, C);
  }

  // dx (the stream's rows, "=") from dy; gradients "+=". Work buffers: datty [N, C/TP],
  // dqkv [N, raw_width], full [N, C] when SP.
  static void backward(S& s, ContextWork& ring, Work& w, T* dx, Params g, const T* dy, const T* x, const Saved& a,
                       const Core& core, Params p, int C, int KVC, const stat_t* inv_freq, T* datty, T* dqkv, T* full) {
    const T* x_full = S::sp ? a.x_full.data() : x;
    RowParallel<S, Linear>::backward(s, datty, g.o, nullptr, dy, Attn::held_output(s, a, core, C), p.o, C / S::tp, C,
                                     full);
    Attn::core_backward(s, ring, dqkv, datty, a.qkv.data(), core, C);
    s.ops.rotary_backward(dqkv, inv_freq, s.rows(), local_heads, local_kv, C / Heads, s.positions());
    if constexpr (replicas == 1) {
      ColumnParallel<S, Linear>::backward(s, dx, g.qkv, nullptr, dqkv, x_full, p.qkv, C, raw_width(C, KVC), full);
    } else {  // the projection's gradient whole, then the shared key/value head's part summed over its
              // replicas: all of it the weight half (Step::weight_grad), the all-reduce included
      const std::size_t q = static_cast<std::size_t>(C / S::tp) * C, kv = 2 * static_cast<std::size_t>(kv_rows(KVC)) * C;
      T *dw = w.dw.data(), *slots = w.slots.data(), *gq = g.qkv;
      T* slot = slots + static_cast<std::size_t>(s.rank() / replicas) * kv;
      const std::size_t n_dw = w.dw.size(), n_slots = w.slots.size();
      auto* comm = &s.comm;
      s.weight_grad([=](auto& ops) { ops.zero(dw, n_dw); });
      ColumnParallel<S, Linear>::backward(s, dx, dw, nullptr, dqkv, x_full, p.qkv, C, raw_width(C, KVC), full);
      s.weight_grad([=](auto& ops) {
        ops.residual_forward(gq, gq, dw, q);
        ops.zero(slots, n_slots);
        ops.copy(slot, dw + q, kv);
        comm->all_reduce(std::span<T>(slots, n_slots));
        ops.residual_forward(gq + q, gq + q, slot, kv);
      });
    }
  }
};

}  // namespace fived
