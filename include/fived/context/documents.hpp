#pragma once
// Documents packed into one row (block-causal attention): a token attends only to the
// earlier tokens of its own document, as Megatron's reset_attention_mask and torchtitan's
// block_causal mask do, so packing short documents into full rows costs no cross-talk.
//
// A model whose configuration names an end_of_document token id (nn/config.hpp) marks each
// row's documents by it: that token is the last of its document, and the token after it
// starts the next. Positions are not reset (the position embedding and rotary angles see a
// token's place in the row, as torchtitan's); attention alone is confined.
//
//   document_starts(ids, B, T, eod, first)   first[b T + t]: where t's document begins
//   DocumentMask{first, key_position}        what an attention block reads of it
//
// The kernels take the mask per block: a query row sees key j of the block only when the
// key's position (key_position + j) is at or after its document's first position; with
// no `first` there are no documents (plain causal attention). Because the first positions
// never decrease along a row, the queries a key tile serves, and the keys a query tile
// reads, are ranges: the device kernels skip whole tiles outside them.

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>

namespace fived {

// Where each token's document begins: first[b T + t] is one past the last end-of-document
// token before position t of row b (0 when there is none). Host memory; T >= 1.
inline void document_starts(std::span<const int> ids, int B, int T, int end_of_document, std::span<int> first) {
  const std::size_t sT = static_cast<std::size_t>(T), n = static_cast<std::size_t>(B) * sT;
  if (B < 0 || T < 1 || ids.size() != n || first.size() != n)
    throw std::invalid_argument("fived::document_starts: needs [B, T] ids and a [B, T] output (B = " + std::to_string(B) +
                                ", T = " + std::to_string(T) + ", got " + std::to_string(ids.size()) + " and " +
                                std::to_string(first.size()) + ")");
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b) {
    int start = 0;
    for (std::size_t t = 0; t < sT; ++t) {
      first[b * sT + t] = start;
      if (ids[b * sT + t] == end_of_document) start = static_cast<int>(t) + 1;
    }
  }
}

// Which keys of an attention block each query row's document holds: query row r (rows as
// the block's queries are laid out, [B, n]) sees key j only when key_position + j >=
// first[r]. first == nullptr: no documents. Device memory for the device's kernels, which
// call first_key too. Hashed by its bytes where a step is captured (util/call_hash.hpp): no
// padding.
struct DocumentMask {
  const int* first = nullptr;
  std::ptrdiff_t key_position = 0;

  // The first of a block's `keys` keys that query row r sees, in [0, keys]: 0 without
  // documents, keys when it sees none of them.
#if defined(__CUDACC__)
  __host__ __device__
#endif
  constexpr int first_key(std::size_t r, int keys) const {
    if (first == nullptr) return 0;
    const std::ptrdiff_t f = first[r] - key_position;
    return f <= 0 ? 0 : f >= keys ? keys : static_cast<int>(f);
  }
};
static_assert(sizeof(DocumentMask) == sizeof(const int*) + sizeof(std::ptrdiff_t));

}  // namespace fived
