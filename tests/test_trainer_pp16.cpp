// The Trainer on a 16-stage pipeline of 64 micro-batches compiles (issue 34): the schedule's
// table is proven inside the compiler at its default limits, and every member of the Trainer
// for that mesh and schedule (its 16 stage models, step and executor) is instantiated below.
// Compiling this file is the test; the case only reads the proven figures back.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "fived/fived.hpp"

using namespace fived;

namespace {
struct sixteen_blocks : gpt_config {
  static constexpr int layers = 16, d_model = 32, heads = 2, vocab = 64, max_seq = 16, vocab_multiple = 16;
  static constexpr bool tied = false;
};
using Model = GPT<sixteen_blocks, Mesh<PP<16>>, float, Host>;
using Schedule = pipeline::OneFOneB<16, 64>;
}  // namespace

template class fived::Trainer<Model, NoZeRO, Schedule>;

TEST_CASE("a Trainer with a PP 16 schedule of 64 micro-batches: its table is proven and its figures exact") {
  CHECK(Schedule::figures.makespan == 3 * (64 + 16 - 1));                        // (M + P - 1)(F + B)
  CHECK(Schedule::figures.idle * (64 + 16 - 1) == Schedule::figures.rank_time * 15);  // bubble (P - 1) / (M + P - 1)
  for (int r = 0; r < 16; ++r) CHECK(Schedule::figures.peak_activations[static_cast<std::size_t>(r)] == 16 - r);
}
