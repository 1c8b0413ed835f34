#pragma once
// fived::nccl::Comm — the production communicator: NCCL on a stream of its own.
//
// Ordering. Every call records an event on the compute stream, makes the
// communication stream wait for it, enqueues the NCCL operation on the
// communication stream, then makes the compute stream wait for that. A
// collective therefore sees everything issued before it on the compute stream,
// and work issued after it sees its result: correct by default, as if it ran on
// the compute stream. (APIs that let computation overlap communication can be
// added on top of the same two streams.)
//
// The compute stream defaults to cudaStreamPerThread: each host thread's
// default stream, which also synchronises with the legacy stream 0. Code that
// computes on a stream of its own passes it to set_compute_stream().
//
// Buffers are device memory. Calls return before the data has moved; kernels
// on the compute stream see the result, the host sees it after synchronize(),
// barrier() or a synchronisation of the compute stream.
//
// Errors. Arguments that cannot be right throw CommError before NCCL is
// called and leave the communicator usable: sizes, peers and overlapping
// buffers by the rules shared with the host backend (comm/arguments.hpp),
// host memory and a thread on another device here. A failed CUDA or NCCL
// call, an asynchronous NCCL error seen by a poll, or a poll that sees no
// progress for FIVED_NCCL_TIMEOUT_S seconds (default 600; a peer that died or
// stopped calling collectives) aborts the communicator (ncclCommAbort) and
// throws CommError. Messages read "fived::nccl: rank 1 of 4 in all_reduce on
// group 'tp': ..." (NCCL knows only the rank in the group) and end with
// NCCL's own explanation where there is one.
//
// What is bounded, and what is not. The communicator is blocking (NCCL's
// default), and only the polls are under the timeout:
//   - bounded: synchronize() and barrier(), which poll the communication
//     stream and ncclCommGetAsyncError; the destructor, which polls the same
//     way before ncclCommDestroy (and aborts at once instead when the rank is
//     unwinding from an exception or the communicator has failed).
//   - not bounded: Comm::init (ncclCommInitRank) and split (ncclCommSplit)
//     block until every rank of the group has called them; an enqueueing call
//     can block inside NCCL, notably the first collective or point-to-point
//     exchange between two ranks, which sets up the connection with the peer
//     (lazy connection setup) and waits for it; a host synchronisation of the
//     compute stream (cudaStreamSynchronize, a blocking cudaMemcpy, ...) waits
//     for the collective however long it takes and never looks at NCCL's
//     error state: with a dead peer it hangs. Call synchronize() (or
//     barrier()) before such a synchronisation when a peer may fail.
// Bounding those too needs non-blocking communicators (ncclConfig_t with
// blocking = 0, polling ncclInProgress); this backend does not use them yet.

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include "fived/comm/arguments.hpp"
#include "fived/comm/communicator.hpp"
#include "fived/comm/types.hpp"
#include "fived/util/env.hpp"

namespace fived::nccl {

namespace detail {

constexpr ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
  }
  return ncclFloat32;
}

constexpr ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}

// "fived::nccl: rank 1 of 4 in all_reduce on group 'tp'": the start of every
// message about a communicator (NCCL knows the rank in the group, not in the world).
inline std::string context(std::string_view what, std::string_view group, int rank, int size) {
  return "fived::nccl: rank " + std::to_string(rank) + " of " + std::to_string(size) + " in " + std::string(what) +
         " on group '" + std::string(group) + "'";
}

inline std::string nccl_message(ncclResult_t r, const char* call, ncclComm_t comm) {
  std::string m = std::string(call) + " failed: " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') m += " (" + std::string(last) + ")";
  return m + "; run with NCCL_DEBUG=WARN for NCCL's log";
}

inline std::string cuda_message(cudaError_t e, const char* call) {
  return std::string(call) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

// FIVED_NCCL_TIMEOUT_S: how long the polls (synchronize, barrier, the
// destructor) wait without progress. Strictly parsed (util/env.hpp); a bad
// value is a CommError from init.
inline std::chrono::duration<double> timeout_from_env() {
  try {
    return util::env_seconds("FIVED_NCCL_TIMEOUT_S", 600.0);
  } catch (const std::invalid_argument& e) {
    throw CommError("fived::nccl: " + std::string(e.what()));
  }
}

// FIVED_NCCL_TRACE, for finding a hang: 1 prints every operation as it is enqueued (the
// launcher's RANK, the group and the rank in it, the operation, its number on the group) to
// stderr; 2 also waits for each to finish and says so, which makes every collective
// synchronous (the order of the traces is then the order on the device). Read once.
inline int trace_level() {
  static const int level = [] {
    const char* v = std::getenv("FIVED_NCCL_TRACE");
    return v == nullptr ? 0 : std::atoi(v);
  }();
  return level;
}

inline std::string seconds(std::chrono::duration<double> d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", d.count());
  return buf;
}

}  // namespace detail

class Comm {
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

  Comm(Comm&& o) noexcept : uncaught_(std::uncaught_exceptions()) { take(o); }
  Comm& operator=(Comm&& o) noexcept {
    if (this != &o) {
      release();
      take(o);
    }
    return *this;
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  ~Comm() { release(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }
  int device() const noexcept { return device_; }
  ncclComm_t handle() const noexcept { return comm_; }
  cudaStream_t stream() const noexcept { return stream_; }  // where NCCL runs
  cudaStream_t compute_stream() const noexcept { return compute_; }
  // The stream collectives are ordered against (see the top of this file).
  void set_compute_stream(cudaStream_t s) noexcept { compute_ = s; }

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
    constexpr std::string_view what = "send_recv";
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
    });
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

  // Takes ownership of `c` and creates the stream, events and scratch on its device.
  Comm(ncclComm_t c, std::string name, cudaStream_t compute, std::chrono::duration<double> timeout)
      : comm_(c), compute_(compute), timeout_(timeout), name_(std::move(name)) {
    try {
      check(ncclCommUserRank(comm_, &rank_), "init", "ncclCommUserRank");
      check(ncclCommCount(comm_, &size_), "init", "ncclCommCount");
      check(ncclCommCuDevice(comm_, &device_), "init", "ncclCommCuDevice");
      int current = 0;
      check(cudaGetDevice(&current), "init", "cudaGetDevice");
      struct Restore {
        int device;
        ~Restore() { cudaSetDevice(device); }
      } restore{current};
      check(cudaSetDevice(device_), "init", "cudaSetDevice");
      // Highest priority, so communication kernels are not queued behind compute kernels.
      int least = 0, greatest = 0;
      check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "init", "cudaDeviceGetStreamPriorityRange");
      check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest), "init", "cudaStreamCreateWithPriority");
      check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "init", "cudaEventCreateWithFlags");
      check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "init", "cudaEventCreateWithFlags");
      check(cudaMalloc(reinterpret_cast<void**>(&barrier_), sizeof(double)), "init", "cudaMalloc");
      check(cudaMemset(barrier_, 0, sizeof(double)), "init", "cudaMemset");
    } catch (...) {
      release();
      throw;
    }
  }

  void take(Comm& o) noexcept {
    comm_ = std::exchange(o.comm_, nullptr);
    stream_ = std::exchange(o.stream_, nullptr);
    compute_ = o.compute_;
    ready_ = std::exchange(o.ready_, nullptr);
    done_ = std::exchange(o.done_, nullptr);
    barrier_ = std::exchange(o.barrier_, nullptr);
    host_values_ = std::exchange(o.host_values_, nullptr);
    host_values_size_ = std::exchange(o.host_values_size_, 0);
    rank_ = o.rank_, size_ = o.size_, device_ = o.device_;
    timeout_ = o.timeout_;
    traced_ = o.traced_;
    name_ = std::move(o.name_);
    error_ = std::move(o.error_);
  }

  // Never throws. Normally waits for outstanding work (bounded by the
  // timeout), then destroys the communicator, or aborts it when that wait
  // failed. Aborts at once, without waiting, when this rank is unwinding from
  // an exception (more uncaught exceptions than when this object was made: its
  // peers may never issue the matching collectives) or when NCCL already
  // reports an asynchronous error: a context of many communicators then exits
  // promptly instead of waiting out the timeout once per communicator.
  void release() noexcept {
    if (comm_ != nullptr) {
      bool abort_now = std::uncaught_exceptions() > uncaught_;
      if (!abort_now) {
        ncclResult_t async = ncclSuccess;
        abort_now = ncclCommGetAsyncError(comm_, &async) != ncclSuccess ||
                    (async != ncclSuccess && async != ncclInProgress);
      }
      if (abort_now) {
        ncclCommAbort(std::exchange(comm_, nullptr));
      } else {
        try {
          wait("destroy");
        } catch (...) {  // wait() has aborted the communicator
        }
        if (comm_ != nullptr) ncclCommDestroy(comm_);
        comm_ = nullptr;
      }
    }
    if (barrier_ != nullptr) cudaFree(barrier_);
    if (host_values_ != nullptr) cudaFree(host_values_);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    barrier_ = host_values_ = nullptr, ready_ = done_ = nullptr, stream_ = nullptr;
  }

  // The device buffer for values the host gives and takes back (all_reduce_host,
  // all_to_all_host), at least `n` eight-byte values: grown when a longer exchange comes,
  // so a whole parameter vector goes in one collective. Nothing is in flight on it between
  // calls (each ends with a synchronisation).
  double* host_scratch(std::string_view what, std::size_t n) {
    if (n > host_values_size_) {
      if (host_values_ != nullptr) check(cudaFree(std::exchange(host_values_, nullptr)), what, "cudaFree");
      host_values_size_ = 0;
      check(cudaMalloc(reinterpret_cast<void**>(&host_values_), n * sizeof(double)), what, "cudaMalloc");
      host_values_size_ = n;
    }
    return host_values_;
  }

  // ---- errors --------------------------------------------------------------

  std::string where(std::string_view what) const { return detail::context(what, name_, rank_, size_); }

  // A misuse: throws, the communicator stays usable.
  void expect(bool ok, std::string_view what, const std::string& why) const {
    if (!ok) throw CommError(where(what) + ": " + why);
  }
  // `why` is what comm/arguments.hpp said: empty when the call is valid.
  void expect(std::string_view what, const std::string& why) const {
    if (!why.empty()) throw CommError(where(what) + ": " + why);
  }

  // A failure: aborts the communicator so no rank waits on it, then throws.
  [[noreturn]] void fail(std::string_view what, const std::string& why) {
    if (error_.empty()) error_ = where(what) + ": " + why;
    if (comm_ != nullptr) ncclCommAbort(std::exchange(comm_, nullptr));
    throw CommError(where(what) + ": " + why);
  }

  void check(ncclResult_t r, std::string_view what, const char* call) {
    if (r != ncclSuccess) fail(what, detail::nccl_message(r, call, comm_));
  }
  void check(cudaError_t e, std::string_view what, const char* call) {
    if (e != cudaSuccess) fail(what, detail::cuda_message(e, call));
  }

  void usable(std::string_view what) const {
    if (comm_ != nullptr) return;
    throw CommError(where(what) + ": " +
                    (error_.empty() ? std::string("this communicator was moved from")
                                    : "the communicator was aborted after an earlier error: " + error_));
  }

  // NCCL reads and writes device memory; a host pointer would fault in a kernel.
  template <class T>
  void expect_device(std::string_view what, const char* role, std::span<T> buf) const {
    if (buf.empty()) return;
    cudaPointerAttributes a{};
    cudaError_t e = cudaPointerGetAttributes(&a, buf.data());
    if (e != cudaSuccess) (void)cudaGetLastError();  // not a pointer CUDA knows: clear the error
    expect(e == cudaSuccess && a.type != cudaMemoryTypeUnregistered, what,
           std::string(role) + " buffer is not device memory: the NCCL communicator moves memory from cudaMalloc "
                               "(use fived::host::Comm for host buffers)");
  }

  // ---- issuing and waiting -------------------------------------------------

  // Orders `issue` (which enqueues NCCL work on stream_) between the compute
  // stream's past and future work.
  template <class F>
  void enqueue(std::string_view what, F&& issue) {
    usable(what);
    int current = -1;
    check(cudaGetDevice(&current), what, "cudaGetDevice");
    expect(current == device_, what,
           "the calling thread's current CUDA device is " + std::to_string(current) + " but this communicator is on device " +
               std::to_string(device_) + ": call cudaSetDevice(" + std::to_string(device_) + ") in this thread first");
    check(cudaEventRecord(ready_, compute_), what, "cudaEventRecord (compute stream)");
    check(cudaStreamWaitEvent(stream_, ready_, 0), what, "cudaStreamWaitEvent (communication stream)");
    const int trace = detail::trace_level();
    static const std::string launched_as = std::getenv("RANK") != nullptr ? std::getenv("RANK") : "?";
    if (trace > 0) std::fprintf(stderr, "[RANK %s] %s: #%llu enqueued\n", launched_as.c_str(), where(what).c_str(), ++traced_);
    issue();
    check(cudaEventRecord(done_, stream_), what, "cudaEventRecord (communication stream)");
    check(cudaStreamWaitEvent(compute_, done_, 0), what, "cudaStreamWaitEvent (compute stream)");
    if (trace > 1) {
      wait(what);
      std::fprintf(stderr, "[RANK %s] %s: #%llu done\n", launched_as.c_str(), where(what).c_str(), traced_);
    }
  }

  // Runs `body(add)` between ncclGroupStart and ncclGroupEnd; the group is
  // always closed, and the first failing call is reported.
  template <class F>
  void grouped(std::string_view what, F&& body) {
    check(ncclGroupStart(), what, "ncclGroupStart");
    ncclResult_t first = ncclSuccess;
    const char* first_call = "";
    body([&](ncclResult_t r, const char* call) {
      if (r != ncclSuccess && first == ncclSuccess) first = r, first_call = call;
    });
    ncclResult_t end = ncclGroupEnd();
    check(first, what, first_call);
    check(end, what, "ncclGroupEnd");
  }

  // Polls the communication stream and NCCL's asynchronous error state, so a
  // failed peer or a network error becomes an exception instead of a hang.
  void wait(std::string_view what) {
    usable(what);
    const auto start = std::chrono::steady_clock::now();
    // Spin (yielding) while the wait is short, so small collectives return
    // promptly; then poll every 100 us so a long wait costs no CPU.
    for (int polls = 0;; ++polls) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) check(e, what, "cudaStreamQuery");
      ncclResult_t async = ncclSuccess;
      check(ncclCommGetAsyncError(comm_, &async), what, "ncclCommGetAsyncError");
      if (async != ncclSuccess && async != ncclInProgress) check(async, what, "an asynchronous NCCL operation");
      if (std::chrono::steady_clock::now() - start > timeout_)
        fail(what, "no progress after " + detail::seconds(timeout_) +
                       " s (a rank may have died or not issued the same collectives); "
                       "raise FIVED_NCCL_TIMEOUT_S to wait longer");
      if (polls < 10000)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t compute_ = cudaStreamPerThread;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  double* barrier_ = nullptr;  // the barrier's element, always 0
  double* host_values_ = nullptr;  // the host exchanges' values on the device (host_scratch)
  std::size_t host_values_size_ = 0;
  unsigned long long traced_ = 0;  // operations enqueued, numbered for FIVED_NCCL_TRACE
  int rank_ = 0, size_ = 0, device_ = 0;
  std::chrono::duration<double> timeout_{600.0};
  std::string name_;
  std::string error_;  // the failure that aborted the communicator
  int uncaught_ = std::uncaught_exceptions();  // at construction: more at release means unwinding
};

static_assert(Communicator<Comm>);

}  // namespace fived::nccl
