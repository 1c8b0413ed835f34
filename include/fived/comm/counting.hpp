#pragma once
// Counting<C>: a Communicator decorator that forwards every call to an inner
// communicator and tallies, per kind of collective, the calls this rank made
// and the bytes it contributed (the size of its send buffer; for broadcast the
// buffer, for send_recv the sends). Tests use it to check the collectives a
// layer issues against the counts its placements promise.
//
//   host::run(2, [](host::Comm& w) {
//     auto ctx = make_mesh_context<Mesh<TP<2>>>(Counting<host::Comm>(w));
//     auto before = ctx.comm<Axis::tp>().counts();
//     ... ;
//     auto issued = ctx.comm<Axis::tp>().counts() - before;   // issued.all_reduce.calls
//   });
//
// Copies of a Counting share one tally (MeshContext takes its world by value);
// split() gives the new communicator a tally of its own, so counts are per
// group. split itself is not counted.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "fived/comm/communicator.hpp"
#include "fived/comm/types.hpp"

namespace fived {

struct Tally {
  std::int64_t calls = 0, bytes = 0;
  friend constexpr bool operator==(const Tally&, const Tally&) = default;
  constexpr Tally operator-(const Tally& o) const { return {calls - o.calls, bytes - o.bytes}; }
};

struct CommCounts {
  Tally all_reduce, reduce_scatter, all_gather, all_to_all, all_to_all_v, send_recv, broadcast, barrier;

  constexpr std::int64_t total_calls() const {
    return all_reduce.calls + reduce_scatter.calls + all_gather.calls + all_to_all.calls + all_to_all_v.calls +
           send_recv.calls + broadcast.calls + barrier.calls;
  }
  constexpr CommCounts operator-(const CommCounts& o) const {
    return {all_reduce - o.all_reduce, reduce_scatter - o.reduce_scatter, all_gather - o.all_gather,
            all_to_all - o.all_to_all, all_to_all_v - o.all_to_all_v,     send_recv - o.send_recv,
            broadcast - o.broadcast,   barrier - o.barrier};
  }
  friend constexpr bool operator==(const CommCounts&, const CommCounts&) = default;
};

template <Communicator C>
class Counting {
 public:
  explicit Counting(C inner) : inner_(std::move(inner)), counts_(std::make_shared<CommCounts>()) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  const std::string& name() const { return inner_.name(); }
  C& inner() { return inner_; }

  // What this rank issued on this communicator so far.
  const CommCounts& counts() const { return *counts_; }
  void reset_counts() { *counts_ = CommCounts{}; }

  template <CommElement T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, ReduceOp op = ReduceOp::sum) {
    tally(counts_->all_reduce, send.size_bytes());
    inner_.all_reduce(send, recv, op);
  }
  template <CommElement T>
  void all_reduce(std::span<T> buf, ReduceOp op = ReduceOp::sum) {
    tally(counts_->all_reduce, buf.size_bytes());
    inner_.all_reduce(std::span<const T>(buf), buf, op);
  }
  template <CommElement T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, ReduceOp op = ReduceOp::sum) {
    tally(counts_->reduce_scatter, send.size_bytes());
    inner_.reduce_scatter(send, recv, op);
  }
  template <CommElement T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    tally(counts_->all_gather, send.size_bytes());
    inner_.all_gather(send, recv);
  }
  template <CommElement T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    tally(counts_->all_to_all, send.size_bytes());
    inner_.all_to_all(send, recv);
  }
  template <CommElement T>
  void all_to_all_v(std::span<const std::type_identity_t<T>> send, std::span<const std::size_t> send_counts,
                    std::span<T> recv, std::span<const std::size_t> recv_counts) {
    tally(counts_->all_to_all_v, send.size_bytes());
    inner_.all_to_all_v(send, send_counts, recv, recv_counts);
  }
  template <CommElement T>
  void send_recv(std::span<const SendOp<T>> sends, std::span<const RecvOp<T>> recvs) {
    std::size_t b = 0;
    for (const auto& s : sends) b += s.buf.size_bytes();
    tally(counts_->send_recv, b);
    inner_.send_recv(sends, recvs);
  }
  template <CommElement T>
  void broadcast(std::span<T> buf, int root) {
    tally(counts_->broadcast, buf.size_bytes());
    inner_.broadcast(buf, root);
  }
  void barrier() {
    tally(counts_->barrier, 0);
    inner_.barrier();
  }
  void synchronize() { inner_.synchronize(); }
  void bind_thread() requires requires(C& c) { c.bind_thread(); } { inner_.bind_thread(); }
  // Device backends only (comm/group_comm.hpp); counted as an all-reduce.
  template <class S>
  void set_compute_stream(S stream) requires requires(C& c) { c.set_compute_stream(stream); } {
    inner_.set_compute_stream(stream);
  }
  void all_reduce_host(std::span<double> values, ReduceOp op) requires requires(C& c) { c.all_reduce_host(values, op); } {
    tally(counts_->all_reduce, values.size_bytes());
    inner_.all_reduce_host(values, op);
  }
  Counting split(int color, int key, std::string name) { return Counting(inner_.split(color, key, std::move(name))); }

 private:
  static void tally(Tally& t, std::size_t bytes) {
    ++t.calls;
    t.bytes += static_cast<std::int64_t>(bytes);
  }

  C inner_;
  std::shared_ptr<CommCounts> counts_;
};

}  // namespace fived
