// Collective benchmark on NCCL. The world comes from the launch environment
// (fived::nccl::init_world): run it alone for a world of one, or as several
// processes, e.g. on one GPU (slow loopback sockets, but real NCCL):
//   scripts/launch-local.sh 4 build/bench/collectives_nccl
// Only rank 0 prints.

#include <cuda_runtime.h>

#include <cstdio>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "collective_bench.hpp"
#include "fived/comm/nccl_bootstrap.hpp"

namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device memory; a collective is timed with events on the compute stream,
// which the communicator orders every collective against.
struct DeviceMemory {
  template <class T>
  class Buffer {
   public:
    explicit Buffer(std::size_t n) : n_(n) {
      cuda_check(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)), "cudaMalloc");
      cuda_check(cudaMemset(p_, 0, n * sizeof(T)), "cudaMemset");
    }
    Buffer(Buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
    Buffer(const Buffer&) = delete;
    ~Buffer() {
      if (p_ != nullptr) cudaFree(p_);
    }
    std::span<T> span() { return {p_, n_}; }

   private:
    T* p_ = nullptr;
    std::size_t n_;
  };

  DeviceMemory() {
    cuda_check(cudaEventCreate(&start), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~DeviceMemory() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }

  template <class T>
  Buffer<T> buffer(std::size_t n) {
    return Buffer<T>(n);
  }
  double time_us(fived::nccl::Comm& comm, auto&& op) {
    cuda_check(cudaEventRecord(start, comm.compute_stream()), "cudaEventRecord");
    op();
    cuda_check(cudaEventRecord(stop, comm.compute_stream()), "cudaEventRecord");
    comm.synchronize();
    cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return 1e3 * ms;
  }

  cudaEvent_t start = nullptr, stop = nullptr;
};

std::string gpu_description(int device) {
  cudaDeviceProp p{};
  cuda_check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  int nccl = 0;
  ncclGetVersion(&nccl);
  return std::string(p.name) + " (device " + std::to_string(device) + "), NCCL " + std::to_string(nccl);
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0;
  try {
    const auto options = fived::bench::parse_options(
        argc, argv, "(--ranks is ignored: the world size is the launch's)\n");
    auto world = fived::nccl::init_world();
    rank = world.rank();
    DeviceMemory memory;
    auto rows = fived::bench::run(world, options, memory);
    if (rank == 0) {
      fived::bench::print_header("NCCL (fived::nccl), " + std::to_string(world.size()) + " processes",
                                 fived::bench::host_description() + "; " + gpu_description(world.device()), options);
      fived::bench::print_rows(rows);
    }
    world.barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collectives_nccl: rank %d: %s\n", rank, e.what());
    return 1;
  }
}
