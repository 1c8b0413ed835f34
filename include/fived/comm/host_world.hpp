#pragma once
// The host backend's threads (comm/host.hpp): what one run's ranks share. Groups
// with their rendezvous posts, point-to-point mailboxes and the condition variable
// their waiters sleep on; the World, with one mutex for every group, the waits of
// every thread of every rank, the deadlock check over them (a rank is blocked only
// while all its threads wait), the abort that wakes everyone with the first cause,
// and the timeout a wait gives up after.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fived/comm/call_check.hpp"
#include "fived/comm/types.hpp"
#include "fived/util/env.hpp"

namespace fived::host {

struct RunOptions {
  // Longest a rank waits in one collective before the run is aborted. The
  // deadlock detector catches most hangs at once; this covers a rank stuck in
  // its own computation. Set: used as given (it must be positive), whatever
  // the environment says. Unset: FIVED_HOST_TIMEOUT_S (seconds, strictly
  // parsed: run() throws std::invalid_argument for a value that is not a
  // positive number), or when that is unset or empty 300 s for threads (whose
  // deadlock check finds most hangs at once) and 60 s for processes.
  std::optional<std::chrono::milliseconds> timeout{};
};

namespace detail {

// What one rank brings to a rendezvous.
struct Post {
  std::string op;
  DType dtype = DType::u8;
  std::size_t count = 0;  // elements sent (meaning depends on op)
  int root = -1;
  ReduceOp reduce = ReduceOp::sum;
  const void* send = nullptr;
  std::span<const std::size_t> send_counts{}, recv_counts{};  // all_to_all_v
  int color = 0, key = 0;                                 // split
  std::string name{};                                     // split: the new group's name
};

struct Group;

// One message in flight between two ranks of a group (point-to-point).
struct Message {
  DType dtype;
  std::vector<std::byte> bytes;
};

struct Group {
  std::string name;
  std::vector<int> members;  // world ranks; index = rank in this group
  // rendezvous state
  std::vector<Post> posts;
  std::vector<char> inside;  // per group rank: in a call on this group (posted, not yet returned)
  int arrived = 0, departed = 0;
  bool ready = false;
  std::uint64_t generation = 0;
  std::vector<std::shared_ptr<Group>> split_result;  // per group rank
  std::map<std::pair<int, int>, std::deque<Message>> mailbox;  // (src, dst) group ranks
  // Where this group's waiters sleep (under World::mu, like the rest): a call on one group
  // wakes only its own members, not every thread of the run. (With one condition variable
  // for the run, the demo's 4 ranks on 2 cores spent a fifth of their time being woken.)
  std::condition_variable cv;

  std::string describe() const { return fived::detail::describe_group(name, members); }
};

// Shared state of one run: one mutex guards everything, which keeps the
// deadlock check exact (it sees every rank's wait at once); waiters sleep on their
// group's condition variable.
struct World;

// The wait entries a thread holds, ended with the thread (a thread_local's destructor): a
// helper thread that has returned must not count as a running thread of its rank, or the
// deadlock check would wait out the timeout for it.
struct ThreadEntries {
  std::vector<std::pair<std::weak_ptr<World>, int>> of;  // (run, rank) this thread has an entry in
  ~ThreadEntries();
};
inline thread_local ThreadEntries thread_entries;

struct World : std::enable_shared_from_this<World> {
  World(int n, std::chrono::milliseconds t) : size(n), timeout(t), waiting(n), finished(n, false), own_thread(n) {}

  // A rank may call collectives from several threads (its compute thread and a
  // communication thread, on different groups): its own thread from the start and every
  // thread from its first collective have an entry, and the rank is blocked only while all
  // of them wait. A thread's entries end with it (ThreadEntries).
  struct Wait {
    std::thread::id thread;
    bool active = false;
    std::string what;             // "all_reduce on group tp {0,1}"
    std::function<bool()> done;   // the condition it waits for
  };

  int size;
  std::chrono::milliseconds timeout;  // per wait, resolved from RunOptions / the environment
  std::mutex mu;
  std::vector<std::vector<Wait>> waiting;  // per rank, one per thread that has waited
  std::vector<bool> finished;
  std::vector<std::thread::id> own_thread;  // each rank's own thread (its entry ends with `finished`)
  std::string abort_reason;  // empty while healthy
  bool ended = false;        // host::run has returned: a Comm kept past it must not wait
  std::vector<std::shared_ptr<Group>> groups;  // every group of the run, for the end-of-run check

  // Messages still in a mailbox when the run ends were sent and never
  // received: a later receive would have taken a stale message.
  std::string undelivered() const {
    std::string why;
    for (const auto& g : groups)
      for (const auto& [route, box] : g->mailbox)
        if (!box.empty())
          why += "\n  rank " + std::to_string(g->members[route.first]) + " sent " + std::to_string(box.size()) +
                 " message(s) to rank " + std::to_string(g->members[route.second]) + " on group " + g->describe() +
                 " that were never received";
    return why;
  }

  // Marks the run failed and wakes everyone. Keeps the first reason.
  void abort(std::string reason) {
    if (abort_reason.empty()) abort_reason = std::move(reason);
    for (const auto& g : groups) g->cv.notify_all();
  }

  // Called with `mu` held whenever a rank starts waiting or finishes: if every
  // live rank waits on a condition that is false, nothing can make progress.
  void check_deadlock() {
    if (!abort_reason.empty()) return;
    int live = 0;
    for (int r = 0; r < size; ++r) {
      if (finished[r]) continue;
      ++live;
      if (waiting[r].empty()) return;
      for (const Wait& w : waiting[r])
        if (!w.active || w.done()) return;
    }
    if (live == 0) return;
    std::string why = "deadlock: every running rank waits for a peer that will never come:";
    for (int r = 0; r < size; ++r)
      for (const Wait& w : finished[r] ? std::vector<Wait>(1) : waiting[r])
        why += "\n  rank " + std::to_string(r) + (finished[r] ? " has returned from its function" : " waits in " + w.what);
    abort(why);
  }

  // Blocks rank `r` until `done()` holds, asleep on `g`'s condition variable (whoever makes
  // `done()` true notifies it); throws CommError on abort or timeout. A wait whose condition
  // already holds completes even after an abort, so a collective that finished is reported
  // as finished; the next call throws.
  void wait(std::unique_lock<std::mutex>& lk, Group& g, int r, const std::string& what, std::function<bool()> done) {
    // Every thread that calls a collective has an entry, also one whose peers are always there
    // first: otherwise a rank whose compute thread is running, unseen, while its communication
    // thread waits would count as blocked, and a healthy run as deadlocked.
    (void)slot_of(r);
    if (done()) return;
    if (!abort_reason.empty()) throw_aborted(r, what);
    Wait& slot = slot_of(r);
    slot = {std::this_thread::get_id(), true, what, done};
    check_deadlock();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    bool timed_out = false;
    while (abort_reason.empty() && !done()) {
      if (g.cv.wait_until(lk, deadline) == std::cv_status::timeout && !done()) {
        timed_out = true;
        break;
      }
    }
    slot_of(r) = {std::this_thread::get_id(), false, {}, {}};
    if (timed_out)
      abort("rank " + std::to_string(r) + " timed out after " + std::to_string(timeout.count()) +
            " ms waiting in " + what +
            " (a peer is stuck or never calls it; RunOptions::timeout or FIVED_HOST_TIMEOUT_S sets the limit)");
    if (!abort_reason.empty() && !done()) throw_aborted(r, what);
  }

  // This thread's entry for rank r (entries are never removed: a reference stays valid
  // only until the next new thread of the rank, so callers look it up again).
  Wait& slot_of(int r) {
    auto& ws = waiting[static_cast<std::size_t>(r)];
    for (Wait& w : ws)
      if (w.thread == std::this_thread::get_id()) return w;
    // Another thread of the rank: its entry ends with it. (Not the rank's own thread, whose
    // end is `finished`: registering a thread_local's destructor allocates, which must not
    // be able to fail a run of many ranks near the address-space limit.)
    if (std::this_thread::get_id() != own_thread[static_cast<std::size_t>(r)])
      thread_entries.of.emplace_back(weak_from_this(), r);
    return ws.emplace_back(Wait{std::this_thread::get_id(), false, {}, {}});
  }

  // Blocks until `done()` holds, whatever happens elsewhere. Used where peers
  // are still reading this rank's buffers: leaving early (and freeing them)
  // would be a use-after-free. The peers cannot block while reading, so this
  // ends in bounded time; the caller reports an abort afterwards.
  void wait_uninterruptible(std::unique_lock<std::mutex>& lk, Group& g, const std::function<bool()>& done) {
    g.cv.wait(lk, done);
  }

  // At the start of every call: a run that failed, or that has ended, fails the call at once.
  void check_open(int r, const std::string& what) const {
    if (ended)
      throw CommError("fived host backend: rank " + std::to_string(r) + " in " + what +
                      ": the host::run this communicator belongs to has returned (a Comm is used only inside its "
                      "run's function)");
    if (!abort_reason.empty()) throw_aborted(r, what);
  }

  [[noreturn]] void throw_aborted(int r, const std::string& what) const {
    throw CommError("fived host backend: rank " + std::to_string(r) + " in " + what + ": the run was aborted: " +
                    abort_reason);
  }
};

inline constexpr double max_timeout_s = 365.0 * 24 * 3600;

// RunOptions::timeout if set, else FIVED_HOST_TIMEOUT_S, else `default_s`; at most a year.
inline std::chrono::milliseconds resolve_timeout(const RunOptions& o, double default_s = 300.0) {
  if (o.timeout) {
    if (o.timeout->count() <= 0)
      throw std::invalid_argument("fived::host::run: RunOptions::timeout is " + std::to_string(o.timeout->count()) +
                                  " ms: it must be positive (leave it unset for FIVED_HOST_TIMEOUT_S or 300 s)");
    return std::min(*o.timeout, std::chrono::milliseconds(static_cast<std::int64_t>(max_timeout_s) * 1000));
  }
  // At most a year: a longer wait is no timeout, and far larger values (1e10, 1e300 s) would
  // overflow the clock's arithmetic into a timeout already past.
  const auto s = std::min(util::env_seconds("FIVED_HOST_TIMEOUT_S", default_s), std::chrono::duration<double>(max_timeout_s));
  // at least 1 ms: a sub-millisecond value must not become a timeout of zero
  return std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(s));
}

inline ThreadEntries::~ThreadEntries() {
  for (const auto& [run, r] : of)
    if (const std::shared_ptr<World> w = run.lock()) {
      std::lock_guard lk(w->mu);
      auto& ws = w->waiting[static_cast<std::size_t>(r)];
      std::erase_if(ws, [](const World::Wait& x) { return x.thread == std::this_thread::get_id(); });
      w->check_deadlock();
    }
}

}  // namespace detail

}  // namespace fived::host
