#pragma once
// GroupComm: the type-erased face of one group's communicator (host threads, NCCL,
// Counting<...>), so that a model's type names its mesh but not its backend: one
// GPT<cfg, Mesh<TP<2>>> runs over host threads in a test and over NCCL on GPUs. It carries
// the collectives a layer needs (and a mixture of experts' all_to_all_v, with its counts
// exchanged first by all_to_all_host), for the element types a model moves (its T and its
// statistics). GroupCommOf<C> is one over a communicator of backend C, OwnedGroupComm<C>
// one that owns its communicator. The mesh's handle on a group, which holds one only where
// the group has more than one rank, is MeshComm (mesh/mesh_comm.hpp).
//
// Devices. A device backend (NCCL) orders its collectives after the work queued on a
// "compute stream" and makes that stream wait for them (comm/nccl.hpp); set_compute_stream
// names it (the model's stream for TP, the trainer's communication stream for DP), and is
// nothing on the host. all_reduce_host reduces a few values the host holds (a loss, a
// gradient norm): directly on the host backend, through device memory on NCCL, where it
// waits for the result because the host is about to read it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fived/comm/communicator.hpp"
#include "fived/device/bf16.hpp"

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
  // The device stream waits for the exchanges begun with send_recv_begin (on the host, what
  // they received is handed over now).
  virtual void join() = 0;
  // Readies the calling thread for this communicator's calls, in a thread other than the one
  // that made it: a device backend selects its device there (nothing on the host).
  virtual void bind_thread() = 0;

#define FIVED_GROUP_COMM_OPS(E)                                                     \
  virtual void all_reduce(std::span<E> buf, ReduceOp op) = 0;                       \
  virtual void all_gather(std::span<const E> send, std::span<E> recv) = 0;          \
  virtual void reduce_scatter(std::span<const E> send, std::span<E> recv, ReduceOp op) = 0; \
  virtual void send_recv(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) = 0;          \
  virtual void send_recv_begin(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) = 0;    \
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
  void barrier() override { hand_over(), c_.barrier(); }
  void set_compute_stream(StreamHandle stream) override {
    if constexpr (requires { c_.set_compute_stream(stream); }) c_.set_compute_stream(stream);
  }
  // A backend without all_reduce_host works on host memory (host threads).
  void all_reduce_host(std::span<double> values, ReduceOp op) override {
    hand_over();
    if constexpr (requires { c_.all_reduce_host(values, op); }) c_.all_reduce_host(values, op);
    else c_.all_reduce(std::span<const double>(values), values, op);
  }
  void all_to_all_host(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    hand_over();
    if constexpr (requires { c_.all_to_all_host(send, recv); }) c_.all_to_all_host(send, recv);
    else c_.template all_to_all<std::int64_t>(send, recv);
  }
  void join() override {
    if constexpr (requires { c_.join(); }) c_.join();
    else hand_over();
  }
  void bind_thread() override {
    if constexpr (requires { c_.bind_thread(); }) c_.bind_thread();
  }

#define FIVED_GROUP_COMM_OPS(E)                                                                                      \
  void all_reduce(std::span<E> buf, ReduceOp op) override {                                                         \
    hand_over(), c_.all_reduce(std::span<const E>(buf), buf, op);                                                    \
  }                                                                                                                  \
  void all_gather(std::span<const E> send, std::span<E> recv) override { hand_over(), c_.all_gather(send, recv); }  \
  void reduce_scatter(std::span<const E> send, std::span<E> recv, ReduceOp op) override {                           \
    hand_over(), c_.reduce_scatter(send, recv, op);                                                                  \
  }                                                                                                                  \
  void send_recv(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) override {                    \
    hand_over(), c_.send_recv(sends, recvs);                                                                         \
  }                                                                                                                  \
  void send_recv_begin(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) override {              \
    if constexpr (requires { c_.send_recv_begin(sends, recvs); }) c_.send_recv_begin(sends, recvs);                  \
    else begin_on_host(sends, recvs);                                                                                \
  }                                                                                                                  \
  void all_to_all_v(std::span<const E> send, std::span<const std::size_t> send_counts, std::span<E> recv,           \
                    std::span<const std::size_t> recv_counts) override {                                             \
    hand_over(), c_.template all_to_all_v<E>(send, send_counts, recv, recv_counts);                                  \
  }
  FIVED_GROUP_COMM_OPS(float)
  FIVED_GROUP_COMM_OPS(double)
  FIVED_GROUP_COMM_OPS(bf16)
#undef FIVED_GROUP_COMM_OPS

 private:
  // A backend without send_recv_begin (host threads, MPI, Counting) exchanges when begun,
  // into buffers of its own, and hands what arrived over at join() or at its next call that
  // a device stream would wait for: the receiving buffers change when they would on a device
  // (comm/nccl.hpp), so a reader that does not wait for the exchange reads the old values in
  // a host test too.
  template <class E>
  void begin_on_host(std::span<const SendOp<E>> sends, std::span<const RecvOp<E>> recvs) {
    std::vector<std::vector<E>> arrived(recvs.size());
    std::vector<RecvOp<E>> into;
    for (std::size_t k = 0; k < recvs.size(); ++k)
      arrived[k].resize(recvs[k].buf.size()), into.push_back({std::span<E>(arrived[k]), recvs[k].peer});
    c_.send_recv(sends, std::span<const RecvOp<E>>(into));
    arrivals_.push_back([to = std::vector<RecvOp<E>>(recvs.begin(), recvs.end()), from = std::move(arrived)] {
      for (std::size_t k = 0; k < to.size(); ++k) std::copy(from[k].begin(), from[k].end(), to[k].buf.begin());
    });
  }
  void hand_over() {
    for (const auto& f : arrivals_) f();
    arrivals_.clear();
  }

  C& c_;
  std::vector<std::function<void()>> arrivals_;  // begin_on_host's, not yet handed over
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

}  // namespace fived
