#pragma once
// Vocab-parallel token embedding plus, where the model has one, a learned position
// embedding (Megatron; GPT-2's wpe; Llama has none: its positions are rotary).
//
// wte [Vp, C] is split over TP by rows: rank r holds ids [r*Vp/TP, (r+1)*Vp/TP). Each rank
// looks up the ids in its shard (zero rows for the others) and TP rank 0 adds the
// positions, so the Partial sum over TP is wte[id] + wpe[t] exactly once; reduce_rows
// brings it to the stream (all-reduce, or reduce-scatter with SP). Backward gathers the
// stream gradient's rows; each rank adds to its own rows of wte and every rank computes
// the whole (replicated) wpe gradient from all rows, so no gradient here is Partial.
// At TP 1 this is the serial embedding, kernel for kernel.

#include <array>
#include <cstdint>

#include "fived/nn/param_table.hpp"
#include "fived/nn/stream.hpp"

namespace fived {

// wte [Vp, C] (rows past V are zero padding, not in files), wpe [max_seq, C]; streams 0, 1.
constexpr std::array<TensorSpec, 2> embedding_specs(int V, int Vp, int C, int max_seq) {
  return {matrix_spec("wte.weight", -1, Vp, C, {0, 1}, 0, Init::normal, 0, V),
          matrix_spec("wpe.weight", -1, max_seq, C, {}, 0, Init::normal, 1)};
}

// A token embedding alone, [Vp, C] under the model's name for it (Llama's
// "model.embed_tokens.weight"); stream 0.
constexpr std::array<TensorSpec, 1> token_embedding_specs(const char* name, int V, int Vp, int C) {
  return {matrix_spec(name, -1, Vp, C, {0, 1}, 0, Init::normal, 0, V)};
}

template <class S>
struct Embedding {
  using T = typename S::value_type;

  // x (the stream's rows, "=") from tokens [N] (device memory, every rank all of them);
  // wpe may be null (no learned positions).
  // partial: [N, C] when SP.
  // Per chunk of the sequence (context parallelism: nn/stream.hpp), its positions' rows of wpe.
  static void forward(S& s, T* x, const int* tokens, const T* wte, const T* wpe, int Vp, int C, T* partial) {
    const int rows = Vp / S::tp, n = s.chunk_length();
    T* p = s.partial_buffer(x, partial);
    for (int c = 0; c < S::chunks; ++c) {
      const std::size_t first = static_cast<std::size_t>(c) * static_cast<std::size_t>(s.B) * static_cast<std::size_t>(n);
      const T* pos = s.rank() == 0 && wpe != nullptr
                         ? wpe + static_cast<std::size_t>(s.chunk_position(c)) * static_cast<std::size_t>(C)
                         : static_cast<const T*>(nullptr);
      s.ops.embedding_forward(p + first * static_cast<std::size_t>(C), tokens + first, wte, s.rank() * rows, rows, pos,
                              s.B, n, C);
    }
    s.reduce_rows(p, x, C);
  }
  // dwte (this rank's rows), dwpe (or none) "+=" from dx (the stream's rows): all of it the
  // weight half (Step::weight_grad); tokens stay in the slot. gather: [N, C] when SP.
  static void backward(S& s, T* dwte, T* dwpe, const T* dx, const int* tokens, int Vp, int C, T* gather) {
    const int rows = Vp / S::tp, n = s.chunk_length(), B = s.B, vocab_begin = s.rank() * rows;
    const T* dx_full = s.hold(s.gather_rows(dx, gather, C), static_cast<std::size_t>(s.rows()) * static_cast<std::size_t>(C));
    for (int c = 0; c < S::chunks; ++c) {
      const std::size_t first = static_cast<std::size_t>(c) * static_cast<std::size_t>(B) * static_cast<std::size_t>(n);
      T* dpos = dwpe != nullptr ? dwpe + static_cast<std::size_t>(s.chunk_position(c)) * static_cast<std::size_t>(C)
                                : nullptr;
      const T* g = dx_full + first * static_cast<std::size_t>(C);
      const int* ids = tokens + first;
      s.weight_grad([=](auto& ops) { ops.embedding_backward(dwte, dpos, g, ids, B, n, C, vocab_begin, rows); });
    }
  }
};

}  // namespace fived
