#pragma once
// CommQueue<T, Cuda>: the communication side of a step on a second CUDA stream (see
// train/comm_queue.hpp). Included by train/bucket_shards.hpp under nvcc.
//
// It runs Ops<T, Cuda> (nn/cuda/ops.hpp), which is device code: CommQueue<T, Cuda> is
// declared only when compiling with nvcc (a .cu file), like the kernels of kernels/cuda.hpp.
// From host-compiled C++ this header gives train/comm_queue.hpp and the device layer alone.

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
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

  // side: a stream of its own; without (a group of one rank), tasks go on the compute side.
  explicit CommQueue(ops_type& compute, bool side = true) : compute_ops_(compute), compute_(compute.stream()) {
    if (!side) return;
    side_.emplace();
    side_->follow_graph(compute);
    start_.emplace(cudaEventDisableTiming);
    tickets_.reserve(ring);
    for (int i = 0; i < ring; ++i) tickets_.emplace_back(cudaEventDisableTiming);
  }

  ops_type& ops() { return side_ ? *side_ : compute_ops_; }
  StreamHandle stream() const { return side_ ? side_->stream() : compute_; }

  // Issues task(ops()) on the side stream after everything the compute stream has queued so
  // far. Always enqueued (async or not: on a device the host never does the work itself).
  // Without a side, on the compute stream, in order. The events go through the model's Ops
  // (its queue): captured in a graph step, which they fork and join, and not recorded again
  // when it is replayed.
  template <class F>
  std::uint64_t submit(F&& task, bool /*async*/) {
    if (!side_) {
      std::forward<F>(task)(compute_ops_);
      return 0;
    }
    compute_ops_.queue("CommQueue::fork", [&] {
      start_->record(compute_);
      start_->wait_on(side_->stream());
    }, [] { return call_hash(); });
    std::forward<F>(task)(*side_);
    const std::uint64_t ticket = ++submitted_;
    submitted_in_graph_ = compute_ops_.in_graph_step();
    compute_ops_.queue("CommQueue::ticket", [&] { tickets_[ticket % ring].record(side_->stream()); },
                       [] { return call_hash(); });  // (the ticket's number is not the step's: not hashed)
    return ticket;
  }
  // The compute stream waits for the ticket's task. Tickets share `ring` events: a ticket
  // whose event a later task has re-recorded is covered by that later point of the same
  // stream, so the wait is never too short (at worst a little longer than needed). A ticket
  // at or before one already joined is covered by that join (one side stream, in order),
  // and is not waited on again. Every step ends with drain(), so a step never waits on an
  // event of an earlier step: a captured stream must not wait on an event recorded outside
  // its capture (the first capture would otherwise join the plain step's last ticket), and
  // an event last recorded by a graph is recorded by nothing when it is replayed. Plain,
  // captured and replayed steps make the same calls, as StepGraph requires.
  void wait(std::uint64_t ticket) {
    if (ticket == 0 || ticket <= joined_) return;
    compute_ops_.queue("CommQueue::join", [&] { tickets_[ticket % ring].wait_on(compute_); }, [] { return call_hash(); });
    joined_ = ticket;
  }
  void drain() { wait(submitted_); }
  // At a step's start: tickets not joined are a step's that ended without its drain (a throw,
  // or a graph step refused). Those of a plain step were recorded: waited for. Those of a
  // captured or replayed step were recorded inside a capture that was dropped, or not at all,
  // and nothing of theirs runs: forgotten (a wait on an event last recorded by a capture is
  // an error). Nothing to do after a step that ended well, so every step makes the same calls.
  void begin_step() {
    if (submitted_ == joined_) return;
    if (submitted_in_graph_) joined_ = submitted_;
    else drain();
  }

 private:
  static constexpr int ring = 64;
  ops_type& compute_ops_;
  cudaStream_t compute_;
  std::optional<ops_type> side_;  // its own stream and cuBLASLt handle
  std::optional<cuda::Event> start_;
  std::vector<cuda::Event> tickets_;
  std::uint64_t submitted_ = 0, joined_ = 0;  // the last ticket submitted, and the last the compute stream waited for
  bool submitted_in_graph_ = false;           // whether the last was submitted in a captured or replayed step
};

}  // namespace fived

#endif  // defined(__CUDACC__)
