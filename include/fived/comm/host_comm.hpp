#pragma once
// host::Comm: one rank's communicator over one group of a host run (comm/host.hpp).
// A thread's collectives are rendezvous on the group (comm/host_world.hpp): the
// last rank to arrive checks the calls agree (comm/call_check.hpp), each rank
// reads the peers' buffers, then writes its own result. A process's (an MPI
// job's rank, built with FIVED_WITH_MPI) go to its mpi::Group (comm/mpi.hpp)
// after the same argument checks (comm/arguments.hpp).

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/comm/arguments.hpp"
#include "fived/comm/call_check.hpp"
#include "fived/comm/communicator.hpp"
#include "fived/comm/host_world.hpp"
#include "fived/comm/rank_order_reduce.hpp"
#include "fived/comm/types.hpp"
#if defined(FIVED_WITH_MPI)
#include "fived/comm/mpi.hpp"
#endif

namespace fived::host {

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
    group_->cv.notify_all();
    for (const auto& r : recvs) {
      auto& box = group_->mailbox[{r.peer, rank_}];
      world_->wait(lk, *group_, world_rank(), "send_recv (receive from rank " + std::to_string(group_->members[r.peer]) + ") on group " +
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
        g.cv.notify_all();
      } else {
        w.wait(lk, g, me, what, [&g] { return g.ready; });
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
        g.cv.notify_all();
      } else {
        const auto gen = g.generation;
        w.wait_uninterruptible(lk, g, [&g, gen] { return g.generation != gen; });
      }
      g.inside[rank_] = 0;
    }
    if (failed) std::rethrow_exception(failed);
  }
};

static_assert(Communicator<Comm>);

}  // namespace fived::host
