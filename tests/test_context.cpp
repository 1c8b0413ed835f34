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

using fived::ZigZag;

namespace {

// Every rank computes the same number of attention blocks under zig-zag: 2·CP (a total of
// (2·CP)^2 / 2 over CP ranks), and the plain split does not: rank r computes 4r + 2.
template <int CP>
constexpr bool balanced() {
  for (int r = 0; r < CP; ++r)
    if (ZigZag<CP>::causal_work(r) != 2.0 * CP) return false;
  return true;
}
template <int CP>
constexpr bool plain_split_is_not() {
  return ZigZag<CP>::contiguous_work(0) == 2.0 && ZigZag<CP>::contiguous_work(CP - 1) == 4.0 * CP - 2.0;
}
static_assert(balanced<1>() && balanced<2>() && balanced<3>() && balanced<4>() && balanced<8>());
static_assert(plain_split_is_not<2>() && plain_split_is_not<4>() && plain_split_is_not<8>());
static_assert(ZigZag<4>::chunks_of(0) == std::array<int, 2>{0, 7} && ZigZag<4>::chunks_of(3) == std::array<int, 2>{3, 4});

template <int CP>
void covers_every_position_once(int T) {
  std::vector<int> seen(static_cast<std::size_t>(T), 0), pos(static_cast<std::size_t>(T / CP));
  for (int r = 0; r < CP; ++r) {
    ZigZag<CP>::local_positions(T, r, pos);
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
  ZigZag<2>::local_positions(12, 1, pos);  // chunks 1 and 2 of 4 chunks of 3
  CHECK(pos == std::vector<int>{3, 4, 5, 6, 7, 8});
  ZigZag<2>::local_positions(12, 0, pos);  // chunks 0 and 3
  CHECK(pos == std::vector<int>{0, 1, 2, 9, 10, 11});
}

TEST_CASE("zig-zag: a batch's local tokens follow the positions, row by row") {
  constexpr int B = 2, T = 8;
  std::vector<int> ids(B * T), local(B * T / 2);
  std::iota(ids.begin(), ids.end(), 100);
  ZigZag<2>::local_tokens<int>(ids, B, T, 1, local);  // chunks 1 and 2 of 4 chunks of 2
  CHECK(local == std::vector<int>{102, 103, 104, 105, 110, 111, 112, 113});
}

TEST_CASE("zig-zag: a sequence length that does not cut into 2·CP chunks is an error that says so") {
  std::vector<int> pos(5);
  CHECK_THROWS_WITH_AS(ZigZag<2>::local_positions(10, 0, pos),
                       "context parallelism over CP = 2 cuts every sequence into 2 x CP = 4 equal chunks, and the "
                       "sequence length 10 is not a multiple of 4: pad or crop the sequences to a multiple of 4",
                       std::invalid_argument);
  std::vector<int> ids(16), local(3);
  CHECK_THROWS_AS(ZigZag<2>::local_tokens<int>(ids, 2, 8, 0, local), std::invalid_argument);
}
