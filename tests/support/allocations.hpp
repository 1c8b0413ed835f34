#pragma once
// Buffers a host run allocates step by step, counted over every rank: the counter is
// process-wide, so barriers fence each count and rank 0 reads it.
//
//   const test::Allocations a = test::allocations_by_step(world, 6, [&](int s) { dp.step(...); });
//   if (world.rank() == 0) ...  a.first: during step 0, a.later: during steps 1..5

#include <cstddef>

#include "fived/device/buffer.hpp"

namespace fived::test {

struct Allocations {
  std::size_t first = 0, later = 0;
};

template <class World, class Step>
Allocations allocations_by_step(World& world, int steps, Step&& step) {
  std::size_t at_start = 0, after_first = 0, after_last = 0;
  auto count = [&](std::size_t& into) {
    world.barrier();
    if (world.rank() == 0) into = buffer_allocations<Host>().load();
    world.barrier();
  };
  count(at_start);
  for (int s = 0; s < steps; ++s) {
    step(s);
    if (s == 0) count(after_first);
  }
  count(after_last);
  return {after_first - at_start, after_last - after_first};
}

}  // namespace fived::test
