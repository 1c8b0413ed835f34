// Context parallelism: the zig-zag sequence split (context/zigzag.hpp).

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <span>
#include <stdexcept>
#include <utility>
#include <vector>

#include "fived/context/zigzag.hpp"

using fived::causal_work;
using fived::ContiguousSplit;
using fived::LocalSequence;
using fived::ZigZag;

namespace {

// Every rank computes the same attention work under zig-zag: 2·CP chunk blocks (a total of
// (2·CP)^2 / 2 over CP ranks), and the plain split does not: rank r computes 4r + 2. The
// work is counted from ring_blocks, the list the ring attention layer computes.
template <int CP>
constexpr bool balanced() {
  for (int r = 0; r < CP; ++r)
    if (causal_work<ZigZag<CP>>(r) != 2.0 * CP) return false;
  return true;
}
template <int CP>
constexpr bool plain_split_is_not() {
  return causal_work<ContiguousSplit<CP>>(0) == 2.0 && causal_work<ContiguousSplit<CP>>(CP - 1) == 4.0 * CP - 2.0;
}
// Block calls: at step 0 every zig-zag rank computes 3 (its two diagonals, and its tail chunk
// against its head chunk), and 2 full blocks at every later step: 3 + 2 (CP - 1) on every rank.
template <int CP>
constexpr int block_calls(int r) {
  int n = 0;
  for (int s = 0; s < CP; ++s) n += fived::ring_blocks<ZigZag<CP>>(r, s).count;
  return n;
}
static_assert(block_calls<4>(0) == block_calls<4>(1) && block_calls<4>(1) == block_calls<4>(3) &&
              block_calls<4>(0) == 3 + 2 * 3);
static_assert(balanced<1>() && balanced<2>() && balanced<3>() && balanced<4>() && balanced<8>());
static_assert(plain_split_is_not<2>() && plain_split_is_not<4>() && plain_split_is_not<8>());
static_assert(ZigZag<4>::chunks_of(0) == std::array<int, 2>{0, 7} && ZigZag<4>::chunks_of(3) == std::array<int, 2>{3, 4});

template <int CP>
void covers_every_position_once(int T) {
  std::vector<int> seen(static_cast<std::size_t>(T), 0), pos(static_cast<std::size_t>(T / CP));
  for (int r = 0; r < CP; ++r) {
    LocalSequence<ZigZag<CP>>::local_positions(T, r, pos);
    CHECK(std::is_sorted(pos.begin(), pos.end()));  // head chunk, then tail chunk
    for (int p : pos) ++seen[static_cast<std::size_t>(p)];
  }
  CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
}

}  // namespace

TEST_CASE("zig-zag: every position on exactly one rank, head and tail chunks, work balanced") {
  covers_every_position_once<1>(8);
  covers_every_position_once<2>(12);  // not a power of two
  covers_every_position_once<4>(64);
  std::vector<int> pos(6);
  LocalSequence<ZigZag<2>>::local_positions(12, 1, pos);  // chunks 1 and 2 of 4 chunks of 3
  CHECK(pos == std::vector<int>{3, 4, 5, 6, 7, 8});
  LocalSequence<ZigZag<2>>::local_positions(12, 0, pos);  // chunks 0 and 3
  CHECK(pos == std::vector<int>{0, 1, 2, 9, 10, 11});
}

TEST_CASE("zig-zag: a batch's local tokens, chunk-major ([2, B, n])") {
  constexpr int B = 2, T = 8;
  std::vector<int> ids(B * T), local(B * T / 2);
  std::iota(ids.begin(), ids.end(), 100);  // row 0: 100..107, row 1: 108..115
  LocalSequence<ZigZag<2>>::local_tokens<int>(ids, B, T, 1, local);  // chunks 1 and 2 of 4 chunks of 2
  CHECK(local == std::vector<int>{102, 103, 110, 111, 104, 105, 112, 113});
}

TEST_CASE("zig-zag: a sequence length that does not cut into 2·CP chunks is an error that says so") {
  std::vector<int> pos(5);
  CHECK_THROWS_WITH_AS(LocalSequence<ZigZag<2>>::local_positions(10, 0, pos),
                       "context parallelism over CP = 2 cuts every sequence into 2 x CP = 4 equal chunks, and the "
                       "sequence length 10 is not a multiple of 4: pad or crop the sequences to a multiple of 4",
                       std::invalid_argument);
  std::vector<int> ids(16), local(3);
  CHECK_THROWS_AS(LocalSequence<ZigZag<2>>::local_tokens<int>(ids, 2, 8, 0, local), std::invalid_argument);
}
