// MeshContext over the NCCL communicator (move-only) at world size 1: every
// group communicator exists, orders against a stream of the caller's, and
// reduces. Skips (77) without a GPU; several ranks run in nccl_ranks_*.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "fived/comm/nccl.hpp"
#include "fived/comm/nccl_bootstrap.hpp"
#include "fived/mesh/context.hpp"
#include "gpu_support.hpp"

int main() {
  using namespace fived;
  if (test::gpu_count() == 0) {
    std::puts("test_nccl_mesh_context: no CUDA device found, skipping (exit 77)");
    return test::skip_code;
  }
  try {
    auto ctx = make_mesh_context<Mesh<>>(nccl::init_world(LaunchEnv{}));
    cudaStream_t stream{};
    test::cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
    ctx.for_each_comm([&](nccl::Comm& c) { c.set_compute_stream(stream); });

    int failures = 0;
    auto check = [&](nccl::Comm& c) {
      test::DeviceBuffer<int> buf(std::vector<int>{41}, stream);
      c.all_reduce<int>(buf.span(), ReduceOp::sum);
      if (c.size() != 1 || buf.download(stream) != std::vector<int>{41}) {
        std::printf("group '%s': size %d, wrong all_reduce result\n", c.name().c_str(), c.size());
        ++failures;
      }
    };
    ctx.for_each_comm(check);
    check(ctx.comm<Axis::tp>());
    check(ctx.comm<Mesh<>::grad_group>());
    test::cuda_check(cudaStreamDestroy(stream), "cudaStreamDestroy");
    std::printf("test_nccl_mesh_context: %s\n", failures == 0 ? "passed" : "FAILED");
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("test_nccl_mesh_context: %s\n", e.what());
    return 1;
  }
}
