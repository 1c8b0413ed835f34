#pragma once
// fived::nccl::Comm — the production communicator: NCCL on a stream of its own.
//
// Ordering. Every call records an event on the compute stream, makes the
// communication stream wait for it, enqueues the NCCL operation on the
// communication stream, then makes the compute stream wait for that. A
// collective therefore sees everything issued before it on the compute stream,
// and work issued after it sees its result: correct by default, as if it ran on
// the compute stream. send_recv_begin and join let computation overlap an
// exchange, on the same two streams.
//
// The compute stream defaults to cudaStreamPerThread: each host thread's
// default stream, which also synchronises with the legacy stream 0. Code that
// computes on a stream of its own passes it to set_compute_stream().
//
// Buffers are device memory. Calls return before the data has moved; kernels
// on the compute stream see the result, the host sees it after synchronize(),
// barrier() or a synchronisation of the compute stream.
//
// Errors, and what is bounded by a timeout: comm/nccl_channel.hpp, the communicator's
// stream, events, polls and failures, which Comm stands on.

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "fived/comm/arguments.hpp"
#include "fived/comm/communicator.hpp"
#include "fived/comm/nccl_channel.hpp"
#include "fived/comm/types.hpp"

namespace fived::nccl {

class Comm : public detail::Channel {
 public:
  // Joins rank `rank` of a world of `world_size` ranks. `id` comes from
  // ncclGetUniqueId and is the same on every rank (init_world() in
  // nccl_bootstrap.hpp gets it from the launch environment). Select this
  // rank's GPU with cudaSetDevice before calling: the communicator, its stream
  // and its events belong to the current device. Collective: every rank calls
  // it, and it returns when all have joined.
  static Comm init(int world_size, int rank, ncclUniqueId id, std::string name = "world") {
    if (world_size < 1 || rank < 0 || rank >= world_size)
      throw CommError(detail::context("init", name, rank, world_size) +
                      ": the rank must lie in [0, world_size) and world_size must be positive");
    const auto timeout = detail::timeout_from_env();
    ncclComm_t c = nullptr;
    if (ncclResult_t r = ncclCommInitRank(&c, world_size, id, rank); r != ncclSuccess)
      throw CommError(detail::context("init", name, rank, world_size) + ": " +
                      detail::nccl_message(r, "ncclCommInitRank", c));
    return Comm(c, std::move(name), cudaStreamPerThread, timeout);
  }

  Comm(Comm&&) noexcept = default;
  Comm& operator=(Comm&&) noexcept = default;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }
  int device() const noexcept { return device_; }
  ncclComm_t handle() const noexcept { return comm_; }
  cudaStream_t stream() const noexcept { return stream_; }  // where NCCL runs
  cudaStream_t compute_stream() const noexcept { return compute_; }
  // The stream collectives are ordered against (see the top of this file).
  void set_compute_stream(cudaStream_t s) noexcept { compute_ = s; }
  // Makes the communicator's device the calling thread's current one: a thread that did not
  // create it (a background checkpoint save) starts on device 0, and every call checks.
  void bind_thread() { check(cudaSetDevice(device_), "bind_thread", "cudaSetDevice"); }

  // ---- collectives (shapes as in communicator.hpp) --------------------------------

  template <CommElement T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, ReduceOp op = ReduceOp::sum) {
    constexpr std::string_view what = "all_reduce";
    expect(what, args::all_reduce(rank_, size_, send, recv));
    expect_device(what, "send", send), expect_device(what, "recv", recv);
    if (recv.empty()) return;
    enqueue(what, [&] {
      check(ncclAllReduce(send.data(), recv.data(), recv.size(), type<T>, detail::nccl_op(op), comm_, stream_),
            what, "ncclAllReduce");
    });
  }

  // In place: buf is both send and recv.
  template <CommElement T>
  void all_reduce(std::span<T> buf, ReduceOp op = ReduceOp::sum) {
    all_reduce<T>(std::span<const T>(buf), buf, op);
  }

  template <CommElement T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, ReduceOp op = ReduceOp::sum) {
    constexpr std::string_view what = "reduce_scatter";
    expect(what, args::reduce_scatter(rank_, size_, send, recv));
    expect_device(what, "send", send), expect_device(what, "recv", recv);
    if (recv.empty()) return;
    enqueue(what, [&] {
      check(ncclReduceScatter(send.data(), recv.data(), recv.size(), type<T>, detail::nccl_op(op), comm_, stream_),
            what, "ncclReduceScatter");
    });
  }

  template <CommElement T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    constexpr std::string_view what = "all_gather";
    expect(what, args::all_gather(rank_, size_, send, recv));
    expect_device(what, "send", send), expect_device(what, "recv", recv);
    if (send.empty()) return;
    enqueue(what, [&] {
      check(ncclAllGather(send.data(), recv.data(), send.size(), type<T>, comm_, stream_), what, "ncclAllGather");
    });
  }

  // Equal blocks: block j of send goes to rank j, block i of recv comes from rank i.
  template <CommElement T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    constexpr std::string_view what = "all_to_all";
    expect(what, args::all_to_all(rank_, size_, send, recv));
    expect_device(what, "send", send), expect_device(what, "recv", recv);
    const std::size_t block = send.size() / size_;
    if (block == 0) return;
    enqueue(what, [&] {
      grouped(what, [&](auto&& add) {
        for (int peer = 0; peer < size_; ++peer) {
          add(ncclSend(send.data() + peer * block, block, type<T>, peer, comm_, stream_), "ncclSend");
          add(ncclRecv(recv.data() + peer * block, block, type<T>, peer, comm_, stream_), "ncclRecv");
        }
      });
    });
  }

  // Per-peer counts (elements): send_counts[j] go to rank j, recv_counts[i]
  // come from rank i, blocks packed in rank order, the counts adding up to the
  // buffer sizes. A zero count sends or receives nothing. Unlike the host
  // backend, peers' counts cannot be compared without an exchange: only the
  // block this rank sends itself is checked.
  template <CommElement T>
  void all_to_all_v(std::span<const std::type_identity_t<T>> send, std::span<const std::size_t> send_counts,
                    std::span<T> recv, std::span<const std::size_t> recv_counts) {
    constexpr std::string_view what = "all_to_all_v";
    expect(what, args::all_to_all_v(rank_, size_, send, send_counts, recv, recv_counts));
    expect_device(what, "send", send), expect_device(what, "recv", recv);
    if (send.empty() && recv.empty()) return;
    enqueue(what, [&] {
      grouped(what, [&](auto&& add) {
        std::size_t s = 0, r = 0;
        for (int peer = 0; peer < size_; ++peer) {
          if (send_counts[peer] != 0)
            add(ncclSend(send.data() + s, send_counts[peer], type<T>, peer, comm_, stream_), "ncclSend");
          if (recv_counts[peer] != 0)
            add(ncclRecv(recv.data() + r, recv_counts[peer], type<T>, peer, comm_, stream_), "ncclRecv");
          s += send_counts[peer], r += recv_counts[peer];
        }
      });
    });
  }

  // Grouped point-to-point: all sends and receives progress together, so a
  // ring exchange (send right, receive left) cannot deadlock. Empty buffers
  // are skipped (the peer's matching operation is empty too).
  template <CommElement T>
  void send_recv(std::span<const SendOp<T>> sends, std::span<const RecvOp<T>> recvs) {
    exchange<T>("send_recv", sends, recvs, true);
  }
  // The same exchange, which the compute stream waits for only at join() (or at this
  // communicator's next call that it waits for): it runs beside the compute work queued in
  // between, which must leave its buffers alone (ring attention's next key/value block on
  // its way while this one's blocks run). The buffers are the exchange's until join().
  template <CommElement T>
  void send_recv_begin(std::span<const SendOp<T>> sends, std::span<const RecvOp<T>> recvs) {
    exchange<T>("send_recv_begin", sends, recvs, false);
  }
  // The compute stream waits for every exchange begun on this communicator.
  void join() {
    usable("join");
    join_compute("join");
  }

  template <CommElement T>
  void broadcast(std::span<T> buf, int root) {
    constexpr std::string_view what = "broadcast";
    expect(what, args::broadcast(rank_, size_, root));
    expect_device(what, "buf", buf);
    if (buf.empty()) return;
    enqueue(what, [&] {
      check(ncclBroadcast(buf.data(), buf.data(), buf.size(), type<T>, root, comm_, stream_), what, "ncclBroadcast");
    });
  }

  // Values in host memory (a loss, a gradient norm; a whole parameter vector for a check),
  // reduced over the group in one collective: through this communicator's device scratch,
  // ordered on the compute stream, and waited for (the caller is about to read them; the
  // wait polls NCCL's error state like synchronize()).
  void all_reduce_host(std::span<double> values, ReduceOp op = ReduceOp::sum) {
    constexpr std::string_view what = "all_reduce_host";
    if (values.empty()) return;
    usable(what);
    double* device = host_scratch(what, values.size());
    check(cudaMemcpyAsync(device, values.data(), values.size_bytes(), cudaMemcpyHostToDevice, compute_), what,
          "cudaMemcpyAsync (to the device)");
    enqueue(what, [&] {
      check(ncclAllReduce(device, device, values.size(), ncclFloat64, detail::nccl_op(op), comm_, stream_), what,
            "ncclAllReduce");
    });
    wait(what);  // bounded by the timeout; the copy below then finds the result ready
    check(cudaMemcpyAsync(values.data(), device, values.size_bytes(), cudaMemcpyDeviceToHost, compute_), what,
          "cudaMemcpyAsync (to the host)");
    check(cudaStreamSynchronize(compute_), what, "cudaStreamSynchronize (compute stream)");
  }

  // An all-to-all of a few integers the host holds (a mixture of experts' token counts,
  // which size the all_to_all_v that follows): through a device buffer of this
  // communicator, grown when a longer exchange comes, and waited for.
  void all_to_all_host(std::span<const std::int64_t> send, std::span<std::int64_t> recv) {
    constexpr std::string_view what = "all_to_all_host";
    expect(what, args::all_to_all(rank_, size_, send, recv));
    usable(what);
    static_assert(sizeof(std::int64_t) == sizeof(double));
    std::int64_t* in = reinterpret_cast<std::int64_t*>(host_scratch(what, 2 * send.size()));
    std::int64_t* out = in + send.size();
    check(cudaMemcpyAsync(in, send.data(), send.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice, compute_), what,
          "cudaMemcpyAsync (to the device)");
    all_to_all<std::int64_t>(std::span<const std::int64_t>(in, send.size()), std::span<std::int64_t>(out, recv.size()));
    wait(what);
    check(cudaMemcpyAsync(recv.data(), out, recv.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost, compute_), what,
          "cudaMemcpyAsync (to the host)");
    check(cudaStreamSynchronize(compute_), what, "cudaStreamSynchronize (compute stream)");
  }

  // Returns when every rank has reached the barrier and all work issued
  // before it, on this rank's compute and communication streams, is done.
  void barrier() {
    constexpr std::string_view what = "barrier";
    enqueue(what, [&] { check(ncclAllReduce(barrier_, barrier_, 1, ncclFloat64, ncclSum, comm_, stream_), what, "ncclAllReduce"); });
    wait(what);
  }

  // Returns when the communication issued so far on this rank has completed.
  void synchronize() { wait("synchronize"); }

  // A communicator per color, ranks ordered by key (ties by rank here).
  // Collective over this communicator. Inherits the compute stream and timeout.
  Comm split(int color, int key, std::string name) {
    expect("split", args::split(color));
    usable("split");
    ncclComm_t c = nullptr;
    check(ncclCommSplit(comm_, color, key, &c, nullptr), "split", "ncclCommSplit");
    return Comm(c, std::move(name), compute_, timeout_);
  }

 private:
  template <class T> static constexpr ncclDataType_t type = detail::nccl_type(dtype_of<T>);
  template <CommElement T>
  void exchange(std::string_view what, std::span<const SendOp<T>> sends, std::span<const RecvOp<T>> recvs,
                bool join_now) {
    expect(what, args::send_recv<T>(rank_, size_, sends, recvs));
    for (const auto& s : sends) expect_device(what, "send", s.buf);
    for (const auto& r : recvs) expect_device(what, "recv", r.buf);
    enqueue(what, [&] {
      grouped(what, [&](auto&& add) {
        for (const auto& s : sends)
          if (!s.buf.empty()) add(ncclSend(s.buf.data(), s.buf.size(), type<T>, s.peer, comm_, stream_), "ncclSend");
        for (const auto& r : recvs)
          if (!r.buf.empty()) add(ncclRecv(r.buf.data(), r.buf.size(), type<T>, r.peer, comm_, stream_), "ncclRecv");
      });
    }, join_now);
  }
  Comm(ncclComm_t c, std::string name, cudaStream_t compute, std::chrono::duration<double> timeout)
      : Channel(c, std::move(name), compute, timeout) {}
};

static_assert(Communicator<Comm>);

}  // namespace fived::nccl
