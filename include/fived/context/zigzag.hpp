#pragma once
// Context parallelism's sequence split, and the attention blocks of its ring.
//
// Each sequence of T tokens is cut into 2·CP chunks of n = T / (2·CP), and CP rank r keeps
// two of them. ZigZag<CP> (head-tail) gives rank r chunks r and 2·CP-1-r: under a causal
// mask the early chunks attend to few keys and the late ones to many, and pairing one of
// each gives every rank the same attention work. ContiguousSplit<CP> (rank r keeps chunks
// 2r and 2r+1, the plain split into CP pieces) is here to compare: its last rank does
// about 2·CP times the first one's work.
//
//   using split = ZigZag<4>;                             // 8 chunks of T/8
//   split::local_tokens(ids, B, T, rank, local);         // [2, B, n]: this rank's chunks
//   split::local_positions(T, rank, pos);                // their positions, in that order
//   ring_blocks<split>(rank, step)                       // the blocks of one ring step
//   causal_work<split>(rank)                             // all of them, in blocks
//
// Local layout: chunk-major, [2, B, n] (both ranks' chunk 0 of every sequence, then chunk
// 1), so each chunk of the batch is one contiguous [B, n] block: attention and the position
// embedding take it as a batch of B sequences of n, with no gather. Per-token layers do not
// care about the order of the tokens.
//
// The ring: at step s (0 <= s < CP) rank r holds the keys and values of rank (r - s) mod
// CP. Its query chunk q meets key chunk k as a full block when k < q (the past), the
// causal diagonal block when k == q, and not at all when k > q (the future: skipped).

#include <array>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>

namespace fived {

namespace detail {
template <int CP>
struct SplitBase {
  static_assert(CP >= 1, "the context-parallel extent must be at least 1");
  static constexpr int cp = CP, chunks = 2 * CP;

  // Tokens per chunk; T must cut into 2·CP chunks (the error says so where the batch is
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
};
}  // namespace detail

template <int CP>
struct ZigZag : detail::SplitBase<CP> {
  // Chunks of rank r, in the order they sit in its local batch.
  static constexpr std::array<int, 2> chunks_of(int r) { return {r, 2 * CP - 1 - r}; }
};
template <int CP>
struct ContiguousSplit : detail::SplitBase<CP> {
  static constexpr std::array<int, 2> chunks_of(int r) { return {2 * r, 2 * r + 1}; }
};

// What a split offers over its chunks_of: local tokens and positions.
template <class Split>
struct LocalSequence {
  static constexpr int cp = Split::cp;

  // Position in the sequence of local token j (0 <= j < T / CP, chunk j / n) of rank r.
  static int position(int r, int j, int T) {
    const int n = Split::chunk_length(T);
    return Split::chunks_of(r)[static_cast<std::size_t>(j / n)] * n + j % n;
  }

  // This rank's tokens of a [B, T] batch, chunk-major: local[(c*B + b)*n + j] is token
  // chunks_of(r)[c]*n + j of row b.
  template <class Id>
  static void local_tokens(std::span<const Id> ids, int B, int T, int r, std::span<Id> local) {
    const int n = Split::chunk_length(T);
    if (ids.size() != static_cast<std::size_t>(B) * T || local.size() != static_cast<std::size_t>(B) * (T / cp))
      throw std::invalid_argument("local_tokens: a [B, T] batch and a [B, T / CP] local buffer are needed (B = " +
                                  std::to_string(B) + ", T = " + std::to_string(T) + ", CP = " + std::to_string(cp) +
                                  ")");
    const std::size_t sn = static_cast<std::size_t>(n);
    for (std::size_t c = 0; c < 2; ++c)
      for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
        for (std::size_t j = 0; j < sn; ++j)
          local[(c * static_cast<std::size_t>(B) + b) * sn + j] =
              ids[b * static_cast<std::size_t>(T) + static_cast<std::size_t>(Split::chunks_of(r)[c]) * sn + j];
  }

  // The positions of this rank's T / CP tokens of one sequence (chunk 0's, then chunk 1's).
  static void local_positions(int T, int r, std::span<int> pos) {
    if (pos.size() != static_cast<std::size_t>(T / cp))
      throw std::invalid_argument("local_positions: needs T / CP = " + std::to_string(T / cp) + " entries");
    for (int j = 0; j < static_cast<int>(pos.size()); ++j) pos[static_cast<std::size_t>(j)] = position(r, j, T);
  }
};

// One attention block of a ring step: local query chunk q (0 or 1) against chunk k (0 or 1)
// of the keys and values held at that step.
struct RingBlock {
  int q = 0, k = 0;
  bool causal = false;  // the diagonal block; otherwise full
};
struct RingStep {
  std::array<RingBlock, 4> blocks{};
  int count = 0;
};

// The blocks rank r computes at ring step s, in the order it computes them.
template <class Split>
constexpr RingStep ring_blocks(int r, int s) {
  const int owner = ((r - s) % Split::cp + Split::cp) % Split::cp;
  RingStep step;
  for (int q = 0; q < 2; ++q)
    for (int k = 0; k < 2; ++k) {
      const int qc = Split::chunks_of(r)[static_cast<std::size_t>(q)];
      const int kc = Split::chunks_of(owner)[static_cast<std::size_t>(k)];
      if (kc <= qc) step.blocks[static_cast<std::size_t>(step.count++)] = {q, k, kc == qc};
    }
  return step;
}

// Rank r's attention work over the whole ring, in chunk blocks: a full block counts 1, a
// causal one 1/2 (half of it is masked).
template <class Split>
constexpr double causal_work(int r) {
  double w = 0;
  for (int s = 0; s < Split::cp; ++s) {
    const RingStep step = ring_blocks<Split>(r, s);
    for (int i = 0; i < step.count; ++i) w += step.blocks[static_cast<std::size_t>(i)].causal ? 0.5 : 1.0;
  }
  return w;
}

}  // namespace fived
