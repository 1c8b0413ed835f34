#pragma once
// The host backend's ranks as processes: one group's communicator over MPI.
// host::Comm (comm/host.hpp) forwards to it when the program was started by an
// MPI launcher with more than one process (built with FIVED_WITH_MPI: link
// fived::mpi), so a program written for host::run runs unchanged under
//
//   mpirun -np 4 build/examples/train_gpt --mesh dp2.tp2
//
// The same results as the threads: every reduction gathers the contributions
// and adds them in group-rank order (comm/rank_order_reduce.hpp), so processes
// and threads agree bit for bit. The same misuse checks: the arguments by
// comm/arguments.hpp (in host::Comm), and before each collective the ranks
// exchange what they called and stop with the threads' sentence when they
// disagree (comm/call_check.hpp). Point-to-point messages carry their element
// type and size, checked on receipt; sends do not wait for their receive (as on
// the threads). Every wait is watched (comm/mpi_process.hpp): a failed, killed or
// stuck peer ends it with a CommError, never a hang.
//
// Not a fast path: it moves n times the data of a ring, for tests and CI
// without a GPU. On GPUs the NCCL backend (comm/nccl.hpp) is the one to use.

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstring>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "fived/comm/call_check.hpp"
#include "fived/comm/mpi_process.hpp"
#include "fived/comm/rank_order_reduce.hpp"
#include "fived/comm/types.hpp"

namespace fived::mpi {

namespace detail {

// One rank's call, as the group's ranks compare it (comm/call_check.hpp).
struct Call {
  char op[16]{};
  DType dtype = DType::u8;
  std::size_t count = 0;
  int root = -1;
  ReduceOp reduce = ReduceOp::sum;
  int color = 0, key = 0;  // split
  char name[64]{};         // split: the new group's name
};

// A point-to-point message's header: what the receiver checks it against.
struct Header {
  DType dtype;
  std::size_t bytes;
};

}  // namespace detail

class Group {
 public:
  // A group over `comm` (owned: freed with the group, unless it is MPI_COMM_WORLD).
  Group(MPI_Comm comm, std::string name, std::vector<int> members)
      : comm_(comm), name_(std::move(name)), members_(std::move(members)) {
    detail::returns_errors(comm_);
    detail::check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  }
  // The world: every process of the job, under its own communicator.
  static std::shared_ptr<Group> world() {
    const detail::Process& p = detail::Process::get();
    MPI_Comm c;
    detail::check(MPI_Comm_dup(MPI_COMM_WORLD, &c), "MPI_Comm_dup");
    std::vector<int> members(static_cast<std::size_t>(p.size));
    std::iota(members.begin(), members.end(), 0);
    return std::make_shared<Group>(c, "world", std::move(members));
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  ~Group() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto& s : sends_) MPI_Request_free(&s.request);  // a send nobody received: MPI keeps it until finalize
    MPI_Comm_free(&comm_);
  }

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(members_.size()); }
  const std::string& name() const { return name_; }
  const std::vector<int>& members() const { return members_; }

  template <class T>
  void all_reduce(std::span<const T> send, std::span<T> recv, ReduceOp op) {
    const std::vector<T> all = gather_all("all_reduce", send, op);
    fived::detail::reduce_in_rank_order<T>(recv, size(), [&](int r) { return all.data() + r * send.size(); }, op);
  }

  template <class T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, ReduceOp op) {
    agree(call("reduce_scatter", dtype_of<T>, send.size(), -1, op), "reduce_scatter");
    std::vector<T> blocks(send.size());  // block r: what rank r sends this rank
    const int bytes = byte_count<T>(recv.size(), "reduce_scatter");
    start_and_wait("reduce_scatter", [&](MPI_Request* req) {
      return MPI_Ialltoall(send.data(), bytes, MPI_BYTE, blocks.data(), bytes, MPI_BYTE, comm_, req);
    });
    fived::detail::reduce_in_rank_order<T>(recv, size(), [&](int r) { return blocks.data() + r * recv.size(); }, op);
  }

  template <class T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    const std::vector<T> all = gather_all("all_gather", send, ReduceOp::sum);
    std::copy(all.begin(), all.end(), recv.begin());
  }

  template <class T>
  void all_to_all(std::span<const T> send, std::span<T> recv) {
    agree(call("all_to_all", dtype_of<T>, send.size()), "all_to_all");
    const std::vector<T> in(send.begin(), send.end());  // send and recv may be one buffer
    const int bytes = byte_count<T>(send.size() / static_cast<std::size_t>(size()), "all_to_all");
    start_and_wait("all_to_all", [&](MPI_Request* req) {
      return MPI_Ialltoall(in.data(), bytes, MPI_BYTE, recv.data(), bytes, MPI_BYTE, comm_, req);
    });
  }

  template <class T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) {
    agree(call("all_to_all_v", dtype_of<T>, send.size()), "all_to_all_v");
    // Every rank's counts, both ways: what s sends d must be what d expects from s.
    const std::size_t n = members_.size();
    std::vector<std::size_t> mine(send_counts.begin(), send_counts.end()), all(2 * n * n);
    mine.insert(mine.end(), recv_counts.begin(), recv_counts.end());
    start_and_wait("all_to_all_v", [&](MPI_Request* req) {
      return MPI_Iallgather(mine.data(), static_cast<int>(2 * n * sizeof(std::size_t)), MPI_BYTE, all.data(),
                            static_cast<int>(2 * n * sizeof(std::size_t)), MPI_BYTE, comm_, req);
    });
    if (std::string why = fived::detail::counts_mismatch(
            members_, [&](int s, int d) { return all[s * 2 * n + d]; }, [&](int d, int s) { return all[d * 2 * n + n + s]; });
        !why.empty())
      stop("all_to_all_v", why, true);
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    for (std::size_t r = 0, s_at = 0, r_at = 0; r < n; ++r) {
      sc[r] = byte_count<T>(send_counts[r], "all_to_all_v"), sd[r] = byte_count<T>(s_at, "all_to_all_v");
      rc[r] = byte_count<T>(recv_counts[r], "all_to_all_v"), rd[r] = byte_count<T>(r_at, "all_to_all_v");
      s_at += send_counts[r], r_at += recv_counts[r];
    }
    start_and_wait("all_to_all_v", [&](MPI_Request* req) {
      return MPI_Ialltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, recv.data(), rc.data(), rd.data(), MPI_BYTE,
                            comm_, req);
    });
  }

  // Sends go out at once and are not waited for (as on the threads: a send never
  // waits for its receive); each receive waits for its message and checks it.
  template <class T>
  void send_recv(std::span<const SendOp<T>> sends, std::span<const RecvOp<T>> recvs) {
    reap_sends();
    for (const auto& s : sends) {
      const detail::Header h{dtype_of<T>, s.buf.size_bytes()};
      Pending& p = sends_.emplace_back();
      p.bytes.resize(sizeof h + h.bytes);
      std::memcpy(p.bytes.data(), &h, sizeof h);
      if (h.bytes) std::memcpy(p.bytes.data() + sizeof h, s.buf.data(), h.bytes);
      detail::check(MPI_Isend(p.bytes.data(), byte_count<std::byte>(p.bytes.size(), "send_recv"), MPI_BYTE, s.peer, 0,
                              comm_, &p.request),
                    "MPI_Isend");
    }
    for (const auto& r : recvs) {
      const std::string what = "send_recv (receive from rank " + std::to_string(members_[r.peer]) + ") on group " + describe();
      int flag = 0;
      MPI_Message msg;
      MPI_Status st;
      detail::Process::get().wait(
          [&] {
            detail::check(MPI_Improbe(r.peer, 0, comm_, &flag, &msg, &st), "MPI_Improbe");
            return flag != 0;
          },
          world_rank(), what);
      int n = 0;
      MPI_Get_count(&st, MPI_BYTE, &n);
      std::vector<std::byte> bytes(static_cast<std::size_t>(n));
      detail::check(MPI_Mrecv(bytes.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
      detail::Header h{};
      std::memcpy(&h, bytes.data(), sizeof h);
      if (h.dtype != dtype_of<T> || h.bytes != r.buf.size_bytes())
        stop("send_recv", "rank " + std::to_string(members_[r.peer]) + " sent " + std::to_string(h.bytes) +
                                  " bytes of " + std::string(dtype_name(h.dtype)) + " but rank " +
                                  std::to_string(world_rank()) + " expects " + std::to_string(r.buf.size_bytes()) +
                                  " bytes of " + std::string(dtype_name(dtype_of<T>)),
             false);
      if (h.bytes) std::memcpy(r.buf.data(), bytes.data() + sizeof h, h.bytes);
    }
  }

  template <class T>
  void broadcast(std::span<T> buf, int root) {
    agree(call("broadcast", dtype_of<T>, buf.size(), root), "broadcast");
    const int bytes = byte_count<T>(buf.size(), "broadcast");
    start_and_wait("broadcast", [&](MPI_Request* req) { return MPI_Ibcast(buf.data(), bytes, MPI_BYTE, root, comm_, req); });
  }

  // Every rank has arrived once they have compared their calls.
  void barrier() { agree(call("barrier", DType::u8, 0), "barrier"); }

  // One group per color, ranks ordered by key, then by rank here (as MPI_Comm_split does).
  std::shared_ptr<Group> split(int color, int key, const std::string& name) {
    detail::Call mine = call("split", DType::u8, 0);
    mine.color = color, mine.key = key;
    if (name.size() >= sizeof mine.name)
      stop("split", "the new group's name \"" + name + "\" is longer than " + std::to_string(sizeof mine.name - 1) +
                        " characters",
           false);
    std::strncpy(mine.name, name.c_str(), sizeof mine.name - 1);
    const std::vector<detail::Call> calls = agree(mine, "split");
    std::vector<std::pair<int, int>> same;  // (key, group rank) of this rank's color
    for (int r = 0; r < size(); ++r)
      if (calls[r].color == color) same.push_back({calls[r].key, r});
    std::sort(same.begin(), same.end());
    std::vector<int> members;
    for (auto [k, r] : same) members.push_back(members_[r]);
    MPI_Comm c;  // every rank has arrived (agree), so the blocking split cannot hang
    detail::check(MPI_Comm_split(comm_, color, key, &c), "MPI_Comm_split");
    return std::make_shared<Group>(c, name, std::move(members));
  }

  std::string describe() const { return fived::detail::describe_group(name_, members_); }

 private:
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<std::byte> bytes;  // header and payload, alive until the send completes
  };

  MPI_Comm comm_;
  std::string name_;
  std::vector<int> members_;  // world ranks; index = rank in this group
  int rank_ = 0;
  std::vector<Pending> sends_;

  int world_rank() const { return members_[static_cast<std::size_t>(rank_)]; }

  static detail::Call call(const char* op, DType dtype, std::size_t count, int root = -1, ReduceOp reduce = ReduceOp::sum) {
    detail::Call c;
    std::strncpy(c.op, op, sizeof c.op - 1);
    c.dtype = dtype, c.count = count, c.root = root, c.reduce = reduce;
    return c;
  }

  // A nonblocking MPI call started by `start(&request)`, waited for under the watch.
  template <class Start>
  void start_and_wait(const char* op, Start&& start) {
    MPI_Request req = MPI_REQUEST_NULL;
    detail::check(start(&req), op);
    int done = 0;
    detail::Process::get().wait(
        [&] {
          detail::check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
          return done != 0;
        },
        world_rank(), std::string(op) + " on group " + describe());
  }

  // Every rank's call; stops the run with the threads' sentence when they differ.
  std::vector<detail::Call> agree(const detail::Call& mine, const char* op) {
    std::vector<detail::Call> all(members_.size());
    start_and_wait(op, [&](MPI_Request* req) {
      return MPI_Iallgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, comm_, req);
    });
    if (std::string why = fived::detail::call_mismatch<detail::Call>(all, members_); !why.empty()) stop(op, why, true);
    return all;
  }

  // Stops the run over this call. A disagreement found in what the ranks exchanged
  // (agree, all_to_all_v's counts) every rank of the group finds too; anything else only
  // this rank sees, so it tells the peers.
  [[noreturn]] void stop(const char* op, const std::string& why, bool every_rank_sees_it) {
    const std::string what = std::string(op) + " on group " + describe();
    detail::Process::get().fail(what + ": " + why, /*tell_peers=*/!every_rank_sees_it);
    detail::Process::throw_aborted(world_rank(), what, what + ": " + why);
  }

  // Every rank's `send`, in rank order (all_reduce and all_gather).
  template <class T>
  std::vector<T> gather_all(const char* op, std::span<const T> send, ReduceOp reduce) {
    agree(call(op, dtype_of<T>, send.size(), -1, reduce), op);
    std::vector<T> all(send.size() * members_.size());
    const int bytes = byte_count<T>(send.size(), op);
    start_and_wait(op, [&](MPI_Request* req) {
      return MPI_Iallgather(send.data(), bytes, MPI_BYTE, all.data(), bytes, MPI_BYTE, comm_, req);
    });
    return all;
  }

  // MPI counts bytes in int.
  template <class T>
  int byte_count(std::size_t elements, const char* op) {
    if (elements > static_cast<std::size_t>(INT_MAX) / sizeof(T))
      stop(op, std::to_string(elements) + " elements are more than MPI counts in one call (2 GiB): split the call", false);
    return static_cast<int>(elements * sizeof(T));
  }

  void reap_sends() {
    std::erase_if(sends_, [](Pending& p) {
      int done = 0;
      MPI_Test(&p.request, &done, MPI_STATUS_IGNORE);
      return done != 0;
    });
  }
};

}  // namespace fived::mpi
