// Pipeline parallelism: where the layers go (pipeline/stage_layers.hpp).

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>

#include "fived/pipeline/stage_layers.hpp"

using namespace fived;

namespace {

struct eight : gpt_config {
  static constexpr int layers = 8, d_model = 32, heads = 4, vocab = 53, max_seq = 16, vocab_multiple = 16;
  static constexpr bool tied = false;
};
// A vocabulary so large that the head costs about 3 blocks: 2*C*Vp = 2*32*1152 vs 24*C^2 = 24576.
struct big_vocab : eight {
  static constexpr int vocab = 1100, vocab_multiple = 128;
};

// Uniform costs: equal parts, the remainder on the first parts.
using U4 = StageLayers<eight, 4, UniformCost>;
static_assert(U4::bounds == std::array<int, 5>{0, 2, 4, 6, 8});
using U3 = StageLayers<eight, 3, UniformCost>;
static_assert(U3::count(0) + U3::count(1) + U3::count(2) == 8 && U3::cost_of(0) <= 3 && U3::cost_of(1) <= 3 &&
              U3::cost_of(2) <= 3);
// FLOP costs: the head weighs 3 blocks here, so the last part gets fewer blocks.
using F4 = StageLayers<big_vocab, 4>;
static_assert(FlopCost<big_vocab>::head() == 3.0 * FlopCost<big_vocab>::block());
static_assert(F4::count(3) == 1 && F4::count(0) + F4::count(1) + F4::count(2) == 7);
static_assert(F4::cost_of(3) == 4 * FlopCost<big_vocab>::block(), "the slowest part: 1 block + the head");
// Even: equal parts whatever the cost.
using E4 = StageLayers<big_vocab, 4, FlopCost, true>;
static_assert(E4::bounds == std::array<int, 5>{0, 2, 4, 6, 8});
// One part is the whole model.
static_assert(StageLayers<eight, 1>::bounds == std::array<int, 2>{0, 8});
static_assert(std::is_same_v<U4::part<1>, Layers<2, 2>> && std::is_same_v<F4::part<3>, Layers<7, 1>>);

// The most expensive part is the least possible: no other cut of 8 blocks into 4 does better.
template <class S, int Parts>
double brute_force_best() {
  double best = 1e300;
  for (int a = 1; a < 8; ++a)
    for (int b = a + 1; b < 8; ++b)
      for (int c = b + 1; c < 8; ++c) {
        const int bounds[] = {0, a, b, c, 8};
        double worst = 0;
        for (int p = 0; p < Parts; ++p) {
          const double cost = (bounds[p + 1] - bounds[p]) * FlopCost<big_vocab>::block() +
                              (p == Parts - 1 ? FlopCost<big_vocab>::head() : 0.0);
          worst = std::max(worst, cost);
        }
        best = std::min(best, worst);
      }
  return best;
}

}  // namespace

TEST_CASE("stage layers: the balanced cut is optimal") {
  double worst = 0;
  for (int p = 0; p < 4; ++p) worst = std::max(worst, F4::cost_of(p));
  CHECK(worst == brute_force_best<F4, 4>());
}
