#pragma once
// CommQueue<T, Device>: the communication side of a training step, where a trainer's
// reductions and gathers run while the model's compute goes on.
//
//   CommQueue<T, Device> q(model.ops());
//   grad_comm.set_compute_stream(q.stream());            // its collectives run on q's side
//   auto t = q.submit([&](auto& ops) { ...ops.copy(...); grad_comm.reduce_scatter(...); }, true);
//   q.wait(t);     // the model's next work sees that task's results (and every earlier one's)
//   q.drain();     // ... every task's
//
// A task is a function of the Ops it must issue its kernels through: the communication
// side's own (on CUDA they are queued on the side stream, so they wait for nothing the
// compute stream does later).
//
//   Host: a Worker thread (util/worker.hpp). submit(task, true) queues the task there and
//         returns at once; submit(task, false) runs it on the calling thread. wait and
//         drain block the calling thread.
//   Cuda: train/cuda_comm_queue.hpp (nvcc). A second stream: submit records an event on
//         the compute stream, makes the side stream wait for it (the task sees every
//         gradient computed so far), issues the task's kernels and collectives on the side
//         stream and records a ticket event there; wait and drain make the COMPUTE STREAM
//         wait for a ticket's event: the host never blocks, which is what lets backward's
//         kernels queue up behind the reductions instead of waiting for them.
// The results are the same either way; only when the work runs differs.
//
// Without a side (CommQueue(compute, false): a group of one rank, with nothing to overlap),
// every task runs at once on the compute side's own Ops, in order with the model's work.
//
// A step captured as a graph (nn/step_graph.hpp) is the model's Ops' graph step, and the
// side's Ops follow it (Ops::follow_graph): a task's kernels and collectives are captured
// with the model's and, when replayed, not issued again. On CUDA the side stream joins the
// capture through the events that order it (which a replayed step does not record either);
// the host runs a graph step's tasks at once, in the order the CUDA queue issues them.

#include <cstdint>
#include <optional>
#include <utility>

#include "fived/comm/group_comm.hpp"
#include "fived/device/buffer.hpp"
#include "fived/nn/ops.hpp"
#include "fived/util/worker.hpp"

namespace fived {

template <class T, class Device>
class CommQueue;

template <class T>
class CommQueue<T, Host> {
 public:
  using ops_type = Ops<T, Host>;

  explicit CommQueue(ops_type& compute, bool side = true) : compute_(compute) {
    ops_.follow_graph(compute);
    if (side) worker_.emplace();
  }

  ops_type& ops() { return worker_ ? ops_ : compute_; }
  StreamHandle stream() const { return nullptr; }  // no streams on the host

  // Runs task(ops()) on the communication thread (async, with a side, not in a graph step) or
  // now; returns its ticket (0: done).
  template <class F>
  std::uint64_t submit(F&& task, bool async) {
    if (!async || !worker_ || compute_.in_graph_step()) {
      task(ops());
      return 0;
    }
    return worker_->submit([this, task = std::forward<F>(task)]() mutable { task(ops_); });
  }
  void wait(std::uint64_t ticket) {
    if (ticket != 0) worker_->wait(ticket);
  }
  void drain() {
    if (worker_) worker_->drain();
  }
  // At a step's start: the tasks of a step that ended without its drain (a throw) finish first.
  void begin_step() { drain(); }

 private:
  ops_type& compute_;
  ops_type ops_;  // kernels of the communication thread (stateless but for the norm sum, unused here)
  std::optional<Worker> worker_;  // the side, if any; last: it stops first
};

}  // namespace fived
