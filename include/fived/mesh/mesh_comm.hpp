#pragma once
// MeshComm: the collectives a model issues over one group of its mesh, written so that a
// group of extent 1 compiles to nothing.
//
//   AxisComm<M, Axis::tp> tp(ctx.comm<Axis::tp>());   // or AxisComm<M, Axis::tp>() when M has TP 1
//   MeshComm<typename M::grad_group> g(ctx.comm<typename M::grad_group>());
//   tp.all_reduce(std::span<float>(partial));          // no code at all for Mesh<>
//
// A MeshComm holds a GroupComm (comm/group_comm.hpp: any backend) when its group has more
// than one rank and none otherwise; its calls are `if constexpr` on the group's size, which
// is what makes GPT<cfg, Mesh<>> the serial model with zero collectives.
//
// At extent 1, all_gather and reduce_scatter are identities: the caller passes the same
// buffer as input and output (the layers do, see nn/stream.hpp), and a different one is a
// logic_error rather than a silent copy.
//
// A training step captured as a graph (nn/step_graph.hpp) captures the group's collectives
// with the kernels around them, and a replayed step must not issue them again: order_after(ops)
// names the Ops whose stream the collectives follow (on a device: its stream), and while that
// Ops is in a graph step each collective goes through its queue (checked against the
// captured step's, kept or left to the graph) and a call that waits for the device
// (all_reduce_host, all_to_all_host, barrier) is refused. A call is known by its group (the
// communicator's address) and its arguments.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/comm/group_comm.hpp"
#include "fived/comm/step_gate.hpp"
#include "fived/mesh/mesh.hpp"
#include "fived/util/call_hash.hpp"

namespace fived {

// One rank's handle on a group of the mesh (G: a GroupView such as M::tp_group or
// M::grad_group); AxisComm<M, A> is the group over one axis.
template <GroupView G>
class MeshComm {
 public:
  static constexpr int size = G::size;

  // Extent 1 only: nothing to talk to.
  MeshComm() requires(size == 1) = default;
  // Binds this rank's communicator of the group (checked: its size, and the group's name).
  template <Communicator C>
  explicit MeshComm(C& comm) {
    if constexpr (size > 1) {
      if (comm.size() != size || comm.name() != G::name())
        throw std::invalid_argument("MeshComm: the group " + G::name() + " needs this rank's communicator of it (size " +
                                    std::to_string(size) + "), but got '" + comm.name() + "' (size " +
                                    std::to_string(comm.size()) + ")");
      comm_ = std::make_unique<GroupCommOf<C>>(comm);
    }
  }

  int rank() const {
    if constexpr (size == 1) return 0;
    else return comm_->rank();
  }

  void barrier() {
    if constexpr (size > 1) host_wait("MeshComm::barrier"), comm_->barrier();
  }
  void set_compute_stream(StreamHandle stream) {
    if constexpr (size > 1) comm_->set_compute_stream(stream);
  }
  // The collectives follow the work `ops` queues (on a device: on its stream) and belong to
  // its graph steps (above). `ops` outlives this handle's calls.
  template <class O>
  void order_after(O& ops) {
    if constexpr (size > 1) {
      if constexpr (requires { ops.stream(); }) comm_->set_compute_stream(ops.stream());
      gate_.order_after(ops);
    }
  }
  // A value the host holds, reduced over the group (returns it unchanged at extent 1).
  double all_reduce_host(double value, ReduceOp op = ReduceOp::sum) {
    if constexpr (size > 1) host_wait("MeshComm::all_reduce_host"), comm_->all_reduce_host(std::span<double>(&value, 1), op);
    return value;
  }
  // A few values the host holds, reduced in place (unchanged at extent 1).
  void all_reduce_host(std::span<double> values, ReduceOp op = ReduceOp::sum) {
    if constexpr (size > 1) host_wait("MeshComm::all_reduce_host"), comm_->all_reduce_host(values, op);
  }
  // Integers the host holds (token counts), exchanged in equal blocks: block j to group
  // rank j. At extent 1 recv is a copy of send.
  void all_to_all_host(std::span<const std::int64_t> send, std::span<std::int64_t> recv) {
    if constexpr (size > 1) host_wait("MeshComm::all_to_all_host"), comm_->all_to_all_host(send, recv);
    else std::copy(send.begin(), send.end(), recv.begin());
  }

  template <class E>
  void all_reduce(std::span<E> buf, ReduceOp op = ReduceOp::sum) {
    if constexpr (size > 1)
      issue("MeshComm::all_reduce", [c = comm_.get(), buf, op] { c->all_reduce(buf, op); },
            [&] { return call_hash(comm_.get(), buf.data(), buf.size(), op); });
  }
  // recv.size() == size * send.size(); at extent 1, recv must be send.
  template <class E>
  void all_gather(std::span<const std::type_identity_t<E>> send, std::span<E> recv) {
    if constexpr (size > 1)
      issue("MeshComm::all_gather", [c = comm_.get(), send, recv] { c->all_gather(send, recv); },
            [&] { return call_hash(comm_.get(), send.data(), send.size(), recv.data(), recv.size()); });
    else same_buffer(send, recv, "all_gather");
  }
  // send.size() == size * recv.size(); at extent 1, recv must be send.
  template <class E>
  void reduce_scatter(std::span<const std::type_identity_t<E>> send, std::span<E> recv, ReduceOp op = ReduceOp::sum) {
    if constexpr (size > 1)
      issue("MeshComm::reduce_scatter", [c = comm_.get(), send, recv, op] { c->reduce_scatter(send, recv, op); },
            [&] { return call_hash(comm_.get(), send.data(), send.size(), recv.data(), recv.size(), op); });
    else same_buffer(send, recv, "reduce_scatter");
  }
  // Per-peer counts (elements), blocks packed in group-rank order (comm/communicator.hpp).
  // Not at extent 1, where there is no one to exchange with: the caller uses its buffer. In a
  // graph step the counts are part of the call: other counts than the captured are refused.
  template <class E>
  void all_to_all_v(std::span<const std::type_identity_t<E>> send, std::span<const std::size_t> send_counts,
                    std::span<E> recv, std::span<const std::size_t> recv_counts) requires(size > 1) {
    if (!gate_.in_graph_step()) return comm_->all_to_all_v(send, send_counts, recv, recv_counts);
    std::uint64_t h = call_hash(comm_.get(), send.data(), send.size(), recv.data(), recv.size());
    for (const std::size_t n : send_counts) h = call_hash(h, n);
    for (const std::size_t n : recv_counts) h = call_hash(h, n);
    gate_.queue("MeshComm::all_to_all_v", h,
                [c = comm_.get(), send, recv, sc = std::vector<std::size_t>(send_counts.begin(), send_counts.end()),
                 rc = std::vector<std::size_t>(recv_counts.begin(), recv_counts.end())] {
                  c->all_to_all_v(send, std::span<const std::size_t>(sc), recv, std::span<const std::size_t>(rc));
                });
  }
  // Grouped point-to-point within the group (peers are group ranks); nothing at extent 1.
  template <class E>
  void send_recv(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) {
    if constexpr (size > 1) gate_.send_recv(*comm_, sends, recvs);
  }
  // The same exchange, which the device stream waits for only at join(): compute queued in
  // between runs beside it and leaves its buffers alone (comm/nccl.hpp; the host backends
  // hand what arrived over at join, comm/group_comm.hpp).
  template <class E>
  void send_recv_begin(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) {
    if constexpr (size > 1) gate_.send_recv(*comm_, sends, recvs, true);
  }
  void join() {
    if constexpr (size > 1)
      issue("MeshComm::join", [c = comm_.get()] { c->join(); }, [&] { return call_hash(comm_.get()); });
  }

 private:
  template <class E>
  static void same_buffer(std::span<const E> a, std::span<E> b, const char* what) {
    if (a.data() != b.data() || a.size() != b.size())
      throw std::logic_error(std::string("MeshComm::") + what + " over an axis of extent 1 is the identity: pass the "
                             "same buffer as input and output");
  }

  // A collective whose arguments are spans and scalars: issued now, or through order_after's
  // Ops in a graph step (comm/step_gate.hpp).
  template <class Run, class Args>
  void issue(const char* what, Run&& run, Args&& args) {
    gate_.issue(what, std::forward<Run>(run), std::forward<Args>(args));
  }
  void host_wait(const char* what) const { gate_.host_wait(what); }

  std::unique_ptr<GroupComm> comm_;  // null at extent 1
  StepGate gate_;                     // order_after's Ops, if any
};

template <MeshType M, Axis A>
using AxisComm = MeshComm<typename M::template over<A>>;

}  // namespace fived
