#pragma once
// The host backend: every rank is a thread of one process, collectives read
// each other's buffers through shared memory. It exists so that every parallel
// configuration can be tested without a GPU.
//
//   fived::host::run(8, [](fived::host::Comm& world) { ... });
//
// Or every rank is a process: built with FIVED_WITH_MPI (link fived::mpi) and
// started by mpirun, mpiexec or srun as n processes, run(n, fn) runs fn once in
// each, over MPI (comm/mpi.hpp), with the same results and the same checks.
//
// Results are deterministic: reductions add contributions in group-rank order,
// so every rank gets bit-identical values, run after run.
//
// Misuse never hangs. Each collective is a rendezvous on its group; the last
// rank to arrive checks that all ranks called the same collective with fitting
// sizes. A mismatch, an exception escaping a rank's function, a deadlock (every
// live rank waiting on a rendezvous that cannot complete) or a timeout aborts
// the run: every rank that waits or calls a collective afterwards gets a
// CommError naming itself, the collective, the group and the cause.
//
// Arguments are checked by the rules in comm/arguments.hpp, the same ones the
// NCCL backend applies, aliasing included: a call this backend accepts is not
// refused by NCCL for its buffers' layout.
//
// Messages name ranks by world rank: "fived host backend: rank 3 in all_reduce
// on group tp {2,3}: ...".

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <new>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/comm/arguments.hpp"
#include "fived/comm/call_check.hpp"
#include "fived/comm/communicator.hpp"
#include "fived/comm/rank_order_reduce.hpp"
#include "fived/comm/types.hpp"
#include "fived/device/buffer.hpp"
#include "fived/util/env.hpp"
#if defined(FIVED_WITH_MPI)
#include "fived/comm/mpi.hpp"
#endif

namespace fived::host {

struct RunOptions {
  // Longest a rank waits in one collective before the run is aborted. The
  // deadlock detector catches most hangs at once; this covers a rank stuck in
  // its own computation. Set: used as given (it must be positive), whatever
  // the environment says. Unset: FIVED_HOST_TIMEOUT_S (seconds, strictly
  // parsed: run() throws std::invalid_argument for a value that is not a
  // positive number), or 300 s when that is unset or empty.
  std::optional<std::chrono::milliseconds> timeout{};
};

namespace detail {

// Built with MPI (FIVED_WITH_MPI), a rank may be a process of an MPI job instead
// of a thread (comm/mpi.hpp); without, it never is.
#if defined(FIVED_WITH_MPI)
using ProcessGroup = mpi::Group;
inline constexpr bool with_processes = true;
#else
struct ProcessGroup {};
inline constexpr bool with_processes = false;
#endif

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

  std::string describe() const {
    std::string s = name + " {";
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(members[i]);
    }
    return s + "}";
  }
};

// Shared state of one run: one mutex guards everything, which keeps the
// deadlock check exact (it sees every rank's wait at once).
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
  std::condition_variable cv;
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
    cv.notify_all();
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

  // Blocks rank `r` until `done()` holds; throws CommError on abort or timeout.
  // A wait whose condition already holds completes even after an abort, so a
  // collective that finished is reported as finished; the next call throws.
  void wait(std::unique_lock<std::mutex>& lk, int r, const std::string& what, std::function<bool()> done) {
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
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && !done()) {
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
  void wait_uninterruptible(std::unique_lock<std::mutex>& lk, const std::function<bool()>& done) {
    cv.wait(lk, done);
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
      w->cv.notify_all();
    }
}

}  // namespace detail

// A communicator over one group of the run. Cheap to copy; all copies are the
// same rank of the same group.
class Comm {
 public:
  Comm(std::shared_ptr<detail::World> w, std::shared_ptr<detail::Group> g, int rank)
      : world_(std::move(w)), group_(std::move(g)), rank_(rank) {}
#if defined(FIVED_WITH_MPI)
  // This rank as a process of an MPI job, on one group of it (comm/mpi.hpp).
  explicit Comm(std::shared_ptr<mpi::Group> p)
      : group_(std::make_shared<detail::Group>()), rank_(p->rank()), process_(std::move(p)) {
    group_->name = process_->name(), group_->members = process_->members();
  }
#endif

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(group_->members.size()); }
  const std::string& name() const { return group_->name; }
  int world_rank() const { return group_->members[rank_]; }
  const std::vector<int>& members() const { return group_->members; }

  template <CommElement T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, ReduceOp op = ReduceOp::sum) {
    require("all_reduce", args::all_reduce(rank_, size(), send, recv));
    if (as_process([&](auto& g) { g.template all_reduce<T>(send, recv, op); })) return;
    std::vector<T> out(send.size());
    rendezvous({.op = "all_reduce", .dtype = dtype_of<T>, .count = send.size(), .reduce = op, .send = send.data()},
               [&](const std::vector<detail::Post>& p) {
                 reduce_into<T>(out, p, 0, op);
               });
    std::copy(out.begin(), out.end(), recv.begin());
  }
  template <CommElement T>
  void all_reduce(std::span<T> buf, ReduceOp op = ReduceOp::sum) {
    all_reduce<T>(buf, buf, op);
  }

  template <CommElement T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, ReduceOp op = ReduceOp::sum) {
    require("reduce_scatter", args::reduce_scatter(rank_, size(), send, recv));
    if (as_process([&](auto& g) { g.template reduce_scatter<T>(send, recv, op); })) return;
    std::vector<T> out(recv.size());
    rendezvous({.op = "reduce_scatter", .dtype = dtype_of<T>, .count = send.size(), .reduce = op, .send = send.data()},
               [&](const std::vector<detail::Post>& p) { reduce_into<T>(out, p, rank_ * recv.size(), op); });
    std::copy(out.begin(), out.end(), recv.begin());
  }

  template <CommElement T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    require("all_gather", args::all_gather(rank_, size(), send, recv));
    if (as_process([&](auto& g) { g.template all_gather<T>(send, recv); })) return;
    std::vector<T> out(recv.size());
    rendezvous({.op = "all_gather", .dtype = dtype_of<T>, .count = send.size(), .send = send.data()},
               [&](const std::vector<detail::Post>& p) {
                 for (int r = 0; r < size(); ++r)
                   std::copy_n(static_cast<const T*>(p[r].send), send.size(), out.begin() + r * send.size());
               });
    std::copy(out.begin(), out.end(), recv.begin());
  }

  // Equal blocks: block j of `send` goes to rank j, block i of `recv` comes from rank i.
  template <CommElement T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    require("all_to_all", args::all_to_all(rank_, size(), send, recv));
    if (as_process([&](auto& g) { g.template all_to_all<T>(send, recv); })) return;
    const std::vector<std::size_t> counts(size(), send.size() / size());
    exchange<T>("all_to_all", send, counts, recv, counts);
  }

  // Per-peer counts (elements); blocks are packed in rank order on both sides.
  template <CommElement T>
  void all_to_all_v(std::span<const std::type_identity_t<T>> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) {
    require("all_to_all_v", args::all_to_all_v(rank_, size(), send, send_counts, recv, recv_counts));
    if (as_process([&](auto& g) { g.template all_to_all_v<T>(send, send_counts, recv, recv_counts); })) return;
    exchange<T>("all_to_all_v", send, send_counts, recv, recv_counts);
  }

  // Grouped point-to-point: all sends are posted before any receive waits, so
  // exchanges in both directions (ring, pipeline) do not deadlock.
  template <CommElement T>
  void send_recv(std::span<const SendOp<T>> sends, std::span<const RecvOp<T>> recvs) {
    // Arguments first (a bad peer is this rank's own error), then the abort
    // check, which send-only calls would otherwise skip; no message is posted
    // unless the whole call is valid.
    require("send_recv", args::send_recv<T>(rank_, size(), sends, recvs));
    if (as_process([&](auto& g) { g.template send_recv<T>(sends, recvs); })) return;
    std::unique_lock lk(world_->mu);
    world_->check_open(world_rank(), where("send_recv"));
    for (const auto& s : sends) {
      const auto* b = reinterpret_cast<const std::byte*>(s.buf.data());
      group_->mailbox[{rank_, s.peer}].push_back({dtype_of<T>, std::vector<std::byte>(b, b + s.buf.size_bytes())});
    }
    world_->cv.notify_all();
    for (const auto& r : recvs) {
      auto& box = group_->mailbox[{r.peer, rank_}];
      world_->wait(lk, world_rank(), "send_recv (receive from rank " + std::to_string(group_->members[r.peer]) + ") on group " +
                                         group_->describe(),
                   [&box] { return !box.empty(); });
      detail::Message m = std::move(box.front());
      box.pop_front();
      if (m.dtype != dtype_of<T> || m.bytes.size() != r.buf.size_bytes()) {
        const std::string why = "send_recv on group " + group_->describe() + ": rank " +
                                std::to_string(group_->members[r.peer]) + " sent " + std::to_string(m.bytes.size()) +
                                " bytes of " + std::string(dtype_name(m.dtype)) + " but rank " + std::to_string(world_rank()) +
                                " expects " + std::to_string(r.buf.size_bytes()) + " bytes of " +
                                std::string(dtype_name(dtype_of<T>));
        world_->abort(why);
        world_->throw_aborted(world_rank(), "send_recv on group " + group_->describe());
      }
      std::memcpy(r.buf.data(), m.bytes.data(), m.bytes.size());
    }
  }

  template <CommElement T>
  void broadcast(std::span<T> buf, int root) {
    require("broadcast", args::broadcast(rank_, size(), root));
    if (as_process([&](auto& g) { g.template broadcast<T>(buf, root); })) return;
    std::vector<T> out(buf.size());
    rendezvous({.op = "broadcast", .dtype = dtype_of<T>, .count = buf.size(), .root = root, .send = buf.data()},
               [&](const std::vector<detail::Post>& p) {
                 std::copy_n(static_cast<const T*>(p[root].send), buf.size(), out.begin());
               });
    std::copy(out.begin(), out.end(), buf.begin());
  }

  void barrier() {
    if (as_process([](auto& g) { g.barrier(); })) return;
    rendezvous({.op = "barrier"}, [](const auto&) {});
  }

  // Host collectives have completed when they return: nothing to wait for.
  // Here so that code generic over Communicator can call it on every backend.
  void synchronize() {}

  // One communicator per color; ranks ordered by key, then by rank here.
  Comm split(int color, int key, std::string name) {
    require("split", args::split(color));
    std::optional<Comm> part;
    if (as_process([&](auto& g) { part.emplace(g.split(color, key, name)); })) return std::move(*part);
    std::shared_ptr<detail::Group> mine;
    rendezvous({.op = "split", .color = color, .key = key, .name = name},
               [&](const auto&) { mine = group_->split_result[rank_]; },
               [this, name](detail::Group& g) { make_split(g, name); });
    const auto& m = mine->members;
    const int r = static_cast<int>(std::find(m.begin(), m.end(), world_rank()) - m.begin());
    return Comm(world_, std::move(mine), r);
  }

 private:
  std::shared_ptr<detail::World> world_;      // the threads' run; null for a process
  std::shared_ptr<detail::Group> group_;      // the threads' rendezvous; for a process, its name and members
  int rank_ = 0;
  std::shared_ptr<detail::ProcessGroup> process_;  // set: this rank is a process of an MPI job

  // Runs f(process group) and says true when this rank is a process; false when it is a thread.
  template <class F>
  bool as_process(F&& f) {
    if constexpr (detail::with_processes)
      if (process_) {
        f(*process_);
        return true;
      }
    return false;
  }

  // all_to_all and all_to_all_v, with arguments already checked; `op` is the
  // collective's own name, for messages and the mismatch check.
  template <class T>
  void exchange(const char* op, std::span<const T> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                std::span<const std::size_t> recv_counts) {
    const auto n = static_cast<std::size_t>(size());
    std::vector<T> out(recv.size());
    rendezvous({.op = op, .dtype = dtype_of<T>, .count = send.size(), .send = send.data(),
                .send_counts = send_counts, .recv_counts = recv_counts},
               [&](const std::vector<detail::Post>& p) {
                 std::size_t at = 0;
                 for (std::size_t src = 0; src < n; ++src) {
                   const auto* base = static_cast<const T*>(p[src].send) + offset(p[src].send_counts, rank_);
                   std::copy_n(base, recv_counts[src], out.begin() + at);
                   at += recv_counts[src];
                 }
               });
    std::copy(out.begin(), out.end(), recv.begin());
  }

  std::string where(std::string_view op) const {
    return std::string(op) + " on group " + group_->describe();
  }

  // `why` is what comm/arguments.hpp said: empty when the call is valid.
  void require(std::string_view op, const std::string& why) const {
    if (!why.empty())
      throw CommError("fived host backend: rank " + std::to_string(world_rank()) + " in " + where(op) + ": " + why);
  }
  static std::size_t offset(std::span<const std::size_t> c, int upto) {
    std::size_t s = 0;
    for (int i = 0; i < upto; ++i) s += c[i];
    return s;
  }

  // out[i] = the reduction over ranks, in rank order, of send_r[base + i].
  template <class T>
  void reduce_into(std::vector<T>& out, const std::vector<detail::Post>& p, std::size_t base, ReduceOp op) const {
    fived::detail::reduce_in_rank_order<T>(out, size(), [&](int r) { return static_cast<const T*>(p[r].send) + base; }, op);
  }

  // Called by the last rank to arrive: all ranks must have made the same call.
  std::string mismatch(const detail::Group& g) const {
    const auto& p = g.posts;
    auto who = [&](int r) { return "rank " + std::to_string(g.members[r]); };
    if (auto why = fived::detail::call_mismatch<detail::Post>(p, g.members); !why.empty()) return why;
    // Every rank is in this collective, so each has made every receive it made before: a
    // message still waiting was sent and not received before it. NCCL would hang there (the
    // send waits for its receive on the group's stream), and a later receive would take it
    // for a message of its own step.
    for (const auto& [route, box] : g.mailbox)
      if (!box.empty())
        return who(route.first) + " sent " + who(route.second) + " " + std::to_string(box.size()) +
               " message(s) in send_recv that it had not received when the group's " + p[0].op +
               " began: each send must be received before the next collective on its group";
    if (p[0].op == "all_to_all_v")
      return fived::detail::counts_mismatch(
          g.members, [&](int s, int d) { return p[s].send_counts[d]; }, [&](int d, int s) { return p[d].recv_counts[s]; });
    return {};
  }

  void make_split(detail::Group& g, const std::string& name) const {
    std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, group rank)
    for (int r = 0; r < size(); ++r) by_color[g.posts[r].color].push_back({g.posts[r].key, r});
    g.split_result.assign(size(), nullptr);
    for (auto& [color, ranks] : by_color) {
      std::sort(ranks.begin(), ranks.end());
      auto sub = std::make_shared<detail::Group>();
      world_->groups.push_back(sub);
      sub->name = name;
      for (auto [key, r] : ranks) sub->members.push_back(g.members[r]);
      for (auto [key, r] : ranks) g.split_result[r] = sub;
    }
  }

  // Arrive, let the last arrival validate (and run `on_complete`), read the
  // peers' posts with `read` (no lock held: the buffers stay valid until every
  // rank has departed), depart. Writes into this rank's own output happen after
  // it returns, so in-place calls are safe.
  template <class Read>
  void rendezvous(detail::Post post, Read&& read, std::function<void(detail::Group&)> on_complete = {}) {
    auto& g = *group_;
    auto& w = *world_;
    const std::string what = where(post.op);
    const int me = world_rank();
    {
      std::unique_lock lk(w.mu);
      w.check_open(me, what);
      if (g.posts.size() != g.members.size()) g.posts.resize(g.members.size()), g.inside.resize(g.members.size());
      if (g.inside[rank_]) {  // a second thread of this rank on this group: NCCL forbids it, and posts would clash
        w.abort("rank " + std::to_string(me) + " called " + what + " while its " + std::string(g.posts[rank_].op) +
                " on that group had not returned: two threads of one rank use one communicator at once (give each "
                "thread its own group, or call from one thread)");
        w.throw_aborted(me, what);
      }
      g.inside[rank_] = 1;
      g.posts[rank_] = std::move(post);
      if (++g.arrived == size()) {
        if (auto why = mismatch(g); !why.empty()) {
          w.abort(where(g.posts[0].op) + ": " + why);
          w.throw_aborted(me, what);
        }
        if (on_complete) on_complete(g);
        g.ready = true;
        w.cv.notify_all();
      } else {
        w.wait(lk, me, what, [&g] { return g.ready; });
      }
    }
    // Depart even if reading fails: peers may still be reading this rank's buffers.
    std::exception_ptr failed;
    try {
      read(g.posts);
    } catch (...) {
      failed = std::current_exception();
    }
    {
      std::unique_lock lk(w.mu);
      if (++g.departed == size()) {
        g.arrived = g.departed = 0;
        g.ready = false;
        ++g.generation;
        w.cv.notify_all();
      } else {
        const auto gen = g.generation;
        w.wait_uninterruptible(lk, [&g, gen] { return g.generation != gen; });
      }
      g.inside[rank_] = 0;
    }
    if (failed) std::rethrow_exception(failed);
  }
};

namespace detail {

// run() in a process that an MPI launcher started as one of several: this
// process is one rank, fn runs once, on the world of the job's processes. A rank
// whose fn throws tells its peers (comm/mpi_process.hpp), so that each of them
// stops with a CommError naming it, and rethrows.
#if defined(FIVED_WITH_MPI)
template <class F>
void run_as_process(int n, F& fn, const RunOptions& opts) {
  auto& process = mpi::detail::Process::get();
  process.timeout = resolve_timeout(opts, 60.0);
  if (process.size != n)
    throw CommError("fived::host::run: this run has " + std::to_string(n) + " ranks but the launcher started " +
                    std::to_string(process.size) + " processes: start one process per rank (mpirun -np " +
                    std::to_string(n) + "), or one process to run the ranks as its threads");
  const std::string me = "rank " + std::to_string(process.rank);
  try {
    Comm world(mpi::Group::world());
    fn(world);
  } catch (const CommError& e) {
    process.fail(me + " failed: " + e.what(), /*tell_peers=*/true);  // told only when it is the first cause
    throw;
  } catch (const std::exception& e) {
    process.fail(me + " threw: " + e.what(), /*tell_peers=*/true);
    throw;
  } catch (...) {
    process.fail(me + " threw an exception that is not a std::exception", /*tell_peers=*/true);
    throw;
  }
}
#endif

}  // namespace detail

// Runs fn(world) on n threads, one per rank, and waits for all of them. A
// message sent and never received makes it throw CommError at the end. If any
// rank throws, the run is aborted (peers blocked in collectives get a
// CommError) and, once every thread has ended, the first rank's exception in
// rank order whose cause is not another rank's failure is rethrown. A bad
// RunOptions::timeout or FIVED_HOST_TIMEOUT_S throws std::invalid_argument
// before any rank starts. Launched by mpirun (or mpiexec, srun) as n processes
// and built with FIVED_WITH_MPI, it runs fn once in this process, as its rank
// (detail::run_as_process above).
// Whether run() runs this program's ranks as processes: built with MPI and
// started by an MPI launcher as more than one process.
inline bool ranks_are_processes() {
#if defined(FIVED_WITH_MPI)
  const std::optional<int> processes = mpi::launched_size();
  return processes && *processes > 1;
#else
  return false;
#endif
}

template <class F>
void run(int n, F&& fn, RunOptions opts = {}) {
  if (n < 1) throw std::invalid_argument("fived::host::run needs at least one rank, got " + std::to_string(n));
#if defined(FIVED_WITH_MPI)
  if (ranks_are_processes()) return detail::run_as_process(n, fn, opts);
#endif
  auto world = std::make_shared<detail::World>(n, detail::resolve_timeout(opts));
  auto group = std::make_shared<detail::Group>();
  world->groups.push_back(group);
  group->name = "world";
  for (int r = 0; r < n; ++r) group->members.push_back(r);

  // The ranks share this process's count of held bytes while they run (device/buffer.hpp).
  struct Sharing {
    int before;
    explicit Sharing(int n) : before(host_ranks_in_process().exchange(n)) {}
    ~Sharing() { host_ranks_in_process() = before; }
  } sharing(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<bool> origin(n, false);  // this rank's error is the cause, not a consequence
  std::vector<std::thread> threads;
  threads.reserve(n);
  // A thread that cannot be started ends the run: the started ranks are aborted and joined
  // (a std::thread destroyed while joinable would terminate the process), then a sentence.
  auto could_not_start = [&](int r, const std::exception& e) {
    {
      std::lock_guard lk(world->mu);
      for (int q = r; q < n; ++q) world->finished[q] = true;
      world->abort("the thread of rank " + std::to_string(r) + " could not be started (" + e.what() + ")");
    }
    for (auto& t : threads) t.join();
    throw CommError("fived::host::run: could not start the thread of rank " + std::to_string(r) + " of " +
                    std::to_string(n) + " (" + e.what() + "): run fewer ranks as threads of one process");
  };
  for (int r = 0; r < n; ++r) {
    try {
      threads.emplace_back([&, r] {
        {
          std::lock_guard lk(world->mu);
          world->own_thread[static_cast<std::size_t>(r)] = std::this_thread::get_id();
          (void)world->slot_of(r);  // the rank's own thread counts from the start (see World::wait)
        }
        Comm comm(world, group, r);
        try {
          fn(comm);
        } catch (const CommError& e) {
          errors[r] = std::current_exception();
          std::lock_guard lk(world->mu);
          origin[r] = world->abort_reason.empty();
          world->abort("rank " + std::to_string(r) + " failed: " + e.what());
        } catch (const std::exception& e) {
          errors[r] = std::current_exception();
          std::lock_guard lk(world->mu);
          origin[r] = true;
          world->abort("rank " + std::to_string(r) + " threw: " + e.what());
        } catch (...) {
          errors[r] = std::current_exception();
          std::lock_guard lk(world->mu);
          origin[r] = true;
          world->abort("rank " + std::to_string(r) + " threw an exception that is not a std::exception");
        }
        std::lock_guard lk(world->mu);
        world->finished[r] = true;
        world->check_deadlock();
        world->cv.notify_all();
      });
    } catch (const std::system_error& e) {
      could_not_start(r, e);
    } catch (const std::bad_alloc& e) {
      could_not_start(r, e);
    }
  }
  for (auto& t : threads) t.join();
  {
    std::lock_guard lk(world->mu);
    world->ended = true;
  }
  if (std::none_of(errors.begin(), errors.end(), [](const auto& e) { return e != nullptr; }))
    if (auto why = world->undelivered(); !why.empty())
      throw CommError("fived host backend: the run ended with point-to-point messages nobody received "
                      "(every send needs a matching receive):" + why);
  for (int r = 0; r < n; ++r)
    if (errors[r] && origin[r]) std::rethrow_exception(errors[r]);
  for (int r = 0; r < n; ++r)
    if (errors[r]) std::rethrow_exception(errors[r]);
}

static_assert(Communicator<Comm>);

}  // namespace fived::host
