#pragma once
// A signal that asks a training run to stop at the end of its step rather than die in the
// middle of one: a cluster's scheduler sends SIGTERM before it preempts or kills a job
// (Slurm with a grace period, or SIGUSR1 ahead of the time limit with --signal=USR1@120),
// a person presses Ctrl-C. While a StopSignal lives, those signals only set a flag, which
// fit (train/trainer.hpp: FitOptions::stop) reads after every step; the ranks agree on it
// (any rank asked: all stop), end after the same step, and its `after` can save there:
//
//   fived::StopSignal stop;  // SIGTERM, SIGINT, SIGUSR1
//   trainer.fit(data, first, last, B, T, {.stop = [&] { return stop.requested(); }},
//               [&](int step, double loss, bool last) { if (last) trainer.save(dir, step); });
//
// A second signal a second or more after the first takes the signal's default action: a
// second Ctrl-C ends the process at once. (Sooner it is the same request again: `timeout`,
// and launchers like it, send the signal to the process and then to its process group.)
// Blocking calls in other threads are restarted, not failed (SA_RESTART). One StopSignal at
// a time; its destructor puts back the handlers it found.

#include <atomic>
#include <csignal>
#include <cstdint>
#include <ctime>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

namespace fived {

class StopSignal {
 public:
  explicit StopSignal(std::initializer_list<int> signals = {SIGTERM, SIGINT, SIGUSR1}) {
    if (installed().exchange(true))
      throw std::logic_error("fived::StopSignal: one is already installed; share it rather than make a second");
    caught() = 0;
    sigset_t all;  // the handler runs with every one of them held back: one at a time
    sigemptyset(&all);
    for (int s : signals) sigaddset(&all, s);
    for (int s : signals) {
      struct sigaction now {}, before {};
      now.sa_handler = &on_signal;
      now.sa_mask = all;
      now.sa_flags = SA_RESTART;
      if (sigaction(s, &now, &before) != 0) {
        restore();
        throw std::invalid_argument("fived::StopSignal: cannot catch signal " + std::to_string(s));
      }
      saved_.push_back({s, before});
    }
  }
  ~StopSignal() { restore(); }
  StopSignal(const StopSignal&) = delete;
  StopSignal& operator=(const StopSignal&) = delete;

  // Whether one of the signals came (this process only: fit agrees over the ranks).
  bool requested() const { return caught() != 0; }
  // The signal that came first, 0 while none has.
  int signal() const { return caught(); }
  // Its name ("SIGTERM"), or "signal N".
  std::string name() const {
    switch (caught()) {
      case SIGTERM: return "SIGTERM";
      case SIGINT: return "SIGINT";
      case SIGUSR1: return "SIGUSR1";
      case SIGUSR2: return "SIGUSR2";
      case SIGHUP: return "SIGHUP";
      default: return "signal " + std::to_string(caught());
    }
  }

 private:
  struct Saved {
    int signal;
    struct sigaction action;
  };
  // Lock-free atomics are what a handler may touch: the first signal's number, and when it
  // came (CLOCK_MONOTONIC, ns).
  static std::atomic<int>& caught() {
    static std::atomic<int> s{0};
    return s;
  }
  static std::atomic<std::int64_t>& first_at() {
    static std::atomic<std::int64_t> t{0};
    return t;
  }
  static std::atomic<bool>& installed() {
    static std::atomic<bool> b{false};
    return b;
  }
  // Only async-signal-safe calls: clock_gettime, signal, raise.
  static void on_signal(int s) {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const std::int64_t now = std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
    int none = 0;
    if (caught().compare_exchange_strong(none, s)) {
      first_at() = now;
    } else if (now - first_at() >= 1000000000) {  // asked again: the default action (the end)
      std::signal(s, SIG_DFL);
      std::raise(s);
    }
  }
  void restore() {
    for (auto s = saved_.rbegin(); s != saved_.rend(); ++s) sigaction(s->signal, &s->action, nullptr);
    saved_.clear();
    installed() = false;
  }
  static_assert(std::atomic<int>::is_always_lock_free && std::atomic<std::int64_t>::is_always_lock_free,
                "a signal handler may only touch lock-free atomics");

  std::vector<Saved> saved_;
};

}  // namespace fived
