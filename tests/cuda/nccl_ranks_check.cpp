// One rank of a multi-process NCCL check: joins the world through
// init_world() (torchrun-style variables or mpirun), runs every collective on
// rank-valued integers over the world and over a split, and exits 0 when all
// results are exact. Exits 77 (skipped) without a GPU. Started by
// launch-local.sh, which gives each process its own NCCL_HOSTID so that
// several ranks can share one GPU.

#include <cstdio>
#include <exception>

#include "collective_checks.hpp"
#include "fived/comm/bootstrap.hpp"
#include "fived/comm/nccl_bootstrap.hpp"
#include "gpu_support.hpp"

int main() {
  if (fived::test::gpu_count() == 0) {
    std::puts("nccl_ranks_check: no CUDA device found, skipping (exit 77)");
    return fived::test::skip_code;
  }
  int rank = -1;
  try {
    rank = fived::launch_env().rank;
    fived::nccl::Comm world = fived::nccl::init_world();
    fived::test::check_collectives(world);
    fived::test::check_split(world);
    world.barrier();
    std::printf("nccl_ranks_check: rank %d of %d: all collectives exact\n", world.rank(), world.size());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_ranks_check: rank %d FAILED: %s\n", rank, e.what());
    return 1;
  }
}
