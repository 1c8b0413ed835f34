#pragma once
// CommQueue<T, Cuda>: the communication side of a step on a second CUDA stream (see
// train/comm_queue.hpp). Included by train/bucket_shards.hpp under nvcc.
//
// It runs Ops<T, Cuda> (nn/cuda/ops.hpp), which is device code: CommQueue<T, Cuda> is
// declared only when compiling with nvcc (a .cu file), like the kernels of kernels/cuda.hpp.
// From host-compiled C++ this header gives train/comm_queue.hpp and the device layer alone.

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "fived/device/cuda.hpp"
#include "fived/train/comm_queue.hpp"

#if defined(__CUDACC__)
#include "fived/nn/cuda/ops.hpp"

namespace fived {

template <class T>
class CommQueue<T, Cuda> {
 public:
  using ops_type = Ops<T, Cuda>;

  explicit CommQueue(ops_type& compute) : compute_(compute.stream()), start_(cudaEventDisableTiming) {
    tickets_.reserve(ring);
    for (int i = 0; i < ring; ++i) tickets_.emplace_back(cudaEventDisableTiming);
  }

  ops_type& ops() { return side_; }
  StreamHandle stream() const { return side_.stream(); }

  // Issues task(ops()) on the side stream after everything the compute stream has queued so
  // far. Always enqueued (async or not: on a device the host never does the work itself).
  template <class F>
  std::uint64_t submit(F&& task, bool /*async*/) {
    start_.record(compute_);
    start_.wait_on(side_.stream());
    std::forward<F>(task)(side_);
    ++submitted_;
    tickets_[submitted_ % ring].record(side_.stream());
    return submitted_;
  }
  // The compute stream waits for the ticket's task. Tickets share `ring` events: a ticket
  // whose event a later task has re-recorded is covered by that later point of the same
  // stream, so the wait is never too short (at worst a little longer than needed).
  void wait(std::uint64_t ticket) {
    if (ticket != 0) tickets_[ticket % ring].wait_on(compute_);
  }
  void drain() { wait(submitted_); }

 private:
  static constexpr int ring = 64;
  cudaStream_t compute_;
  ops_type side_;  // its own stream and cuBLASLt handle
  cuda::Event start_;
  std::vector<cuda::Event> tickets_;
  std::uint64_t submitted_ = 0;
};

}  // namespace fived

#endif  // defined(__CUDACC__)
