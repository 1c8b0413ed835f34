#pragma once
// The collectives a model issues over one mesh axis, written so that an axis of extent 1
// compiles to nothing.
//
//   AxisComm<M, Axis::tp> tp(ctx.comm<Axis::tp>());   // or AxisComm<M, Axis::tp>() when M has TP 1
//   MeshComm<typename M::grad_group> g(ctx.comm<typename M::grad_group>());
//   tp.all_reduce(std::span<float>(partial));          // no code at all for Mesh<>
//
// GroupComm is the type-erased face of one group's communicator (host threads, NCCL,
// Counting<...>), so that a model's type names its mesh but not its backend: one
// GPT<cfg, Mesh<TP<2>>> runs over host threads in a test and over NCCL on GPUs. It carries
// the collectives a layer needs (and a mixture of experts' all_to_all_v, with its counts
// exchanged first by all_to_all_host), for the element types a model moves (its T and its
// statistics). AxisComm holds one when its axis has extent > 1 and none otherwise; its
// calls are `if constexpr` on the group's size, which is what makes GPT<cfg, Mesh<>> the serial
// model with zero collectives.
//
// Devices. A device backend (NCCL) orders its collectives after the work queued on a
// "compute stream" and makes that stream wait for them (comm/nccl.hpp); set_compute_stream
// names it (the model's stream for TP, the trainer's communication stream for DP), and is
// nothing on the host. all_reduce_host reduces a few values the host holds (a loss, a
// gradient norm): directly on the host backend, through device memory on NCCL, where it
// waits for the result because the host is about to read it.
//
// At extent 1, all_gather and reduce_scatter are identities: the caller passes the same
// buffer as input and output (the layers do, see nn/stream.hpp), and a different one is a
// logic_error rather than a silent copy.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "fived/comm/communicator.hpp"
#include "fived/device/bf16.hpp"
#include "fived/mesh/mesh.hpp"

// cudaStream_t is `struct CUstream_st*`: naming the struct lets host-only code pass a
// device's stream through a type-erased communicator without the CUDA headers.
struct CUstream_st;

namespace fived {

using StreamHandle = CUstream_st*;

class GroupComm {
 public:
  virtual ~GroupComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;
  virtual void barrier() = 0;
  virtual void set_compute_stream(StreamHandle stream) = 0;
  virtual void all_reduce_host(std::span<double> values, ReduceOp op) = 0;
  virtual void all_to_all_host(std::span<const std::int64_t> send, std::span<std::int64_t> recv) = 0;

#define FIVED_GROUP_COMM_OPS(E)                                                     \
  virtual void all_reduce(std::span<E> buf, ReduceOp op) = 0;                       \
  virtual void all_gather(std::span<const E> send, std::span<E> recv) = 0;          \
  virtual void reduce_scatter(std::span<const E> send, std::span<E> recv, ReduceOp op) = 0; \
  virtual void send_recv(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) = 0;          \
  virtual void all_to_all_v(std::span<const E> send, std::span<const std::size_t> send_counts, std::span<E> recv, \
                            std::span<const std::size_t> recv_counts) = 0;
  FIVED_GROUP_COMM_OPS(float)
  FIVED_GROUP_COMM_OPS(double)
  FIVED_GROUP_COMM_OPS(bf16)
#undef FIVED_GROUP_COMM_OPS
};

// A GroupComm over a reference to a communicator of any backend (which must outlive it).
template <Communicator C>
class GroupCommOf : public GroupComm {
 public:
  explicit GroupCommOf(C& comm) : c_(comm) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  const std::string& name() const override { return c_.name(); }
  void barrier() override { c_.barrier(); }
  void set_compute_stream(StreamHandle stream) override {
    if constexpr (requires { c_.set_compute_stream(stream); }) c_.set_compute_stream(stream);
  }
  // A backend without all_reduce_host works on host memory (host threads).
  void all_reduce_host(std::span<double> values, ReduceOp op) override {
    if constexpr (requires { c_.all_reduce_host(values, op); }) c_.all_reduce_host(values, op);
    else c_.all_reduce(std::span<const double>(values), values, op);
  }
  void all_to_all_host(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    if constexpr (requires { c_.all_to_all_host(send, recv); }) c_.all_to_all_host(send, recv);
    else c_.template all_to_all<std::int64_t>(send, recv);
  }

#define FIVED_GROUP_COMM_OPS(E)                                                                                      \
  void all_reduce(std::span<E> buf, ReduceOp op) override { c_.all_reduce(std::span<const E>(buf), buf, op); }      \
  void all_gather(std::span<const E> send, std::span<E> recv) override { c_.all_gather(send, recv); }               \
  void reduce_scatter(std::span<const E> send, std::span<E> recv, ReduceOp op) override {                           \
    c_.reduce_scatter(send, recv, op);                                                                               \
  }                                                                                                                  \
  void send_recv(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) override {                    \
    c_.send_recv(sends, recvs);                                                                                      \
  }                                                                                                                  \
  void all_to_all_v(std::span<const E> send, std::span<const std::size_t> send_counts, std::span<E> recv,           \
                    std::span<const std::size_t> recv_counts) override {                                             \
    c_.template all_to_all_v<E>(send, send_counts, recv, recv_counts);                                               \
  }
  FIVED_GROUP_COMM_OPS(float)
  FIVED_GROUP_COMM_OPS(double)
  FIVED_GROUP_COMM_OPS(bf16)
#undef FIVED_GROUP_COMM_OPS

 private:
  C& c_;
};

namespace detail {
template <class C>
struct Held {
  C comm;
};
}  // namespace detail

// A GroupComm that owns its communicator (one split off for a single use).
template <Communicator C>
class OwnedGroupComm final : private detail::Held<C>, public GroupCommOf<C> {
 public:
  explicit OwnedGroupComm(C comm) : detail::Held<C>{std::move(comm)}, GroupCommOf<C>(this->comm) {}
};

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
    if constexpr (size > 1) comm_->barrier();
  }
  void set_compute_stream(StreamHandle stream) {
    if constexpr (size > 1) comm_->set_compute_stream(stream);
  }
  // A value the host holds, reduced over the group (returns it unchanged at extent 1).
  double all_reduce_host(double value, ReduceOp op = ReduceOp::sum) {
    if constexpr (size > 1) comm_->all_reduce_host(std::span<double>(&value, 1), op);
    return value;
  }
  // A few values the host holds, reduced in place (unchanged at extent 1).
  void all_reduce_host(std::span<double> values, ReduceOp op = ReduceOp::sum) {
    if constexpr (size > 1) comm_->all_reduce_host(values, op);
  }
  // Integers the host holds (token counts), exchanged in equal blocks: block j to group
  // rank j. At extent 1 recv is a copy of send.
  void all_to_all_host(std::span<const std::int64_t> send, std::span<std::int64_t> recv) {
    if constexpr (size > 1) comm_->all_to_all_host(send, recv);
    else std::copy(send.begin(), send.end(), recv.begin());
  }

  template <class E>
  void all_reduce(std::span<E> buf, ReduceOp op = ReduceOp::sum) {
    if constexpr (size > 1) comm_->all_reduce(buf, op);
  }
  // recv.size() == size * send.size(); at extent 1, recv must be send.
  template <class E>
  void all_gather(std::span<const std::type_identity_t<E>> send, std::span<E> recv) {
    if constexpr (size > 1) comm_->all_gather(send, recv);
    else same_buffer(send, recv, "all_gather");
  }
  // send.size() == size * recv.size(); at extent 1, recv must be send.
  template <class E>
  void reduce_scatter(std::span<const std::type_identity_t<E>> send, std::span<E> recv, ReduceOp op = ReduceOp::sum) {
    if constexpr (size > 1) comm_->reduce_scatter(send, recv, op);
    else same_buffer(send, recv, "reduce_scatter");
  }
  // Per-peer counts (elements), blocks packed in group-rank order (comm/communicator.hpp).
  // Not at extent 1, where there is no one to exchange with: the caller uses its buffer.
  template <class E>
  void all_to_all_v(std::span<const std::type_identity_t<E>> send, std::span<const std::size_t> send_counts,
                    std::span<E> recv, std::span<const std::size_t> recv_counts) requires(size > 1) {
    comm_->all_to_all_v(send, send_counts, recv, recv_counts);
  }
  // Grouped point-to-point within the group (peers are group ranks); nothing at extent 1.
  template <class E>
  void send_recv(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) {
    if constexpr (size > 1) comm_->send_recv(sends, recvs);
  }

 private:
  template <class E>
  static void same_buffer(std::span<const E> a, std::span<E> b, const char* what) {
    if (a.data() != b.data() || a.size() != b.size())
      throw std::logic_error(std::string("MeshComm::") + what + " over an axis of extent 1 is the identity: pass the "
                             "same buffer as input and output");
  }

  std::unique_ptr<GroupComm> comm_;  // null at extent 1
};

template <MeshType M, Axis A>
using AxisComm = MeshComm<typename M::template over<A>>;

}  // namespace fived
