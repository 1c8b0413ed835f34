#pragma once
// All-gather context parallelism (Llama 3's choice for long context): causal self-attention
// of sequences split over the CP axis by gathering every rank's keys and values, forward
// and backward. The same contract as ring attention (nn/ring_attention.hpp), chosen by the
// configuration's `context_attention` (AllGatherContext or RingContext).
//
// Each rank holds two zig-zag chunks of every sequence (context/zigzag.hpp), chunk-major.
// Forward: its packed [k | v] rows are all-gathered over CP (one collective, small under
// grouped-query attention's few key/value heads), then each local query chunk meets every
// gathered key chunk in its past as a full block and its own as the causal diagonal,
// merged by log-sum-exp in stat_t (attention_block_forward, as the ring does).
// Backward: the keys and values are gathered again (the forward kept only the output and
// its log-sum-exp), the blocks give dq and a d[k | v] for every gathered row, and one
// reduce-scatter over CP returns each rank the sum for its own rows. Two collectives each
// way instead of the ring's CP send/recv pairs, and no overlap to lose: the trade-off is
// memory, CP times the local [k | v] in hand.

#include <cstddef>
#include <span>

#include "fived/context/zigzag.hpp"
#include "fived/device/buffer.hpp"
#include "fived/nn/context_rows.hpp"

namespace fived {

template <class S, int Heads, int KVHeads = Heads>
struct AllGatherAttention {
  using T = typename S::value_type;
  using stat_t = typename S::stat_t;
  using Device = typename S::device;
  using Shape = ContextRows<S, Heads, KVHeads>;
  static constexpr int cp = S::cp;

  // Shared by every micro-batch slot: for N local rows, Cl channels of the local query heads
  // and Ckv of their key/value heads, beside the accumulators (o, dq, Dd, dqkv).
  struct Work : Shape::Accumulators {
    Buffer<T, Device> kv, kv_all;       // packed [k | v]: local [N, 2 Ckv] and gathered [CP N, 2 Ckv]
    Buffer<stat_t, Device> dkv_all;     // d[k | v] of every gathered row [CP N, 2 Ckv]
    Buffer<stat_t, Device> dkv;         // this rank's rows of it, summed over CP [N, 2 Ckv]
    std::size_t capacity = 0;

    void reserve(typename S::ops_type& ops, std::size_t N, std::size_t Cl) {
      if (N <= capacity) return;
      capacity = N;
      Shape::Accumulators::reserve(ops, N, Cl);
      const std::size_t kv_n = N * 2 * static_cast<std::size_t>(Shape::kv_channels(static_cast<int>(Cl)));
      kv = ops.template make_buffer<T>(kv_n);
      kv_all = ops.template make_buffer<T>(cp * kv_n);
      dkv_all = ops.template make_buffer<stat_t>(cp * kv_n);
      dkv = ops.template make_buffer<stat_t>(kv_n);
    }
  };

  // atty [N, Cl] and lse [2, B, Heads, n] from qkv [N, Cl + 2 Ckv] (this rank's rows, chunk-major).
  static void forward(S& s, Work& w, T* atty, stat_t* lse, const T* qkv, int Cl) {
    const Shape z(s, Cl);
    gather_kv(s, w, z, qkv, Cl);
    bool seen[2] = {false, false};
    each_block(s, z, [&](int q, std::size_t k_row, bool causal, DocumentMask docs) {
      const T* k = w.kv_all.data() + k_row * z.ld_kv;
      s.ops.attention_block_forward(w.o.data() + z.chunk(q) * Cl, lse + z.stats(q), qkv + z.chunk(q) * z.ld_qkv, k,
                                    k + z.Ckv, z.ld_qkv, z.ld_kv, s.B, z.n, Cl, Heads, KVHeads, causal, docs,
                                    !seen[q]);
      seen[q] = true;
    });
    s.ops.from_acc(atty, w.o.data(), z.N * static_cast<std::size_t>(Cl));
  }

  // dqkv [N, Cl + 2 Ckv] ("=") from datty, with the forward's qkv, atty and lse.
  static void backward(S& s, Work& w, T* dqkv, const T* datty, const T* qkv, const T* atty, const stat_t* lse, int Cl) {
    const Shape z(s, Cl);
    auto& ops = s.ops;
    z.row_dots(s, w.Dd.data(), datty, atty);
    gather_kv(s, w, z, qkv, Cl);
    ops.zero(w.dq);
    ops.zero(w.dkv_all);
    each_block(s, z, [&](int q, std::size_t k_row, bool causal, DocumentMask docs) {
      const T* k = w.kv_all.data() + k_row * z.ld_kv;
      stat_t* dk = w.dkv_all.data() + k_row * z.ld_kv;
      ops.attention_block_backward(w.dq.data() + z.chunk(q) * Cl, dk, dk + z.Ckv, z.ld_kv, datty + z.chunk(q) * Cl,
                                   w.Dd.data() + z.stats(q), lse + z.stats(q), qkv + z.chunk(q) * z.ld_qkv, k,
                                   k + z.Ckv, z.ld_qkv, z.ld_kv, s.B, z.n, Cl, Heads, KVHeads, causal, docs);
    });
    s.cp_comm.reduce_scatter(std::span<const stat_t>(w.dkv_all.data(), cp * z.N * z.ld_kv),
                             std::span<stat_t>(w.dkv.data(), z.N * z.ld_kv));
    z.assemble_dqkv(s, dqkv, w.dqkv.data(), w.dq.data(), w.dkv.data());
  }

 private:

  // Every rank's packed [k | v] into kv_all, rank-major (rank r's rows at r·N).
  static void gather_kv(S& s, Work& w, const Shape& z, const T* qkv, int Cl) {
    s.ops.copy_rows(w.kv.data(), z.ld_kv, qkv + Cl, z.ld_qkv, z.ld_kv, z.N);
    s.cp_comm.all_gather(std::span<const T>(w.kv.data(), z.N * z.ld_kv),
                         std::span<T>(w.kv_all.data(), cp * z.N * z.ld_kv));
  }

  // block(local query chunk, first gathered row of the key chunk, causal, the documents' mask)
  // for every pair a causal mask lets meet: key chunks in the query's past whole, its own
  // chunk on the diagonal.
  template <class Block>
  static void each_block(S& s, const Shape& z, Block&& block) {
    using split = typename S::split;
    const auto mine = split::chunks_of(s.cp_comm.rank());
    for (int q = 0; q < 2; ++q)
      for (int r = 0; r < cp; ++r)
        for (int c = 0; c < 2; ++c) {
          const int gk = split::chunks_of(r)[static_cast<std::size_t>(c)], gq = mine[static_cast<std::size_t>(q)];
          if (gk <= gq) block(q, static_cast<std::size_t>(r) * z.N + z.chunk(c), gk == gq, z.documents(s, q, gk));
        }
  }
};

}  // namespace fived
