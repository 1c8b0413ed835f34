#pragma once
// What a fived::nccl::Comm (comm/nccl.hpp) stands on: one NCCL communicator with a stream of
// its own, the events that order it against the compute stream, and how its work is issued,
// waited for and failed. Comm adds the collectives.
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

// The communicator's life (made from an ncclComm_t, moved, released), its errors and the
// issuing and waiting of its work; members protected, for Comm.
class Channel {
 public:
  Channel(Channel&& o) noexcept : uncaught_(std::uncaught_exceptions()) { take(o); }
  Channel& operator=(Channel&& o) noexcept {
    if (this != &o) {
      release();
      take(o);
    }
    return *this;
  }
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  ~Channel() { release(); }

 protected:
  // Takes ownership of `c` and creates the stream, events and scratch on its device.
  Channel(ncclComm_t c, std::string name, cudaStream_t compute, std::chrono::duration<double> timeout)
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
  // stream's past and future work; with join_now false, after its past only: the
  // compute stream waits for it at join_compute() (or at the next enqueue that joins).
  template <class F>
  void enqueue(std::string_view what, F&& issue, bool join_now = true) {
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
    if (join_now) join_compute(what);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;  // (a step captured as a graph: nothing runs yet)
    if (trace > 1 && cudaStreamIsCapturing(stream_, &capturing) == cudaSuccess &&
        capturing == cudaStreamCaptureStatusNone) {
      wait(what);
      std::fprintf(stderr, "[RANK %s] %s: #%llu done\n", launched_as.c_str(), where(what).c_str(), traced_);
    }
  }

  // The compute stream waits for everything enqueued so far (done_ marks the last of it).
  void join_compute(std::string_view what) {
    check(cudaStreamWaitEvent(compute_, done_, 0), what, "cudaStreamWaitEvent (compute stream)");
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
 private:
  void take(Channel& o) noexcept {
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

};

}  // namespace detail
}  // namespace fived::nccl
