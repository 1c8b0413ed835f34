#pragma once
// Each local row's position in its sequence, for rotary embeddings: rows come chunk by chunk
// (chunk-major, as nn/stream.hpp lays them out), rows_per_chunk each (B sequences of
// chunk_length rows), chunk c starting at position first[c]. One chunk for a whole
// sequence; two under context parallelism's zig-zag split (context/zigzag.hpp).

#include <cstddef>

namespace fived {

struct RowPositions {
  int rows_per_chunk = 0, chunk_length = 1;
  int first[2] = {0, 0};
  // Row r's position (r < 2 rows_per_chunk).
  constexpr int operator()(std::size_t r) const {
    const std::size_t c = r / static_cast<std::size_t>(rows_per_chunk);
    return first[c] + static_cast<int>(r % static_cast<std::size_t>(chunk_length));
  }
};

}  // namespace fived
