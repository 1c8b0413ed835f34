#pragma once
// Megatron's causal self-attention with the heads split over TP.
//
//   c_attn  ColumnParallel, the fused [q|k|v] projection [C, 3C] placed as three blocks
//           each split by heads (TpSplit{1, 3}), so rank r's output [N, 3C/TP] is the
//           [q|k|v] of heads [r*NH/TP, (r+1)*NH/TP): the layout the attention kernel reads
//   core    causal attention of the local heads over whole sequences (no collective), or
//           under context parallelism over the CP ring (nn/ring_attention.hpp) or with the
//           keys and values all-gathered (nn/allgather_attention.hpp): the Context argument
//   c_proj  RowParallel [C, C] -> the stream
//
// Per step on the TP group: without SP one all-reduce forward and one backward; with SP an
// all-gather and a reduce-scatter each way.

#include <array>
#include <cstdint>
#include <type_traits>

#include "fived/device/buffer.hpp"
#include "fived/nn/allgather_attention.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/linear.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/ring_attention.hpp"

namespace fived {

// c_attn.weight [C, 3C], c_attn.bias [3C], c_proj.weight [C, C], c_proj.bias [C];
// streams stream .. stream + 3.
constexpr std::array<TensorSpec, 4> attention_specs(int layer, int unit, int C, std::uint64_t stream) {
  return {matrix_spec("attn.c_attn.weight", layer, C, 3 * C, {1, 3}, unit, Init::normal, stream),
          vector_spec("attn.c_attn.bias", layer, 3 * C, {0, 3}, unit, Init::zeros, stream + 1),
          matrix_spec("attn.c_proj.weight", layer, C, C, {0, 1}, unit, Init::normal_residual, stream + 2),
          vector_spec("attn.c_proj.bias", layer, C, {}, unit, Init::zeros, stream + 3)};
}

// LocalKV: the key/value heads a rank's query heads read (grouped-query attention,
// nn/rotary_attention.hpp); the default is multi-head attention's one per query head.
template <class S, int Heads, class Context = RingContext, int LocalKV = Heads / S::tp>
struct Attention {
  using T = typename S::value_type;
  using stat_t = typename S::stat_t;
  static_assert(Heads % S::tp == 0,
                "tensor parallelism splits the attention heads over TP: the number of heads must be a multiple of the "
                "TP extent (change heads in the config, or use a TP that divides it)");
  static constexpr int local_heads = Heads / S::tp, local_kv = LocalKV;
  static_assert(local_kv >= 1 && local_heads % local_kv == 0,
                "grouped-query attention: a rank's key/value heads must divide its query heads");
  using ContextCore =
      std::conditional_t<std::is_same_v<Context, AllGatherContext>, AllGatherAttention<S, local_heads, local_kv>,
                         RingAttention<S, local_heads, local_kv>>;
  // Columns of the local q|k|v: the query heads' Cl = C/TP, and their key/value heads' twice.
  static constexpr int qkv_width(int C) { return C / S::tp + 2 * (C / Heads) * local_kv; }
  using ContextWork = typename ContextCore::Work;  // shared by the slots; allocated only under CP

  // The core attention's output and its log-sum-exp (what ring attention merges): kept per
  // slot, or one shared copy recomputed in backward (SelectiveRecompute, nn/recompute.hpp).
  struct Core {
    Buffer<T, typename S::device> atty;
    Buffer<stat_t, typename S::device> lse;
    void reserve(typename S::ops_type& ops, std::size_t N, std::size_t C) {
      atty = ops.template make_buffer<T>(N * C / S::tp);
      lse = ops.template make_buffer<stat_t>(N * local_heads);
    }
  };
  struct Saved {
    Buffer<T, typename S::device> x_full;  // SP: the gathered input (c_attn's dW)
    Buffer<T, typename S::device> qkv;
    Core core;  // empty when the model recomputes it
    void reserve(typename S::ops_type& ops, std::size_t N, std::size_t C, bool keep_core) {
      if constexpr (S::sp) x_full = ops.template make_buffer<T>(N * C);
      qkv = ops.template make_buffer<T>(N * static_cast<std::size_t>(qkv_width(static_cast<int>(C))));
      if (keep_core) core.reserve(ops, N, C);
    }
  };
  // The tensors' pointers, in spec order (weights or gradients).
  struct Params {
    T *qkv_w, *qkv_b, *proj_w, *proj_b;
  };

  // y (the stream's rows) = c_proj(attention(c_attn(x))); x is ln_1's output. core: where the
  // core attention's output goes (the slot's, or the shared one). partial: [N, C] when SP.
  static void forward(S& s, Saved& a, Core& core, ContextWork& ring, T* y, const T* x, Params p, int C, T* partial) {
    const int Cl = C / S::tp;
    const T* x_full = s.gather_rows(x, a.x_full.data(), C);
    ColumnParallel<S>::forward(s, a.qkv.data(), x_full, p.qkv_w, p.qkv_b, C, 3 * Cl);
    core_forward(s, a, core, ring, C);
    RowParallel<S>::forward(s, y, core.atty.data(), p.proj_w, p.proj_b, Cl, C, partial);
  }
  // The core attention alone, from the kept q|k|v: forward's middle, and what backward runs
  // again first when the model recomputes it.
  static void core_forward(S& s, const Saved& a, Core& core, ContextWork& ring, int C) {
    core_forward(s, a.qkv.data(), core, ring, C);
  }
  // The same from any q|k|v [N, qkv_width] of the local heads (a block with its own projections).
  static void core_forward(S& s, const T* qkv, Core& core, ContextWork& ring, int C) {
    const int Cl = C / S::tp;
    if constexpr (S::cp > 1) ContextCore::forward(s, ring, core.atty.data(), core.lse.data(), qkv, Cl);
    else
      s.ops.attention_forward(core.atty.data(), core.lse.data(), qkv, s.B, s.T_, Cl, local_heads, local_kv,
                              s.doc_first);
  }
  // dqkv [N, qkv_width] ("=") from d(core output) datty.
  static void core_backward(S& s, ContextWork& ring, T* dqkv, const T* datty, const T* qkv, const Core& core, int C) {
    const int Cl = C / S::tp;
    if constexpr (S::cp > 1)
      ContextCore::backward(s, ring, dqkv, datty, qkv, core.atty.data(), core.lse.data(), Cl);
    else
      s.ops.attention_backward(dqkv, datty, qkv, core.atty.data(), core.lse.data(), s.B, s.T_, Cl, local_heads,
                               local_kv, s.doc_first);
  }

  // The core's output as c_proj's weight gradient reads it: the slot's, or under
  // SelectiveRecompute (core is the shared one, recomputed) a snapshot when that is deferred.
  static const T* held_output(S& s, const Saved& a, const Core& core, int C) {
    if (&core == &a.core) return core.atty.data();
    return s.hold(core.atty.data(), static_cast<std::size_t>(s.rows()) * static_cast<std::size_t>(C / S::tp));
  }

  // dx (the stream's rows, "=") from dy; gradients "+=". x: ln_1's output, as in forward.
  // Work buffers: datty [N, C/TP], dqkv [N, 3C/TP], full [N, C] when SP (dy's rows, then dx's partial).
  static void backward(S& s, ContextWork& ring, T* dx, Params g, const T* dy, const T* x, const Saved& a,
                       const Core& core, Params p, int C, T* datty, T* dqkv, T* full) {
    const int Cl = C / S::tp;
    const T* x_full = S::sp ? a.x_full.data() : x;
    RowParallel<S>::backward(s, datty, g.proj_w, g.proj_b, dy, held_output(s, a, core, C), p.proj_w, Cl, C, full);
    core_backward(s, ring, dqkv, datty, a.qkv.data(), core, C);
    ColumnParallel<S>::backward(s, dx, g.qkv_w, g.qkv_b, dqkv, x_full, p.qkv_w, C, 3 * Cl, full);
  }
};

}  // namespace fived
