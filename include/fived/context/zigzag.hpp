#pragma once
// Context parallelism's sequence split, zig-zag (head-tail): each sequence of T tokens is
// cut into 2·CP chunks of T / (2·CP), and CP rank r keeps chunks r and 2·CP-1-r, back to
// back. Under a causal mask the early chunks attend to few keys and the late ones to many;
// pairing one of each gives every rank the same attention work (a plain split into CP
// pieces leaves the last rank CP times the first one's). Position ids follow the chunks.
//
//   using split = ZigZag<4>;                         // 8 chunks of T/8
//   split::local_tokens(ids, B, T, rank, local);     // [B, T/4]: this rank's two chunks per row
//   split::local_positions(T, rank, pos);            // their positions in the sequence
//   split::causal_work(rank)                         // attention blocks rank computes (equal)
//
// The work figure counts, over the CP steps of a ring that brings every rank's keys and
// values to every rank, the (query chunk, key chunk) blocks a rank computes: a block in the
// causal past counts 1, the diagonal block 1/2 (half of it is masked), a block in the future
// 0 (skipped). contiguous_work(r) is the same for the plain split (rank r holds the r-th
// piece of CP), to compare.

#include <array>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>

namespace fived {

template <int CP>
struct ZigZag {
  static_assert(CP >= 1, "ZigZag<CP>: the context-parallel extent must be at least 1");
  static constexpr int chunks = 2 * CP;

  // Chunks of rank r, in the order they sit in its local sequence.
  static constexpr std::array<int, 2> chunks_of(int r) { return {r, chunks - 1 - r}; }

  // Tokens per chunk; T must divide into 2·CP chunks (the error says so where the batch is
  // made).
  static int chunk_length(int T) {
    if (T < chunks || T % chunks != 0)
      throw std::invalid_argument("context parallelism over CP = " + std::to_string(CP) +
                                  " cuts every sequence into 2 x CP = " + std::to_string(chunks) +
                                  " equal chunks, and the sequence length " + std::to_string(T) +
                                  " is not a multiple of " + std::to_string(chunks) +
                                  ": pad or crop the sequences to a multiple of " + std::to_string(chunks));
    return T / chunks;
  }

  // Position in the sequence of local token j (0 <= j < T / CP) of rank r.
  static int position(int r, int j, int T) {
    const int n = chunk_length(T);
    return chunks_of(r)[static_cast<std::size_t>(j / n)] * n + j % n;
  }

  // This rank's tokens of a [B, T] batch: [B, T / CP], its two chunks back to back per row.
  template <class Id>
  static void local_tokens(std::span<const Id> ids, int B, int T, int r, std::span<Id> local) {
    const int n = chunk_length(T);
    if (ids.size() != static_cast<std::size_t>(B) * T || local.size() != static_cast<std::size_t>(B) * (T / CP))
      throw std::invalid_argument("ZigZag::local_tokens: a [B, T] batch and a [B, T / CP] local buffer are needed (B = " +
                                  std::to_string(B) + ", T = " + std::to_string(T) + ", CP = " + std::to_string(CP) + ")");
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < 2 * n; ++j)
        local[static_cast<std::size_t>(b) * (2 * n) + j] = ids[static_cast<std::size_t>(b) * T + position(r, j, T)];
  }

  // The positions of this rank's T / CP tokens (the position embedding's rows).
  static void local_positions(int T, int r, std::span<int> pos) {
    if (pos.size() != static_cast<std::size_t>(T / CP))
      throw std::invalid_argument("ZigZag::local_positions: needs T / CP = " + std::to_string(T / CP) + " entries");
    for (int j = 0; j < static_cast<int>(pos.size()); ++j) pos[static_cast<std::size_t>(j)] = position(r, j, T);
  }

  // Causal attention work of rank r, in chunk blocks (see the top of this file).
  static constexpr double causal_work(int r) {
    double w = 0;
    for (int s = 0; s < CP; ++s)  // the keys and values of every rank come by
      for (int q : chunks_of(r))
        for (int k : chunks_of(s)) w += block(q, k);
    return w;
  }
  // The same for the plain split: rank r holds piece r of CP (chunks 2r and 2r + 1).
  static constexpr double contiguous_work(int r) {
    double w = 0;
    for (int s = 0; s < CP; ++s)
      for (int q : {2 * r, 2 * r + 1})
        for (int k : {2 * s, 2 * s + 1}) w += block(q, k);
    return w;
  }

 private:
  static constexpr double block(int q, int k) { return k < q ? 1.0 : k == q ? 0.5 : 0.0; }
};

}  // namespace fived
