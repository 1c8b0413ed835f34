#pragma once
// StepGate: the door a communicator's calls go through when a training step may be a graph
// (nn/step_graph.hpp), for whoever issues collectives beside a model's Ops: a mesh group's
// handle (mesh/mesh_comm.hpp) and the pipeline executor's point-to-point transfers.
//
//   StepGate gate;
//   gate.order_after(model.ops());                 // the Ops whose graph steps these calls join
//   gate.issue("all_reduce", [=] { comm.all_reduce(...); }, [&] { return call_hash(&comm, ...); });
//   gate.send_recv(comm, sends, recvs);            // a grouped exchange: its op lists kept by copy
//   gate.host_wait("all_reduce_host");             // refused inside a graph step
//
// Outside a graph step a call runs at once (one branch: no std::function is made). Inside
// one it goes through the Ops' queue like the Ops' own kernels: captured or recorded, or
// checked and skipped when the step is replayed. A call is known by what `args` hashes: the
// communicator's address and the call's arguments.

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "fived/comm/types.hpp"
#include "fived/util/call_hash.hpp"

namespace fived {

// The face of an Ops (nn/ops.hpp) that a communicator queues its device work through.
class StepQueue {
 public:
  virtual ~StepQueue() = default;
  virtual bool in_graph_step() const = 0;
  virtual void queue(const char* what, std::uint64_t args, std::function<void()> run) = 0;
  virtual void host_wait(const char* what) const = 0;
};

template <class O>
class OpsStepQueue final : public StepQueue {
 public:
  explicit OpsStepQueue(O& ops) : ops_(ops) {}
  bool in_graph_step() const override { return ops_.in_graph_step(); }
  void queue(const char* what, std::uint64_t args, std::function<void()> run) override {
    ops_.queue(what, std::move(run), [args] { return args; });
  }
  void host_wait(const char* what) const override { ops_.host_wait(what); }

 private:
  O& ops_;
};

class StepGate {
 public:
  // The calls belong to `ops`' graph steps. `ops` outlives the calls. An Ops without graph
  // steps (a stand-in's, as bench/pipeline's) leaves every call plain.
  template <class O>
  void order_after(O& ops) {
    if constexpr (requires(const char* w) {
                    { ops.in_graph_step() } -> std::convertible_to<bool>;
                    ops.host_wait(w);
                  })
      queue_ = std::make_unique<OpsStepQueue<O>>(ops);
  }
  bool in_graph_step() const { return queue_ && queue_->in_graph_step(); }
  // A call that waits for the device: refused inside a graph step.
  void host_wait(const char* what) const {
    if (queue_) queue_->host_wait(what);
  }

  // A call whose arguments are spans and scalars (`run` holds them by value): now, or
  // through the Ops' queue in a graph step, known by args().
  template <class Run, class Args>
  void issue(const char* what, Run&& run, Args&& args) {
    if (!in_graph_step()) return run();
    queue_->queue(what, args(), std::forward<Run>(run));
  }
  // The same with a hash already made and a call that owns what it needs.
  void queue(const char* what, std::uint64_t args, std::function<void()> run) {
    queue_->queue(what, args, std::move(run));
  }

  // A grouped exchange over `comm` (anything with send_recv(sends, recvs)): a call kept for a
  // graph step owns copies of its op lists, which the plain path does not make. begin: the
  // exchange is comm.send_recv_begin, which the device stream waits for at comm.join().
  template <class Comm, class E>
  void send_recv(Comm& comm, std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs, bool begin = false) {
    if (!in_graph_step()) return exchange(comm, sends, recvs, begin);
    std::uint64_t h = call_hash(&comm, sends.size(), recvs.size(), begin);  // field by field: no padding
    for (const SendOp<E>& x : sends) h = call_hash(h, x.buf.data(), x.buf.size(), x.peer);
    for (const RecvOp<E>& x : recvs) h = call_hash(h, x.buf.data(), x.buf.size(), x.peer);
    queue_->queue(begin ? "send_recv_begin" : "send_recv", h,
                  [&comm, begin, s = std::vector<SendOp<E>>(sends.begin(), sends.end()),
                   r = std::vector<RecvOp<E>>(recvs.begin(), recvs.end())] {
                    exchange(comm, std::span<const SendOp<E>>(s), std::span<const RecvOp<E>>(r), begin);
                  });
  }

 private:
  template <class Comm, class E>
  static void exchange(Comm& comm, std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs, bool begin) {
    if constexpr (requires { comm.send_recv_begin(sends, recvs); })  // else it is done when begun
      if (begin) return comm.send_recv_begin(sends, recvs);
    comm.send_recv(sends, recvs);
  }

  std::unique_ptr<StepQueue> queue_;  // order_after's, if any
};

}  // namespace fived
