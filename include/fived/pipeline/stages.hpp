#pragma once
// Shape: how many ranks, micro-batches and model chunks a schedule has, and
// which (rank, chunk) holds which virtual stage.
//
// The model is cut into P·V consecutive virtual stages; every rank holds V of
// them (its chunks). Two layouts:
//
//   looped (Megatron's interleaving; V = 1 is plain pipelining):
//     chunk c of rank r is stage c·P + r, so activations go round the ranks
//     0, 1, .., P-1, 0, 1, .. once per chunk.
//   vee (ZB-V, DualPipeV; exactly two chunks):
//     chunk 0 of rank r is stage r and chunk 1 is stage 2P-1-r: down the ranks
//     and back up, so rank P-1 holds stages P-1 and P (no message between
//     them) and rank 0 holds the first and the last stage.

namespace fived::pipeline {

enum class StageOrder : unsigned char { looped, vee };

constexpr const char* stage_order_name(StageOrder o) { return o == StageOrder::looped ? "looped" : "vee"; }

struct Shape {
  int ranks = 1;          // P: pipeline ranks
  int micro_batches = 1;  // M
  int chunks = 1;         // V: model chunks per rank
  StageOrder order = StageOrder::looped;

  constexpr int stages() const { return ranks * chunks; }
  constexpr bool valid() const {
    return ranks >= 1 && micro_batches >= 1 && chunks >= 1 && (order == StageOrder::looped || chunks == 2);
  }

  constexpr int stage(int rank, int chunk) const {
    if (order == StageOrder::vee && chunk == 1) return 2 * ranks - 1 - rank;
    return chunk * ranks + rank;
  }
  constexpr int rank_of(int stage) const {
    if (order == StageOrder::vee && stage >= ranks) return 2 * ranks - 1 - stage;
    return stage % ranks;
  }
  constexpr int chunk_of(int stage) const { return stage / ranks; }

  // Whether the stage next to (rank, chunk) exists and lives on another rank,
  // i.e. whether a message crosses between them.
  constexpr bool sends_forward(int rank, int chunk) const {
    const int s = stage(rank, chunk);
    return s + 1 < stages() && rank_of(s + 1) != rank;
  }
  constexpr bool sends_backward(int rank, int chunk) const {
    const int s = stage(rank, chunk);
    return s > 0 && rank_of(s - 1) != rank;
  }

  friend constexpr bool operator==(const Shape&, const Shape&) = default;
};

namespace detail {

// Each (rank, chunk)'s neighbouring stages, numbered rank · V + chunk, into the
// arrays w.next and w.prev (-1: none). The proofs' inner loops look these up
// rather than call Shape's functions: inside the compiler a function call costs
// as much as a dozen array reads.
template <class W>
constexpr void stage_neighbours(const Shape& sh, W& w) {
  for (int r = 0, c = 0, i = 0, s = 0; r < sh.ranks; ++r)
    for (c = 0; c < sh.chunks; ++c) {
      i = r * sh.chunks + c, s = sh.stage(r, c);
      w.next[i] = s + 1 < sh.stages() ? sh.rank_of(s + 1) * sh.chunks + sh.chunk_of(s + 1) : -1;
      w.prev[i] = s > 0 ? sh.rank_of(s - 1) * sh.chunks + sh.chunk_of(s - 1) : -1;
    }
}

}  // namespace detail

}  // namespace fived::pipeline
