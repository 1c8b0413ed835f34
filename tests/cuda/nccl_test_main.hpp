#pragma once
// main() of a multi-process CUDA test (started by scripts/launch-local.sh): skip without a
// GPU, join the launch's NCCL world, run the doctest cases. The world lives in main, so
// it is destroyed before main returns, while CUDA is still up; a test case makes its own
// communicators from it with split() (world().split(0, world().rank(), "world")).

#include <doctest/doctest.h>

#include <cstdio>
#include <exception>

#include "fived/comm/nccl.hpp"
#include "fived/comm/nccl_bootstrap.hpp"
#include "gpu_support.hpp"

namespace fived::test {

inline nccl::Comm*& world_slot() {
  static nccl::Comm* w = nullptr;
  return w;
}
inline nccl::Comm& world() { return *world_slot(); }

inline int nccl_doctest_main(int argc, char** argv, const char* name) {
  if (gpu_count() == 0) {
    std::printf("%s: no CUDA device, skipping\n", name);
    return skip_code;
  }
  try {
    nccl::Comm w = nccl::init_world();
    world_slot() = &w;
    doctest::Context ctx;
    ctx.applyCommandLine(argc, argv);
    const int rc = ctx.run();
    world_slot() = nullptr;
    return rc;
  } catch (const std::exception& e) {
    std::printf("%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace fived::test
