#pragma once
// This process as one rank of an MPI job: what the host backend's ranks as
// processes (comm/mpi.hpp) share within a process. Made on first use: MPI
// started with MPI_THREAD_MULTIPLE (a rank's compute and communication threads
// call collectives on different groups at once), each rank's process id and
// host exchanged, a channel for failure notices opened.
//
// Failure is loud and bounded, never a hang. Every wait for a peer polls, and
// between polls looks for three things:
//   - a notice from a rank that failed ("rank 2 threw: ..."), which every
//     rank sends its peers when its own function ends in an exception;
//   - a peer on this host whose process is gone (killed, or exited before the
//     run ended), every 50 ms;
//   - the timeout (RunOptions::timeout, else FIVED_HOST_TIMEOUT_S, else 60 s).
// Any of them fails the wait with a CommError naming this rank, the call and the
// cause. A launcher that ends the job first (mpirun terminates the other ranks
// when one dies) meets a SIGTERM handler that says the same: which call this
// rank was in and which peers are gone. A process whose run failed ends with
// MPI_Abort at exit (after a moment for its notices to arrive), so no rank waits
// in MPI_Finalize for a peer that is not coming.

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // MPI's C API only: keep the deprecated C++ bindings out
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fived/comm/types.hpp"

namespace fived::mpi {

// The number of processes the launcher started, when it is an MPI launcher:
// Open MPI's mpirun (OMPI_COMM_WORLD_SIZE), MPICH's or Intel MPI's mpiexec and
// srun --mpi=pmi2 (PMI_SIZE), srun --mpi=pmix (PMIX_RANK with SLURM_NTASKS).
inline std::optional<int> launched_size() {
  auto number = [](const char* name) -> std::optional<int> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end != '\0' || n < 1) return std::nullopt;
    return static_cast<int>(n);
  };
  if (auto n = number("OMPI_COMM_WORLD_SIZE")) return n;
  if (auto n = number("PMI_SIZE")) return n;
  if (std::getenv("PMIX_RANK") != nullptr) return number("SLURM_NTASKS");
  return std::nullopt;
}

namespace detail {

// MPI's errors as return codes, not the end of the process (MPI's default): a wait
// that fails must still say why, and tell the peers.
inline void returns_errors(MPI_Comm c) { MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN); }

// Throws CommError "<who>: <call> failed: <MPI's text>" unless rc is MPI_SUCCESS.
inline void check(int rc, const char* call, const char* who = "fived host backend") {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError(std::string(who) + ": " + call + " failed: " + std::string(text, len));
}

// What the SIGTERM handler reads: fixed storage, and whether this rank's run has failed
// (its exception says why, so the handler says nothing more; and the exit handler ends the
// job with MPI_Abort).
inline char current_call[256] = "between collectives";
inline volatile sig_atomic_t failure_reported = 0;

class Process {
 public:
  static constexpr int notice_tag = 1;

  int rank = 0, size = 1;
  std::chrono::milliseconds timeout{60000};

  // Never destroyed: the exit handler and the signal handler use it to the very end.
  static Process& get() {
    static Process* p = new Process;
    return *p;
  }

  // Polls `done` until it holds. Between polls: a peer's failure notice, a peer
  // on this host that is gone, the timeout; each throws CommError naming
  // `rank_name` (this rank, by world rank) and `what` (the call and its group).
  template <class Done>
  void wait(Done&& done, int rank_name, const std::string& what) {
    std::snprintf(current_call, sizeof current_call, "in %s", what.c_str());
    struct Leave {  // however the wait ends
      ~Leave() { std::strcpy(current_call, "between collectives"); }
    } leave;
    const auto start = std::chrono::steady_clock::now();
    auto next_look = start;
    for (int polls = 0;; ++polls) {
      try {
        if (done()) return;
      } catch (const CommError& e) {  // MPI saw a failure itself: most often, a peer that is gone
        const std::string gone = peers_gone();
        fail(gone.empty() ? std::string(e.what()) : gone + " (killed, or exited before the run ended)", true);
      }
      if (std::string why = failure(); !why.empty()) throw_aborted(rank_name, what, why);
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_look) {
        next_look = now + std::chrono::milliseconds(50);
        if (std::string gone = peers_gone(); !gone.empty())
          fail(gone + " (killed, or exited before the run ended)", /*tell_peers=*/true);
        else if (now - start > timeout)
          fail("rank " + std::to_string(rank) + " timed out after " + std::to_string(timeout.count()) +
                   " ms waiting in " + what +
                   " (a peer is stuck or never calls it; RunOptions::timeout or FIVED_HOST_TIMEOUT_S sets the limit)",
               /*tell_peers=*/true);
      }
      // Yield at first (a peer on the same core must run), then sleep: many ranks share few cores.
      if (polls < 200) sched_yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(polls < 2000 ? 50 : 500));
    }
  }

  // Records the run's failure (the first reason is kept) and, for a cause this
  // rank found itself, tells every peer, so that they stop too and say why.
  void fail(const std::string& reason, bool tell_peers) {
    std::lock_guard lk(mu_);
    failure_reported = 1;
    if (!reason_.empty()) return;
    reason_ = reason;
    if (!tell_peers) return;
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      MPI_Request req;
      if (MPI_Isend(reason_.data(), static_cast<int>(reason_.size()), MPI_CHAR, r, notice_tag, notices_, &req) ==
          MPI_SUCCESS)
        told_.push_back(req);
    }
  }

  // The run's failure: recorded here, or a notice a peer sent; empty while healthy.
  std::string failure() {
    std::lock_guard lk(mu_);
    if (!reason_.empty()) return reason_;
    int flag = 0;
    MPI_Message msg;
    MPI_Status st;
    if (MPI_Improbe(MPI_ANY_SOURCE, notice_tag, notices_, &flag, &msg, &st) != MPI_SUCCESS || !flag) return {};
    int n = 0;
    MPI_Get_count(&st, MPI_CHAR, &n);
    std::string text(static_cast<std::size_t>(n), '\0');
    MPI_Mrecv(text.data(), n, MPI_CHAR, &msg, MPI_STATUS_IGNORE);
    failure_reported = 1;
    reason_ = text;
    return reason_;
  }

  [[noreturn]] static void throw_aborted(int rank_name, const std::string& what, const std::string& why) {
    throw CommError("fived host backend: rank " + std::to_string(rank_name) + " in " + what +
                    ": the run was aborted: " + why);
  }

  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

 private:
  std::mutex mu_;
  std::string reason_;
  MPI_Comm notices_ = MPI_COMM_NULL;
  std::vector<MPI_Request> told_;
  std::vector<long> pids_;      // [world rank]
  std::vector<char> same_host_;  // [world rank]: its process can be looked at from here

  Process() {
    int initialized = 0;
    check(MPI_Initialized(&initialized), "MPI_Initialized");
    int provided = MPI_THREAD_SINGLE;
    if (initialized) check(MPI_Query_thread(&provided), "MPI_Query_thread");
    else check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    if (provided < MPI_THREAD_MULTIPLE)
      throw CommError(
          "fived host backend: MPI gives this process less than MPI_THREAD_MULTIPLE, which ranks as processes need (a "
          "rank's communication thread calls collectives while its compute thread does): use an MPI built with "
          "thread support, or start MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE) if the program starts it itself");
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
    check(MPI_Comm_dup(MPI_COMM_WORLD, &notices_), "MPI_Comm_dup");
    returns_errors(notices_);

    // Who runs where: a peer on this host can be looked at (kill(pid, 0)) while waiting for it.
    struct Where {
      long pid;
      char host[MPI_MAX_PROCESSOR_NAME];
    } mine{static_cast<long>(getpid()), {}};
    int len = 0;
    check(MPI_Get_processor_name(mine.host, &len), "MPI_Get_processor_name");
    std::vector<Where> all(static_cast<std::size_t>(size));
    check(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, MPI_COMM_WORLD),
          "MPI_Allgather of the ranks' process ids");
    for (const Where& w : all) {
      pids_.push_back(w.pid);
      same_host_.push_back(std::strncmp(w.host, mine.host, sizeof mine.host) == 0);
    }

    struct sigaction sa {};
    sa.sa_handler = &Process::on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
    std::atexit([] { Process::get().at_exit(); });
  }

  // "rank 2 (pid 4242) is gone", for the peers on this host whose process is no more; else empty.
  std::string peers_gone() const {
    std::string gone;
    for (int r = 0; r < size; ++r)
      if (r != rank && same_host_[r] && kill(static_cast<pid_t>(pids_[r]), 0) == -1 && errno == ESRCH)
        gone += (gone.empty() ? "" : ", ") + ("rank " + std::to_string(r) + " (pid " + std::to_string(pids_[r]) + ")");
    return gone.empty() ? gone : gone + " is gone";
  }

  void at_exit() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (!failure_reported) {
      MPI_Finalize();
      return;
    }
    // Give the notices a moment to arrive, then end the whole job: a peer must not wait for this rank.
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    int done = 0;
    while (!told_.empty() && !done && std::chrono::steady_clock::now() < until) {
      MPI_Testall(static_cast<int>(told_.size()), told_.data(), &done, MPI_STATUSES_IGNORE);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  // The launcher ends the job (another rank died or failed): say where this rank
  // was and which peers are gone. Only async-signal-safe calls (write, kill, _exit).
  static void on_stop_signal(int sig) {
    if (failure_reported) _exit(1);  // this rank's exception says why
    char text[1024];
    std::size_t n = 0;
    auto put = [&](const char* s) {
      while (*s && n < sizeof text - 1) text[n++] = *s++;
    };
    auto put_int = [&](long v) {
      char digits[24];
      int k = 0;
      if (v < 0) put("-"), v = -v;
      do digits[k++] = static_cast<char>('0' + v % 10), v /= 10;
      while (v > 0 && k < 23);
      while (k > 0 && n < sizeof text - 1) text[n++] = digits[--k];
    };
    const Process& p = get();  // made before the handler was installed
    put("fived host backend: rank ");
    put_int(p.rank);
    put(" ");
    put(current_call);
    put(": stopped by signal ");
    put_int(sig);
    put(" (the launcher ends the job)");
    for (int r = 0; r < p.size; ++r)
      if (r != p.rank && p.same_host_[r] && kill(static_cast<pid_t>(p.pids_[r]), 0) == -1 && errno == ESRCH)
        put("; rank "), put_int(r), put(" (pid "), put_int(p.pids_[r]), put(") is gone");
    put("\n");
    (void)!write(2, text, n);
    _exit(128 + sig);
  }
};

}  // namespace detail

}  // namespace fived::mpi
