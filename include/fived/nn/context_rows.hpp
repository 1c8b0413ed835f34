#pragma once
// What the two context-parallel attention cores share (nn/ring_attention.hpp,
// nn/allgather_attention.hpp): the shape of a rank's rows, two zig-zag chunks stored
// chunk-major (context/zigzag.hpp), and the steps of backward around their blocks. Heads
// query heads read KVHeads key/value heads (grouped-query attention; equal for multi-head).

#include <cstddef>

#include "fived/context/documents.hpp"
#include "fived/device/buffer.hpp"

namespace fived {

template <class S, int Heads, int KVHeads>
struct ContextRows {
  using T = typename S::value_type;
  using stat_t = typename S::stat_t;

  std::size_t N, n, rows_per_chunk, ld_qkv, ld_kv;  // rows; a chunk's length; its rows; q|k|v and k|v widths
  int Cl, Ckv;                                      // channels of the local query heads, of their key/value heads

  ContextRows(const S& s, int cl)
      : N(static_cast<std::size_t>(s.B) * static_cast<std::size_t>(s.T_)),
        n(static_cast<std::size_t>(s.chunk_length())),
        rows_per_chunk(static_cast<std::size_t>(s.B) * n),
        ld_qkv(static_cast<std::size_t>(cl + 2 * kv_channels(cl))),
        ld_kv(2 * static_cast<std::size_t>(kv_channels(cl))),
        Cl(cl),
        Ckv(kv_channels(cl)) {}
  static constexpr int kv_channels(int cl) { return cl / Heads * KVHeads; }

  // What both cores accumulate in stat_t for N local rows and Cl channels of the query heads
  // (each core's Work adds its own key/value buffers): the forward's output, dq, the row dots
  // dout . out, and d[q | k | v] before it is rounded to T.
  struct Accumulators {
    Buffer<stat_t, typename S::device> o, dq;  // [N, Cl]
    Buffer<stat_t, typename S::device> Dd;     // [N, Heads]
    Buffer<stat_t, typename S::device> dqkv;   // [N, Cl + 2 Ckv]
    void reserve(typename S::ops_type& ops, std::size_t N, std::size_t Cl) {
      o = ops.template make_buffer<stat_t>(N * Cl);
      dq = ops.template make_buffer<stat_t>(N * Cl);
      Dd = ops.template make_buffer<stat_t>(N * Heads);
      dqkv = ops.template make_buffer<stat_t>(N * (Cl + 2 * static_cast<std::size_t>(kv_channels(static_cast<int>(Cl)))));
    }
  };
  std::size_t chunk(int c) const { return static_cast<std::size_t>(c) * rows_per_chunk; }  // its first row
  // The documents' mask of local query chunk q against a key chunk of global chunk index
  // key_chunk (none when the rows hold no documents).
  DocumentMask documents(const S& s, int q, int key_chunk) const {
    if (s.doc_first == nullptr) return {};
    return {s.doc_first + chunk(q), static_cast<std::ptrdiff_t>(key_chunk) * static_cast<std::ptrdiff_t>(n)};
  }
  std::size_t stats(int c) const { return static_cast<std::size_t>(c) * rows_per_chunk * Heads; }

  // Backward's first step: Dd = dout . out per row and head, chunk by chunk.
  void row_dots(S& s, stat_t* Dd, const T* datty, const T* atty) const {
    for (int c = 0; c < 2; ++c)
      s.ops.attention_row_dot(Dd + stats(c), datty + chunk(c) * Cl, atty + chunk(c) * Cl, s.B, static_cast<int>(n),
                              Cl, Heads);
  }
  // Backward's last: dqkv [N, Cl + 2 Ckv] ("=") from dq [N, Cl] and d[k | v] [N, 2 Ckv],
  // gathered in stat precision in `staging` [N, Cl + 2 Ckv] and rounded to T once.
  void assemble_dqkv(S& s, T* dqkv, stat_t* staging, const stat_t* dq, const stat_t* dkv) const {
    s.ops.copy_rows(staging, ld_qkv, dq, static_cast<std::size_t>(Cl), static_cast<std::size_t>(Cl), N);
    s.ops.copy_rows(staging + Cl, ld_qkv, dkv, ld_kv, ld_kv, N);
    s.ops.from_acc(dqkv, staging, N * ld_qkv);
  }
};

}  // namespace fived
