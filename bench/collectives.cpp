// Collective benchmark on the host thread backend: every rank is a thread,
// collectives go through shared memory. Prints one table for 2, 4 and 8 ranks
// (--ranks to change). bench/collectives_nccl is the same on NCCL.

#include <chrono>
#include <cstdio>
#include <exception>
#include <span>
#include <utility>
#include <vector>

#include "collective_bench.hpp"
#include "fived/comm/host.hpp"

namespace {

// Host memory; a collective has finished when the call returns.
struct HostMemory {
  template <class T>
  struct Buffer {
    std::vector<T> data;
    std::span<T> span() { return data; }
  };
  template <class T>
  Buffer<T> buffer(std::size_t n) {
    return {std::vector<T>(n, T(1))};
  }
  template <class C, class Op>
  double time_us(C&, Op&& op) {
    const auto start = std::chrono::steady_clock::now();
    op();
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  }
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const auto options = fived::bench::parse_options(argc, argv);
    fived::bench::print_header("host threads (fived::host)", fived::bench::host_description(), options);
    for (int n : options.ranks) {
      std::vector<fived::bench::Row> rows;
      fived::host::run(n, [&](fived::host::Comm& world) {
        HostMemory memory;
        auto mine = fived::bench::run(world, options, memory);
        if (world.rank() == 0) rows = std::move(mine);
      });
      fived::bench::print_rows(rows);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collectives: %s\n", e.what());
    return 1;
  }
}
