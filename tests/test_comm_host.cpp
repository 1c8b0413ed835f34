#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
// The host backend (ranks as threads): every collective on rank-valued data
// with exact equality, for world sizes 1..8 and for sub-communicators made by
// split; then misuse, which must give every rank a CommError (never a hang).
//
// doctest's assertions are not thread-safe: rank functions only record what
// they saw into their own per-rank slot, and the main thread checks the slots
// after host::run() has returned.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/comm/host.hpp"

using namespace fived;
using host::Comm;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string str(int v) { return std::to_string(v); }

// "world {0,1,2}": how the backend names a group in its messages.
std::string group_text(const std::string& name, const std::vector<int>& members) {
  std::string s = name + " {";
  for (std::size_t i = 0; i < members.size(); ++i) s += (i ? "," : "") + std::to_string(members[i]);
  return s + "}";
}
std::string world_text(int n) {
  std::vector<int> m(n);
  for (int r = 0; r < n; ++r) m[r] = r;
  return group_text("world", m);
}

// ---- rank-valued data --------------------------------------------------------------------
// val(r, i): element i of rank r's contribution. Small integers (uint8 sums of
// 8 ranks stay below 256), negative entries for the signed types (max picks
// rank 0 there), high bits for int64 and quarter fractions for floating point,
// so every sum below is exact.
template <class T>
T val(int r, int i) {
  const int base = 3 * r + i % 5 + 1;  // 1..26 for r < 8
  const int sign = i % 2 ? -1 : 1;
  if constexpr (std::is_same_v<T, std::uint8_t>) return static_cast<T>(base);
  else if constexpr (std::is_same_v<T, std::int64_t>) return (std::int64_t{r} << 33) + sign * base;
  else if constexpr (std::is_floating_point_v<T>) return static_cast<T>(sign * (base + 0.25));
  else return static_cast<T>(sign * base);
}

// code(s, d, i): element i of the block rank s sends to rank d (i < 4): says
// who sent it to whom, so a block delivered to the wrong place shows up.
template <class T>
T code(int s, int d, int i) {
  return static_cast<T>(s * 32 + d * 4 + i);  // <= 255 for s, d < 8
}

// The reference reduction: contributions f(0, i), f(1, i), ... combined in
// rank order (the order the backend documents), avg divides the sum by n.
template <class T, class F>
std::vector<T> reference(int n, ReduceOp op, std::size_t count, F f) {
  std::vector<T> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    T acc = f(0, static_cast<int>(i));
    for (int r = 1; r < n; ++r) {
      const T v = f(r, static_cast<int>(i));
      acc = op == ReduceOp::max ? (v > acc ? v : acc) : static_cast<T>(acc + v);
    }
    if (op == ReduceOp::avg) acc = static_cast<T>(acc / static_cast<T>(n));
    out[i] = acc;
  }
  return out;
}

template <class T>
std::string show(const std::vector<T>& v) {
  std::ostringstream os;
  os << "{";
  for (std::size_t i = 0; i < v.size(); ++i) {
    os << (i ? ", " : "");
    if constexpr (sizeof(T) == 1) os << static_cast<int>(v[i]);
    else os << v[i];
  }
  os << "}";
  return os.str();
}

// What one rank saw, checked on the main thread after run() returns.
struct Entry {
  std::string what;
  bool ok;
  std::string detail;  // filled in on failure
};
struct Log {
  std::vector<Entry> entries;

  // Bit-for-bit equality (exact for integers, and for floating point it also
  // rules out results that are merely close).
  template <class T>
  void expect(std::string what, const std::vector<T>& got, const std::vector<T>& want) {
    const bool ok = got.size() == want.size() &&
                    (got.empty() || std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0);
    entries.push_back({std::move(what), ok, ok ? "" : "got " + show(got) + " want " + show(want)});
  }
  void expect(std::string what, bool ok, std::string detail = "") {
    entries.push_back({std::move(what), ok, ok ? "" : std::move(detail)});
  }
};

void check_logs(const std::vector<Log>& logs, std::size_t min_entries = 1) {
  for (std::size_t r = 0; r < logs.size(); ++r) {
    CAPTURE(r);
    CHECK(logs[r].entries.size() >= min_entries);
    for (const auto& e : logs[r].entries) CHECK_MESSAGE(e.ok, "rank " << r << ": " << e.what << ": " << e.detail);
  }
}

template <class T>
std::string type_name() {
  return std::string(dtype_name(dtype_of<T>));
}

// ---- the collectives on one communicator --------------------------------------------------
// Runs every collective of `c` once (broadcast from every root) and records
// the results next to the values the formulas above give. Works for any
// group: all values depend on the rank in `c`, peers are ranks in `c`.
template <class T>
void every_collective(Comm& c, Log& log, const std::string& label) {
  const int n = c.size(), r = c.rank();
  const std::string where = label + " " + type_name<T>() + " n=" + str(n) + " rank " + str(r) + ": ";
  auto vals = [](int rank, int i) { return val<T>(rank, i); };

  // all_reduce: out of place, in place through the one-buffer overload, and
  // in place by passing the same buffer as send and recv.
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
    const std::string opn(reduce_op_name(op));
    const std::size_t count = 7;
    const auto want = reference<T>(n, op, count, vals);
    std::vector<T> send(count), recv(count, T(99));
    for (std::size_t i = 0; i < count; ++i) send[i] = val<T>(r, static_cast<int>(i));
    const auto sent = send;
    c.all_reduce<T>(send, recv, op);
    log.expect(where + "all_reduce " + opn, recv, want);
    log.expect(where + "all_reduce " + opn + " leaves send alone", send, sent);

    std::vector<T> buf = sent;
    c.all_reduce<T>(std::span<T>(buf), op);
    log.expect(where + "all_reduce " + opn + " in place (one buffer)", buf, want);

    std::vector<T> same = sent;
    c.all_reduce<T>(same, same, op);
    log.expect(where + "all_reduce " + opn + " in place (send == recv)", same, want);
  }
  {  // T deduced from the receive span; sum is the default op
    std::vector<T> send{val<T>(r, 0), val<T>(r, 1)}, recv(2);
    c.all_reduce(std::span<const T>(send), std::span<T>(recv));
    log.expect(where + "all_reduce default op", recv, reference<T>(n, ReduceOp::sum, 2, vals));
  }
  {  // empty buffers are fine
    std::vector<T> none;
    c.all_reduce<T>(none, none);
    log.expect(where + "all_reduce of nothing", none, std::vector<T>{});
  }

  // reduce_scatter: rank r gets block r of the reduction.
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
    const int m = 3;
    std::vector<T> send(n * m), recv(m, T(99));
    for (int j = 0; j < n * m; ++j) send[j] = val<T>(r, j);
    c.reduce_scatter<T>(send, recv, op);
    log.expect(where + "reduce_scatter " + std::string(reduce_op_name(op)), recv,
               reference<T>(n, op, m, [&](int s, int i) { return val<T>(s, r * m + i); }));
  }

  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
    // reduce_scatter in place, NCCL's layout: recv is block r of send
    const int m = 3;
    std::vector<T> buf(n * m);
    for (int j = 0; j < n * m; ++j) buf[j] = val<T>(r, j);
    c.reduce_scatter<T>(std::span<const T>(buf), std::span<T>(buf).subspan(r * m, m), op);
    log.expect(where + "reduce_scatter " + std::string(reduce_op_name(op)) + " in place",
               std::vector<T>(buf.begin() + r * m, buf.begin() + (r + 1) * m),
               reference<T>(n, op, m, [&](int s, int i) { return val<T>(s, r * m + i); }));
  }

  {  // all_gather in place, NCCL's layout: send is block r of recv
    const int m = 3;
    std::vector<T> buf(n * m, T(99)), want(n * m);
    for (int i = 0; i < m; ++i) buf[r * m + i] = val<T>(r, i);
    for (int s = 0; s < n; ++s)
      for (int i = 0; i < m; ++i) want[s * m + i] = val<T>(s, i);
    c.all_gather<T>(std::span<const T>(buf).subspan(r * m, m), buf);
    log.expect(where + "all_gather in place", buf, want);
  }

  {  // all_gather: block s from rank s
    const int m = 3;
    std::vector<T> send(m), recv(n * m, T(99)), want(n * m);
    for (int i = 0; i < m; ++i) send[i] = val<T>(r, i);
    for (int s = 0; s < n; ++s)
      for (int i = 0; i < m; ++i) want[s * m + i] = val<T>(s, i);
    c.all_gather<T>(send, recv);
    log.expect(where + "all_gather", recv, want);
  }

  {  // all_to_all: block j of send goes to rank j
    const int m = 3;
    std::vector<T> send(n * m), recv(n * m, T(99)), want(n * m);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) send[j * m + i] = code<T>(r, j, i), want[j * m + i] = code<T>(j, r, i);
    c.all_to_all<T>(send, recv);
    log.expect(where + "all_to_all", recv, want);
  }

  // all_to_all_v with uneven counts and zeros. Pattern A: the last rank
  // receives nothing at all. Pattern B: rank 0 sends nothing at all.
  const std::array<std::function<int(int, int)>, 2> patterns{
      [n](int s, int d) { return d == n - 1 ? 0 : (2 * s + d) % 4; },
      [](int s, int d) { return s == 0 ? 0 : 1 + (s + d) % 4; },
  };
  for (std::size_t p = 0; p < patterns.size(); ++p) {
    const auto& count = patterns[p];
    std::vector<std::size_t> send_counts(n), recv_counts(n);
    std::vector<T> send, want;
    for (int d = 0; d < n; ++d) {
      send_counts[d] = count(r, d);
      for (int i = 0; i < count(r, d); ++i) send.push_back(code<T>(r, d, i));
    }
    for (int s = 0; s < n; ++s) {
      recv_counts[s] = count(s, r);
      for (int i = 0; i < count(s, r); ++i) want.push_back(code<T>(s, r, i));
    }
    std::vector<T> recv(want.size(), T(99));
    c.all_to_all_v<T>(send, send_counts, recv, recv_counts);
    log.expect(where + "all_to_all_v pattern " + str(static_cast<int>(p)) + " (receives " + str(int(want.size())) + ")",
               recv, want);
  }

  const int left = (r - 1 + n) % n, right = (r + 1) % n;
  {  // send_recv: a ring in both directions as one grouped call
    const int m = 2;
    std::vector<T> to_right(m), to_left(m), from_left(m, T(99)), from_right(m, T(99)), want_left(m), want_right(m);
    for (int i = 0; i < m; ++i) {
      to_right[i] = code<T>(r, right, i), to_left[i] = code<T>(r, left, i + 2);
      want_left[i] = code<T>(left, r, i), want_right[i] = code<T>(right, r, i + 2);
    }
    const std::array<SendOp<T>, 2> sends{SendOp<T>{to_right, right}, SendOp<T>{to_left, left}};
    const std::array<RecvOp<T>, 2> recvs{RecvOp<T>{from_left, left}, RecvOp<T>{from_right, right}};
    c.send_recv<T>(sends, recvs);
    log.expect(where + "send_recv ring, from the left", from_left, want_left);
    log.expect(where + "send_recv ring, from the right", from_right, want_right);
  }
  {  // a ring in one direction, one send and one receive each
    std::vector<T> out{val<T>(r, 0), val<T>(r, 1), val<T>(r, 2)}, in(3, T(99));
    const std::array<SendOp<T>, 1> sends{SendOp<T>{out, left}};
    const std::array<RecvOp<T>, 1> recvs{RecvOp<T>{in, right}};
    c.send_recv<T>(sends, recvs);
    log.expect(where + "send_recv ring to the left", in, std::vector<T>{val<T>(right, 0), val<T>(right, 1), val<T>(right, 2)});
  }
  {  // a pipeline: activations forward 0 -> n-1, gradients back n-1 -> 0, three
     // micro-batches each; rank 0 may post all three before rank 1 takes one
    const int m = 3;
    for (int mb = 0; mb < 3; ++mb) {
      std::vector<T> act(m);
      if (r == 0) {
        for (int i = 0; i < m; ++i) act[i] = static_cast<T>(i + 10 * mb);
      } else {
        const std::array<RecvOp<T>, 1> recvs{RecvOp<T>{act, r - 1}};
        c.send_recv<T>(std::span<const SendOp<T>>{}, recvs);
      }
      for (auto& a : act) a = static_cast<T>(a + (r + 1));
      if (r < n - 1) {
        const std::array<SendOp<T>, 1> sends{SendOp<T>{act, r + 1}};
        c.send_recv<T>(sends, std::span<const RecvOp<T>>{});
      }
      std::vector<T> want(m);
      for (int i = 0; i < m; ++i) want[i] = static_cast<T>(i + 10 * mb + (r + 1) * (r + 2) / 2);
      log.expect(where + "pipeline forward, micro-batch " + str(mb), act, want);
    }
    for (int mb = 0; mb < 3; ++mb) {
      std::vector<T> grad(m);
      if (r == n - 1) {
        for (int i = 0; i < m; ++i) grad[i] = static_cast<T>(2 * i + mb);
      } else {
        const std::array<RecvOp<T>, 1> recvs{RecvOp<T>{grad, r + 1}};
        c.send_recv<T>(std::span<const SendOp<T>>{}, recvs);
      }
      for (auto& g : grad) g = static_cast<T>(g + (r + 1));
      if (r > 0) {
        const std::array<SendOp<T>, 1> sends{SendOp<T>{grad, r - 1}};
        c.send_recv<T>(sends, std::span<const RecvOp<T>>{});
      }
      // sum of (k + 1) for k = r .. n-1
      const int added = n * (n + 1) / 2 - r * (r + 1) / 2;
      std::vector<T> want(m);
      for (int i = 0; i < m; ++i) want[i] = static_cast<T>(2 * i + mb + added);
      log.expect(where + "pipeline backward, micro-batch " + str(mb), grad, want);
    }
  }

  for (int root = 0; root < n; ++root) {  // broadcast from every root
    std::vector<T> buf(5), want(5);
    for (int i = 0; i < 5; ++i) buf[i] = r == root ? val<T>(root, i) : val<T>(r, i + 1), want[i] = val<T>(root, i);
    c.broadcast<T>(buf, root);
    log.expect(where + "broadcast from root " + str(root), buf, want);
  }

  c.barrier();
  log.expect(where + "barrier returns", true);
}

// The groups the suite also runs on, from a world of n ranks: (a) colors by
// parity with reversed keys, so group ranks run against world order; (b) a
// split of (a) again (nested), three ways by group rank.
Comm parity_reversed(Comm& world) { return world.split(world.rank() % 2, -world.rank(), "parity"); }
Comm nested_thirds(Comm& parity) { return parity.split(parity.rank() % 3, parity.rank(), "third"); }

}  // namespace

// ---- collectives ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE("every collective on rank-valued data, world sizes 1..8", T, std::int32_t, std::int64_t, std::uint8_t,
                   float, double, fived::bf16) {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    std::vector<Log> logs(n);
    host::run(n, [&](Comm& world) {
      Log& log = logs[world.rank()];
      log.expect("world size", world.size() == n);
      log.expect("world name", world.name() == "world");
      log.expect("world rank == thread's rank", world.world_rank() == world.rank());
      every_collective<T>(world, log, "world");
    });
    check_logs(logs, 30);
  }
}

TEST_CASE_TEMPLATE("every collective on split and nested sub-communicators", T, std::int32_t, std::int64_t,
                   std::uint8_t, float, double, fived::bf16) {
  for (int n = 2; n <= 8; ++n) {
    CAPTURE(n);
    std::vector<Log> logs(n);
    host::run(n, [&](Comm& world) {
      Log& log = logs[world.rank()];
      Comm parity = parity_reversed(world);
      every_collective<T>(parity, log, "parity");
      Comm third = nested_thirds(parity);
      every_collective<T>(third, log, "third");
      // The world is still usable alongside its sub-communicators.
      every_collective<T>(world, log, "world after split");
    });
    check_logs(logs, 90);
  }
}

TEST_CASE("sub-groups run collectives at the same time, independently") {
  // Two halves of the world all_reduce different amounts concurrently, many
  // times; the ranks of a half never block the other half.
  for (int n : {2, 4, 6, 8}) {
    CAPTURE(n);
    std::vector<std::vector<std::int64_t>> got(n);
    host::run(n, [&](Comm& world) {
      const int r = world.rank();
      Comm half = world.split(r % 2, r, "half");
      for (int it = 0; it < 20; ++it) {
        const std::size_t count = r % 2 ? 3 : 5;  // the halves disagree on sizes: fine, they are different groups
        std::vector<std::int64_t> buf(count, std::int64_t{r} + it);
        half.all_reduce<std::int64_t>(std::span<std::int64_t>(buf));
        got[r].push_back(buf.front());
      }
    });
    for (int r = 0; r < n; ++r)
      for (int it = 0; it < 20; ++it) {
        std::int64_t want = 0;
        for (int s = r % 2; s < n; s += 2) want += s + it;
        CHECK(got[r][it] == want);
      }
  }
}

TEST_CASE("barrier: nobody leaves before everyone arrived") {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    const int rounds = 5;
    std::atomic<int> world_count{0};
    std::array<std::atomic<int>, 2> half_count{};
    std::vector<std::vector<int>> seen_world(n), seen_half(n);
    host::run(n, [&](Comm& world) {
      const int r = world.rank();
      Comm half = world.split(r % 2, r, "half");
      for (int k = 0; k < rounds; ++k) {
        if (r == k % n) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a late arrival
        world_count.fetch_add(1);
        world.barrier();
        seen_world[r].push_back(world_count.load());  // nobody adds again before the second barrier
        world.barrier();

        half_count[r % 2].fetch_add(1);
        half.barrier();
        seen_half[r].push_back(half_count[r % 2].load());
        half.barrier();
      }
    });
    for (int r = 0; r < n; ++r) {
      const int half_size = (n + 1 - r % 2) / 2;
      for (int k = 0; k < rounds; ++k) {
        CHECK(seen_world[r][k] == n * (k + 1));
        CHECK(seen_half[r][k] == half_size * (k + 1));
      }
    }
  }
}

// ---- split ------------------------------------------------------------------------------------

namespace {
struct SplitSeen {
  std::string name;
  int rank = -1, size = -1, world_rank = -1;
  std::vector<int> members;
  std::vector<std::int32_t> gathered;  // all_gather of world ranks over the group
  std::int64_t sum = -1;               // all_reduce of world ranks over the group
};

SplitSeen look(Comm& c) {
  SplitSeen s{c.name(), c.rank(), c.size(), c.world_rank(), c.members(), {}, 0};
  const std::int32_t me = c.world_rank();
  s.gathered.resize(c.size());
  c.all_gather<std::int32_t>(std::span<const std::int32_t>(&me, 1), s.gathered);
  std::int64_t v = me;
  c.all_reduce<std::int64_t>(std::span<std::int64_t>(&v, 1));
  s.sum = v;
  return s;
}

// A split is right when this rank's group is exactly the world ranks q with
// same_group(r, q), ordered by order_key(q) then q, and the communicator's
// rank is this rank's place in that order.
template <class Same, class Key>
void check_split(const std::vector<SplitSeen>& seen, const std::string& name, Same same_group, Key order_key) {
  const int n = static_cast<int>(seen.size());
  for (int r = 0; r < n; ++r) {
    CAPTURE(name);
    CAPTURE(r);
    std::vector<int> want;
    for (int q = 0; q < n; ++q)
      if (same_group(r, q)) want.push_back(q);
    std::stable_sort(want.begin(), want.end(), [&](int a, int b) { return order_key(a) < order_key(b); });
    const auto& s = seen[r];
    CHECK(s.name == name);
    CHECK(s.world_rank == r);
    CHECK(s.size == static_cast<int>(want.size()));
    CHECK(s.members == want);
    CHECK(s.rank == static_cast<int>(std::find(want.begin(), want.end(), r) - want.begin()));
    CHECK(std::vector<int>(s.gathered.begin(), s.gathered.end()) == want);
    std::int64_t sum = 0;
    for (int q : want) sum += q;
    CHECK(s.sum == sum);
  }
}
}  // namespace

TEST_CASE("split: colors pick the group, keys order it, ties keep rank order") {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    std::vector<SplitSeen> world_seen(n), parity(n), reversed(n), ties(n), desc(n), sparse(n), alone(n);
    host::run(n, [&](Comm& world) {
      const int r = world.rank();
      world_seen[r] = look(world);
      Comm a = world.split(r % 2, r, "parity");
      parity[r] = look(a);
      Comm b = world.split(0, n - 1 - r, "reversed");
      reversed[r] = look(b);
      Comm c = world.split(r % 3, 0, "ties");
      ties[r] = look(c);
      Comm d = world.split(r % 3, -r, "desc");
      desc[r] = look(d);
      Comm e = world.split(r < n / 2 ? 1000 : 7, r, "sparse");  // colors need not be dense or ordered
      sparse[r] = look(e);
      Comm f = world.split(r, 0, "alone");
      alone[r] = look(f);
    });
    auto by_rank = [](int q) { return q; };
    check_split(world_seen, "world", [](int, int) { return true; }, by_rank);
    check_split(parity, "parity", [](int a, int b) { return a % 2 == b % 2; }, by_rank);
    check_split(reversed, "reversed", [](int, int) { return true; }, [n](int q) { return n - 1 - q; });
    check_split(ties, "ties", [](int a, int b) { return a % 3 == b % 3; }, [](int) { return 0; });
    check_split(desc, "desc", [](int a, int b) { return a % 3 == b % 3; }, [](int q) { return -q; });
    check_split(sparse, "sparse", [n](int a, int b) { return (a < n / 2) == (b < n / 2); }, by_rank);
    check_split(alone, "alone", [](int a, int b) { return a == b; }, by_rank);
    // reverse key order reverses ranks
    for (int r = 0; r < n; ++r) CHECK(reversed[r].rank == n - 1 - r);
  }
}

TEST_CASE("split: nested splits compose") {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    std::vector<SplitSeen> node(n), pair(n), rev(n), again(n);
    host::run(n, [&](Comm& world) {
      const int r = world.rank();
      Comm a = world.split(r / 4, r, "node");           // {0..3}, {4..7}
      node[r] = look(a);
      Comm b = a.split(a.rank() % 2, a.rank(), "pair");  // even / odd places within the node
      pair[r] = look(b);
      Comm c = b.split(0, -b.rank(), "rev");            // the pair reversed
      rev[r] = look(c);
      Comm d = c.split(0, -c.rank(), "again");          // reversed twice: back to world order
      again[r] = look(d);
    });
    auto same_node = [](int a, int b) { return a / 4 == b / 4; };
    auto same_pair = [&](int a, int b) { return same_node(a, b) && (a % 4) % 2 == (b % 4) % 2; };
    check_split(node, "node", same_node, [](int q) { return q; });
    check_split(pair, "pair", same_pair, [](int q) { return q; });
    check_split(rev, "rev", same_pair, [](int q) { return -q; });
    check_split(again, "again", same_pair, [](int q) { return q; });
  }
}

// ---- determinism ---------------------------------------------------------------------------

namespace {
template <class T>
T noisy(int r, int i) {  // values whose sums round: the order of additions shows in the bits
  return static_cast<T>(0.1 * (r + 1) + 1e-3 * i * (r % 3 + 1) + 1.0 / (7 + r + i));
}

template <class T>
std::vector<std::vector<T>> deterministic_run(int n, int salt) {
  const std::size_t count = 33;
  std::vector<std::vector<T>> out(n);
  host::run(n, [&](Comm& world) {
    const int r = world.rank();
    auto stagger = [&](int k) {  // vary who arrives first from run to run and call to call
      if ((r + k + salt) % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300 * ((r + salt) % 4)));
    };
    std::vector<T> send(count);
    for (std::size_t i = 0; i < count; ++i) send[i] = noisy<T>(r, static_cast<int>(i));
    auto& o = out[r];
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
      stagger(static_cast<int>(op));
      std::vector<T> recv(count);
      world.all_reduce<T>(send, recv, op);
      o.insert(o.end(), recv.begin(), recv.end());
    }
    stagger(5);
    std::vector<T> all(count * n), mine(count);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = noisy<T>(r, static_cast<int>(i));
    world.reduce_scatter<T>(all, mine);
    std::vector<T> gathered(count * n);
    world.all_gather<T>(mine, gathered);  // every rank ends up with the whole reduce_scatter result
    o.insert(o.end(), gathered.begin(), gathered.end());
    Comm sub = world.split(r % 2, -r, "sub");
    stagger(7);
    std::vector<T> s(count);
    sub.all_reduce<T>(send, s);
    o.insert(o.end(), s.begin(), s.end());
  });
  return out;
}
}  // namespace

TEST_CASE_TEMPLATE("determinism: floating-point sums are bit-identical on every rank and across runs", T, float,
                   double) {
  for (int n : {3, 5, 8}) {
    CAPTURE(n);
    const auto first = deterministic_run<T>(n, 0);
    const auto second = deterministic_run<T>(n, 1);
    const auto third = deterministic_run<T>(n, 2);
    // The world-wide parts agree on every rank (the sub-group part is the
    // last `count` values and depends on the rank's parity).
    const std::size_t count = 33, world_part = count * (2 + n);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      REQUIRE(first[r].size() == world_part + count);
      CHECK(std::memcmp(first[r].data(), first[0].data(), world_part * sizeof(T)) == 0);
      CHECK(std::memcmp(first[r].data() + world_part, first[r % 2].data() + world_part, count * sizeof(T)) == 0);
      CHECK(std::memcmp(first[r].data(), second[r].data(), first[r].size() * sizeof(T)) == 0);
      CHECK(std::memcmp(first[r].data(), third[r].data(), first[r].size() * sizeof(T)) == 0);
    }
    // ... and equal the reference: contributions added in group-rank order.
    auto f = [](int s, int i) { return noisy<T>(s, i); };
    std::vector<T> want = reference<T>(n, ReduceOp::sum, count, f);
    const auto avg = reference<T>(n, ReduceOp::avg, count, f);
    want.insert(want.end(), avg.begin(), avg.end());
    const auto rs = reference<T>(n, ReduceOp::sum, count * n, f);
    want.insert(want.end(), rs.begin(), rs.end());
    CHECK(std::memcmp(first[0].data(), want.data(), world_part * sizeof(T)) == 0);
    for (int parity = 0; parity < std::min(n, 2); ++parity) {
      // group ranks of the sub-group run in reverse world order (key -r)
      std::vector<int> members;
      for (int q = n - 1; q >= 0; --q)
        if (q % 2 == parity) members.push_back(q);
      const auto sub = reference<T>(static_cast<int>(members.size()), ReduceOp::sum, count,
                                    [&](int s, int i) { return noisy<T>(members[s], i); });
      CHECK(std::memcmp(first[parity].data() + world_part, sub.data(), count * sizeof(T)) == 0);
    }
    // the order matters for these values: summing the other way round differs
    // somewhere, so the checks above do see the order
    if (n >= 5) {
      const auto backwards = reference<T>(n, ReduceOp::sum, count, [&](int s, int i) { return noisy<T>(n - 1 - s, i); });
      CHECK(std::memcmp(backwards.data(), want.data(), count * sizeof(T)) != 0);
    }
  }
}

// ---- misuse: every rank gets a CommError, never a hang ------------------------------------------

namespace {
enum Kind { none = 0, comm_error = 1, other_error = 2 };

struct Outcome {
  std::vector<std::string> msg;  // per rank: what() of the exception it saw
  std::vector<int> kind;         // per rank: Kind
  std::vector<double> at;        // per rank: seconds from the start until it saw it
  int run_kind = none;           // what run() threw
  std::string run_msg;
  double seconds = 0;            // until run() returned or threw
};

// Runs f on n ranks; each rank records the exception it sees and rethrows it.
template <class F>
Outcome run_misuse(int n, F f, host::RunOptions opts = {}) {
  Outcome o;
  o.msg.resize(n);
  o.kind.assign(n, none);
  o.at.assign(n, -1);
  const auto t0 = Clock::now();
  try {
    host::run(
        n,
        [&](Comm& world) {
          const int r = world.rank();
          try {
            f(world);
          } catch (const CommError& e) {
            o.msg[r] = e.what(), o.kind[r] = comm_error, o.at[r] = seconds_since(t0);
            throw;
          } catch (const std::exception& e) {
            o.msg[r] = e.what(), o.kind[r] = other_error, o.at[r] = seconds_since(t0);
            throw;
          }
        },
        opts);
  } catch (const CommError& e) {
    o.run_kind = comm_error, o.run_msg = e.what();
  } catch (const std::exception& e) {
    o.run_kind = other_error, o.run_msg = e.what();
  }
  o.seconds = seconds_since(t0);
  return o;
}

// Deadlock detection and mismatch checks answer at once; this bound is far
// below the 300 s default timeout and far above any real run of these cases.
constexpr double quick = 3.0;

// Rank r saw a CommError that names it ("rank r in ..."), and contains every
// string of needles(r) (the collective, the group, the cause).
template <class Needles>
void check_errors(const Outcome& o, const std::vector<int>& ranks, Needles needles) {
  for (int r : ranks) {
    CAPTURE(r);
    const std::string& m = o.msg[r];
    INFO("message: " << m);
    CHECK(o.kind[r] == comm_error);
    CHECK(contains(m, "rank " + str(r) + " in "));
    for (const std::string& s : needles(r)) CHECK_MESSAGE(contains(m, s), "the message lacks \"" << s << "\"");
  }
}
std::vector<int> all_ranks(int n) {
  std::vector<int> v(n);
  for (int r = 0; r < n; ++r) v[r] = r;
  return v;
}
void check_run_threw_comm_error(const Outcome& o) {
  INFO("run() threw: " << o.run_msg);
  CHECK(o.run_kind == comm_error);
  CHECK(o.seconds < quick);
}
}  // namespace

TEST_CASE("misuse: ranks call different collectives") {
  const int n = 3;
  auto o = run_misuse(n, [](Comm& w) {
    std::vector<std::int32_t> a(4, w.rank()), b(4), c(4 * 3);
    if (w.rank() == 0) w.all_reduce<std::int32_t>(a, b);
    else w.all_gather<std::int32_t>(a, c);
  });
  check_run_threw_comm_error(o);
  check_errors(o, all_ranks(n), [&](int r) {
    return std::vector<std::string>{r == 0 ? "all_reduce" : "all_gather", world_text(n), "different collectives"};
  });
  CHECK(contains(o.msg[1], "rank 0 called all_reduce"));

  // all_to_all is not all_to_all_v, even though the blocks would fit
  auto v = run_misuse(n, [](Comm& w) {
    std::vector<std::int32_t> a(3, w.rank()), b(3);
    const std::vector<std::size_t> ones{1, 1, 1};
    if (w.rank() == 1) w.all_to_all_v<std::int32_t>(a, ones, b, ones);
    else w.all_to_all<std::int32_t>(a, b);
  });
  check_run_threw_comm_error(v);
  check_errors(v, all_ranks(n), [&](int r) {
    return std::vector<std::string>{(r == 1 ? "all_to_all_v on group " : "all_to_all on group ") + world_text(n),
                                    "different collectives", "rank 1 called all_to_all_v"};
  });
  CHECK(contains(v.msg[2], "rank 0 called all_to_all,"));

  // barrier against broadcast against split, with four ranks
  auto p = run_misuse(4, [](Comm& w) {
    std::vector<std::int32_t> a(2);
    if (w.rank() == 2) w.broadcast<std::int32_t>(a, 0);
    else if (w.rank() == 3) (void)w.split(0, 0, "x");
    else w.barrier();
  });
  check_run_threw_comm_error(p);
  check_errors(p, all_ranks(4), [&](int r) {
    return std::vector<std::string>{r == 2 ? "broadcast" : r == 3 ? "split" : "barrier", world_text(4),
                                    "different collectives"};
  });
}

TEST_CASE("misuse: different sizes") {
  for (int n = 2; n <= 8; ++n) {  // the last rank passes one element more
    CAPTURE(n);
    auto o = run_misuse(n, [n](Comm& w) {
      const std::size_t count = w.rank() == n - 1 ? 5 : 4;
      std::vector<std::int32_t> buf(count, 1);
      w.all_reduce<std::int32_t>(std::span<std::int32_t>(buf));
    });
    check_run_threw_comm_error(o);
    check_errors(o, all_ranks(n), [&](int) {
      return std::vector<std::string>{"all_reduce", world_text(n), "4 elements", "rank " + str(n - 1) + " passed 5"};
    });
  }
  // all_gather and broadcast, and all_to_all_v whose counts disagree
  auto g = run_misuse(3, [](Comm& w) {
    const std::size_t m = w.rank() == 1 ? 3 : 2;
    std::vector<std::int32_t> send(m), recv(3 * m);
    w.all_gather<std::int32_t>(send, recv);
  });
  check_run_threw_comm_error(g);
  check_errors(g, all_ranks(3), [](int) { return std::vector<std::string>{"all_gather", world_text(3), "elements"}; });

  auto b = run_misuse(3, [](Comm& w) {
    std::vector<double> buf(w.rank() == 0 ? 8 : 6);
    w.broadcast<double>(buf, 0);
  });
  check_run_threw_comm_error(b);
  check_errors(b, all_ranks(3), [](int) { return std::vector<std::string>{"broadcast", world_text(3), "elements"}; });

  auto v = run_misuse(3, [](Comm& w) {
    std::vector<std::size_t> send_counts{1, 1, 1}, recv_counts{1, 1, 1};
    if (w.rank() == 2) recv_counts[0] = 2;  // expects two from rank 0, which sends one
    std::vector<float> send(3), recv(w.rank() == 2 ? 4 : 3);
    w.all_to_all_v<float>(send, send_counts, recv, recv_counts);
  });
  check_run_threw_comm_error(v);
  check_errors(v, all_ranks(3), [](int) {
    return std::vector<std::string>{"all_to_all_v", world_text(3), "rank 0 sends 1 elements to rank 2, which expects 2"};
  });

  // all_to_all names itself, not the all_to_all_v it is built on
  auto a = run_misuse(3, [](Comm& w) {
    std::vector<std::int32_t> send(w.rank() == 0 ? 6 : 3), recv(send.size());
    w.all_to_all<std::int32_t>(send, recv);
  });
  check_run_threw_comm_error(a);
  check_errors(a, all_ranks(3), [](int) {
    return std::vector<std::string>{"all_to_all on group " + world_text(3), "rank 0 passed 6 elements",
                                    "rank 1 passed 3"};
  });
  for (int r = 0; r < 3; ++r) CHECK_FALSE(contains(a.msg[r], "all_to_all_v"));
}

TEST_CASE("misuse: different dtypes") {
  auto o = run_misuse(3, [](Comm& w) {
    if (w.rank() == 1) {
      std::vector<float> buf(4);
      w.all_reduce<float>(std::span<float>(buf));
    } else {
      std::vector<std::int32_t> buf(4);
      w.all_reduce<std::int32_t>(std::span<std::int32_t>(buf));
    }
  });
  check_run_threw_comm_error(o);
  check_errors(o, all_ranks(3), [](int) {
    return std::vector<std::string>{"all_reduce", world_text(3), "float32", "int32"};
  });
}

TEST_CASE("misuse: different roots in broadcast") {
  auto o = run_misuse(3, [](Comm& w) {
    std::vector<std::int64_t> buf(4);
    w.broadcast<std::int64_t>(buf, w.rank() == 2 ? 1 : 0);
  });
  check_run_threw_comm_error(o);
  check_errors(o, all_ranks(3), [](int) {
    return std::vector<std::string>{"broadcast", world_text(3), "root 0", "root 1"};
  });
}

TEST_CASE("misuse: different reduce ops") {
  auto o = run_misuse(2, [](Comm& w) {
    std::vector<double> buf(4);
    w.all_reduce<double>(std::span<double>(buf), w.rank() == 0 ? ReduceOp::sum : ReduceOp::max);
  });
  check_run_threw_comm_error(o);
  check_errors(o, all_ranks(2), [](int) {
    return std::vector<std::string>{"all_reduce", world_text(2), "reduces with sum", "max"};
  });

  auto rs = run_misuse(4, [](Comm& w) {
    std::vector<std::int32_t> send(8), recv(2);
    w.reduce_scatter<std::int32_t>(send, recv, w.rank() == 3 ? ReduceOp::avg : ReduceOp::sum);
  });
  check_run_threw_comm_error(rs);
  check_errors(rs, all_ranks(4), [](int) {
    return std::vector<std::string>{"reduce_scatter", world_text(4), "sum", "avg"};
  });
}

TEST_CASE("misuse: the ranks of one new group give it different names in split") {
  auto o = run_misuse(4, [](Comm& w) {  // colors 0 and 1; rank 3 names group 1 "tq"
    (void)w.split(w.rank() % 2, w.rank(), w.rank() == 3 ? "tq" : "tp");
  });
  check_run_threw_comm_error(o);
  check_errors(o, all_ranks(4), [](int) {
    return std::vector<std::string>{"split", world_text(4), "rank 1 names its new group \"tp\"",
                                    "rank 3 names the same group (color 1) \"tq\""};
  });
  // Different names for different groups are fine.
  host::run(4, [](Comm& w) { CHECK(w.split(w.rank() % 2, w.rank(), w.rank() % 2 ? "odd" : "even").size() == 2); });
}

TEST_CASE("misuse: a message not received before the group's next collective is an error at that collective") {
  // Rank 0 sends twice, rank 1 receives once; a later receive would take the stale message.
  auto o = run_misuse(2, [](Comm& w) {
    std::vector<float> buf(3, 1.0f);
    const std::array<SendOp<float>, 1> send{SendOp<float>{buf, 1}};
    const std::array<RecvOp<float>, 1> recv{RecvOp<float>{buf, 0}};
    if (w.rank() == 0)
      for (int i = 0; i < 2; ++i) w.send_recv<float>(send, std::span<const RecvOp<float>>{});
    else
      w.send_recv<float>(std::span<const SendOp<float>>{}, recv);
    w.barrier();
  });
  check_run_threw_comm_error(o);
  check_errors(o, all_ranks(2), [](int) {
    return std::vector<std::string>{"barrier", "rank 0 sent rank 1 1 message(s) in send_recv that it had not received"};
  });
}

TEST_CASE("misuse: a mismatch inside a sub-group names the sub-group") {
  // tp groups {0,1} and {2,3}; group {0,1} disagrees on sizes, group {2,3} is
  // fine and then meets the aborted run at a world barrier.
  std::atomic<int> left_split{0};
  auto o = run_misuse(4, [&](Comm& w) {
    const int r = w.rank();
    Comm tp = w.split(r / 2, r, "tp");
    left_split.fetch_add(1);
    while (left_split.load() < 4) std::this_thread::yield();  // nobody is still leaving the split
    std::vector<std::int32_t> buf(r == 1 ? 3 : 2);
    tp.all_reduce<std::int32_t>(std::span<std::int32_t>(buf));
    w.barrier();
  });
  check_run_threw_comm_error(o);
  check_errors(o, {0, 1}, [](int) { return std::vector<std::string>{"all_reduce on group tp {0,1}", "elements"}; });
  // Ranks 2 and 3 meet the abort at the barrier, or still inside their own
  // (complete) all_reduce if ranks 0 and 1 got there first: a rank waiting
  // to leave a collective also learns of the abort.
  check_errors(o, {2, 3}, [](int) { return std::vector<std::string>{"all_reduce on group tp {0,1}"}; });
  for (int r : {2, 3})
    CHECK_MESSAGE((contains(o.msg[r], "barrier on group world {0,1,2,3}") || contains(o.msg[r], "all_reduce on group tp {2,3}")), o.msg[r]);
}

TEST_CASE("misuse: a rank throws before a collective; run() rethrows that exception") {
  auto o = run_misuse(4, [](Comm& w) {
    std::vector<std::int32_t> buf(4, w.rank());
    w.all_reduce<std::int32_t>(std::span<std::int32_t>(buf));  // one that works
    if (w.rank() == 2) throw std::runtime_error("rank 2 gave up: out of memory");
    w.all_reduce<std::int32_t>(std::span<std::int32_t>(buf));
  });
  INFO("run() threw: " << o.run_msg);
  CHECK(o.run_kind == other_error);
  CHECK(o.run_msg == "rank 2 gave up: out of memory");
  CHECK(o.seconds < quick);
  CHECK(o.kind[2] == other_error);
  check_errors(o, {0, 1, 3}, [](int) {
    return std::vector<std::string>{"all_reduce", world_text(4), "rank 2 threw: rank 2 gave up: out of memory"};
  });

  // An exception that is not a std::exception is rethrown as it was, too.
  bool caught_int = false;
  std::vector<int> kind(3, none);
  try {
    host::run(3, [&](Comm& w) {
      if (w.rank() == 0) throw 42;
      try {
        w.barrier();
      } catch (const CommError&) {
        kind[w.rank()] = comm_error;
        throw;
      }
    });
  } catch (int v) {
    caught_int = v == 42;
  }
  CHECK(caught_int);
  CHECK(kind[1] == comm_error);
  CHECK(kind[2] == comm_error);
}

TEST_CASE("misuse: a rank returns early while the others wait") {
  auto o = run_misuse(3, [](Comm& w) {
    if (w.rank() == 2) return;
    std::vector<std::int32_t> buf(4);
    w.all_reduce<std::int32_t>(std::span<std::int32_t>(buf));
  });
  check_run_threw_comm_error(o);
  CHECK(o.kind[2] == none);  // it returned normally: nothing to report there
  check_errors(o, {0, 1}, [](int) {
    return std::vector<std::string>{"all_reduce", world_text(3), "deadlock", "rank 2 has returned"};
  });

  // in a sub-group: rank 3 leaves its tp group {2,3} waiting; the others wait
  // at a world barrier
  auto s = run_misuse(4, [](Comm& w) {
    const int r = w.rank();
    Comm tp = w.split(r / 2, r, "tp");
    if (r == 3) return;
    std::vector<std::int32_t> buf(4);
    tp.all_reduce<std::int32_t>(std::span<std::int32_t>(buf));
    w.barrier();
  });
  check_run_threw_comm_error(s);
  CHECK(s.kind[3] == none);
  check_errors(s, {0, 1}, [](int) { return std::vector<std::string>{"barrier on group world {0,1,2,3}", "deadlock"}; });
  check_errors(s, {2}, [](int) { return std::vector<std::string>{"all_reduce on group tp {2,3}", "deadlock"}; });
}

TEST_CASE("misuse: ranks wait on different sub-groups (cross-group deadlock)") {
  // Two ranks, two groups over both of them: rank 0 waits on a, rank 1 on b.
  auto o = run_misuse(2, [](Comm& w) {
    Comm a = w.split(0, w.rank(), "a");
    Comm b = w.split(0, w.rank(), "b");
    (w.rank() == 0 ? a : b).barrier();
  });
  check_run_threw_comm_error(o);
  check_errors(o, {0}, [](int) { return std::vector<std::string>{"barrier on group a {0,1}", "deadlock"}; });
  check_errors(o, {1}, [](int) { return std::vector<std::string>{"barrier on group b {0,1}", "deadlock"}; });

  // A cycle through four groups: tp {0,1} waits for 1, which waits in dp
  // {1,3} for 3, which waits in tp {2,3} for 2, which waits in dp {0,2} for 0.
  auto c = run_misuse(4, [](Comm& w) {
    const int r = w.rank();
    Comm tp = w.split(r / 2, r, "tp");
    Comm dp = w.split(r % 2, r, "dp");
    std::vector<float> buf(3);
    (r == 0 || r == 3 ? tp : dp).all_reduce<float>(std::span<float>(buf));
  });
  check_run_threw_comm_error(c);
  const std::array<std::string, 4> group{"tp {0,1}", "dp {1,3}", "dp {0,2}", "tp {2,3}"};
  check_errors(c, all_ranks(4), [&](int r) {
    return std::vector<std::string>{"all_reduce on group " + group[r], "deadlock"};
  });
}

TEST_CASE("misuse: send_recv whose sizes or dtypes do not match") {
  // a ring of two; rank 1 expects three elements where rank 0 sends four
  auto o = run_misuse(2, [](Comm& w) {
    const int r = w.rank(), peer = 1 - r;
    std::vector<std::int32_t> out(4, r), in(r == 1 ? 3 : 4);
    const std::array<SendOp<std::int32_t>, 1> sends{SendOp<std::int32_t>{out, peer}};
    const std::array<RecvOp<std::int32_t>, 1> recvs{RecvOp<std::int32_t>{in, peer}};
    w.send_recv<std::int32_t>(sends, recvs);
    w.barrier();  // rank 0 may have got its message; it meets the abort here
  });
  check_run_threw_comm_error(o);
  check_errors(o, {1}, [](int) { return std::vector<std::string>{"send_recv on group world {0,1}", "16 bytes", "12 bytes"}; });
  check_errors(o, {0}, [](int) { return std::vector<std::string>{"world {0,1}", "send_recv", "bytes"}; });

  // same byte count, different dtypes
  auto d = run_misuse(2, [](Comm& w) {
    if (w.rank() == 0) {
      std::vector<float> out(4);
      const std::array<SendOp<float>, 1> sends{SendOp<float>{out, 1}};
      w.send_recv<float>(sends, {});
    } else {
      std::vector<std::int32_t> in(4);
      const std::array<RecvOp<std::int32_t>, 1> recvs{RecvOp<std::int32_t>{in, 0}};
      w.send_recv<std::int32_t>({}, recvs);
    }
    w.barrier();
  });
  check_run_threw_comm_error(d);
  check_errors(d, all_ranks(2), [](int) { return std::vector<std::string>{"world {0,1}", "send_recv", "float32", "int32"}; });
}

TEST_CASE("misuse: a receive with no matching send") {
  auto o = run_misuse(3, [](Comm& w) {
    if (w.rank() == 0) {
      std::vector<double> in(2);
      const std::array<RecvOp<double>, 1> recvs{RecvOp<double>{in, 1}};
      w.send_recv<double>({}, recvs);
    } else {
      w.barrier();
    }
  });
  check_run_threw_comm_error(o);
  check_errors(o, {0}, [](int) {
    return std::vector<std::string>{"send_recv (receive from rank 1) on group world {0,1,2}", "deadlock"};
  });
  check_errors(o, {1, 2}, [](int) { return std::vector<std::string>{"barrier on group world {0,1,2}", "deadlock"}; });

  // the would-be sender has returned; messages name world ranks, also in a sub-group
  auto s = run_misuse(4, [](Comm& w) {
    Comm odd = w.split(w.rank() % 2, w.rank(), "odd");  // {0,2} and {1,3}
    if (w.rank() != 3) return;
    std::vector<double> in(2);
    const std::array<RecvOp<double>, 1> recvs{RecvOp<double>{in, 0}};  // group rank 0 = world rank 1
    odd.send_recv<double>({}, recvs);
  });
  check_run_threw_comm_error(s);
  check_errors(s, {3}, [](int) {
    return std::vector<std::string>{"send_recv (receive from rank 1) on group odd {1,3}", "deadlock",
                                    "rank 1 has returned"};
  });
}

TEST_CASE("misuse: argument errors throw on the calling rank, before any rendezvous") {
  const int n = 3;
  struct Case {
    std::string name;
    std::vector<std::string> needles;
    std::function<void(Comm&)> call;
  };
  const std::vector<Case> cases{
      {"all_reduce sizes", {"all_reduce", "send has 4 elements but recv has 3: they must be equal"},
       [](Comm& w) {
         std::vector<std::int32_t> s(4), r(3);
         w.all_reduce<std::int32_t>(s, r);
       }},
      {"reduce_scatter sizes", {"reduce_scatter", "send has 5 elements but must have size() * recv.size() = 3 * 2 = 6"},
       [](Comm& w) {
         std::vector<std::int32_t> s(5), r(2);
         w.reduce_scatter<std::int32_t>(s, r);
       }},
      {"all_gather sizes", {"all_gather", "recv has 5 elements but must have size() * send.size() = 3 * 2 = 6"},
       [](Comm& w) {
         std::vector<float> s(2), r(5);
         w.all_gather<float>(s, r);
       }},
      {"all_to_all sizes", {"all_to_all on group", "send has 4 and recv 4 elements: they must be equal and a multiple of size() = 3"},
       [](Comm& w) {
         std::vector<std::uint8_t> s(4), r(4);
         w.all_to_all<std::uint8_t>(s, r);
       }},
      {"all_to_all_v count entries", {"all_to_all_v", "send_counts has 2 and recv_counts 2 entries: give one per rank, size() = 3"},
       [](Comm& w) {
         std::vector<std::size_t> c{1, 1};
         std::vector<double> s(2), r(2);
         w.all_to_all_v<double>(s, c, r, c);
       }},
      {"all_to_all_v count sums", {"all_to_all_v", "the counts add up to 3 sent / 3 received but the buffers hold 4 / 3"},
       [](Comm& w) {
         std::vector<std::size_t> c{1, 1, 1};
         std::vector<double> s(4), r(3);
         w.all_to_all_v<double>(s, c, r, c);
       }},
      {"send to a peer out of range", {"send_recv", "send peer 3 is not a rank of this group of 3"},
       [](Comm& w) {
         std::vector<std::int64_t> b(1);
         const std::array<SendOp<std::int64_t>, 1> s{SendOp<std::int64_t>{b, 3}};
         w.send_recv<std::int64_t>(s, {});
       }},
      {"receive from a negative peer", {"send_recv", "recv peer -1 is not a rank of this group of 3"},
       [](Comm& w) {
         std::vector<std::int64_t> b(1);
         const std::array<RecvOp<std::int64_t>, 1> r{RecvOp<std::int64_t>{b, -1}};
         w.send_recv<std::int64_t>({}, r);
       }},
      {"broadcast root out of range", {"broadcast", "root 3 is not a rank of this group of 3"},
       [](Comm& w) {
         std::vector<float> b(1);
         w.broadcast<float>(b, 3);
       }},
      {"split with a negative color", {"split", "color -1 is negative"}, [](Comm& w) { (void)w.split(-1, 0, "x"); }},
      {"all_to_all_v self counts", {"all_to_all_v", "sends itself 1 elements but expects to receive 2"},
       [](Comm& w) {
         std::vector<std::size_t> s{1, 1, 1}, rc{2, 2, 2};
         std::vector<double> a(3), b(6);
         w.all_to_all_v<double>(a, s, b, rc);
       }},
      // NCCL's aliasing rules, enforced here too
      {"all_to_all in place", {"all_to_all on group", "send and recv overlap: all_to_all has no in-place form"},
       [](Comm& w) {
         std::vector<float> b(6);
         w.all_to_all<float>(b, b);
       }},
      {"all_to_all_v overlapping", {"all_to_all_v", "send and recv overlap: all_to_all_v has no in-place form"},
       [](Comm& w) {
         std::vector<std::size_t> c{1, 1, 1};
         std::vector<float> b(6);
         w.all_to_all_v<float>(std::span<const float>(b).first(3), c, std::span<float>(b).subspan(2, 3), c);
       }},
      {"all_reduce partly overlapping", {"all_reduce", "overlap without being the same buffer"},
       [](Comm& w) {
         std::vector<std::int32_t> b(5);
         w.all_reduce<std::int32_t>(std::span<const std::int32_t>(b).first(4), std::span<std::int32_t>(b).subspan(1, 4));
       }},
      {"reduce_scatter in place at the wrong offset",
       {"reduce_scatter", "recv must start at element rank() * recv.size() ="},
       [](Comm& w) {  // rank r's block starts at element 2r; recv starts at 1
         std::vector<std::int32_t> b(6);
         w.reduce_scatter<std::int32_t>(b, std::span<std::int32_t>(b).subspan(1, 2));
       }},
      {"all_gather in place at the wrong offset", {"all_gather", "send must start at element rank() * send.size() ="},
       [](Comm& w) {  // rank r's block starts at element 2r; send starts at 1
         std::vector<std::int32_t> b(6);
         w.all_gather<std::int32_t>(std::span<const std::int32_t>(b).subspan(1, 2), b);
       }},
      {"send_recv receiving into a send buffer", {"send_recv", "overlaps the send buffer to peer 0"},
       [](Comm& w) {
         std::vector<std::int32_t> b(4);
         const std::array<SendOp<std::int32_t>, 1> s{SendOp<std::int32_t>{std::span<const std::int32_t>(b).first(2), 0}};
         const std::array<RecvOp<std::int32_t>, 1> r{RecvOp<std::int32_t>{std::span<std::int32_t>(b).subspan(1, 2), 2}};
         w.send_recv<std::int32_t>(s, r);
       }},
      {"send_recv receiving twice into one buffer", {"send_recv", "receive buffers from peers 0 and 2", "overlap"},
       [](Comm& w) {
         std::vector<std::int32_t> b(2);
         const std::array<RecvOp<std::int32_t>, 2> r{RecvOp<std::int32_t>{b, 0}, RecvOp<std::int32_t>{b, 2}};
         w.send_recv<std::int32_t>({}, r);
       }},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    // every rank makes the bad call: each one finds it out by itself
    auto o = run_misuse(n, c.call);
    check_run_threw_comm_error(o);
    check_errors(o, all_ranks(n), [&](int) {
      auto v = c.needles;
      v.push_back(world_text(n));
      return v;
    });
    for (int r = 0; r < n; ++r) {
      CHECK_FALSE(contains(o.msg[r], "aborted"));
      CHECK(o.msg[r].rfind("fived host backend: rank " + str(r) + " in ", 0) == 0);
    }

    // only rank 1 makes it, the others a barrier: rank 1's own error is the
    // cause (run() rethrows it), the others see the run aborted
    auto one = run_misuse(n, [&](Comm& w) {
      if (w.rank() == 1) c.call(w);
      else w.barrier();
    });
    check_run_threw_comm_error(one);
    CHECK(one.run_msg == one.msg[1]);
    check_errors(one, {1}, [&](int) { return c.needles; });
    CHECK_FALSE(contains(one.msg[1], "aborted"));
    check_errors(one, {0, 2}, [&](int) {
      return std::vector<std::string>{"barrier on group " + world_text(n), "aborted", "rank 1 failed"};
    });
  }

  // on a sub-group the message names the sub-group and its size
  auto o = run_misuse(4, [](Comm& w) {
    Comm tp = w.split(w.rank() / 2, w.rank(), "tp");
    std::vector<float> b(1);
    const std::array<SendOp<float>, 1> s{SendOp<float>{b, 2}};
    tp.send_recv<float>(s, {});
  });
  check_run_threw_comm_error(o);
  // Each rank either finds its own mistake or (if a faster rank found its
  // first, while this one was still leaving the split) sees the run aborted.
  check_errors(o, all_ranks(4), [](int) {
    return std::vector<std::string>{"send_recv on group tp {", "peer 2 is not a rank of this group of 2"};
  });
  CHECK(contains(o.run_msg, "in send_recv on group tp {"));
  CHECK_FALSE(contains(o.run_msg, "aborted"));
}

TEST_CASE("misuse: a rank stuck in its own work times out the others") {
  // The timeout is what catches a rank that is busy, not waiting: deadlock
  // detection cannot, since that rank might still come.
  unsetenv("FIVED_HOST_TIMEOUT_S");  // this test sets its own timeout
  const auto timeout = std::chrono::milliseconds(200);
  const double sleep_s = 0.7;
  for (const std::string kind : {"barrier", "receive"}) {
    CAPTURE(kind);
    auto o = run_misuse(
        3,
        [&](Comm& w) {
          if (w.rank() == 0) std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
          if (kind == "barrier" || w.rank() == 0) {
            w.barrier();
          } else {
            std::vector<std::int32_t> in(1);
            const std::array<RecvOp<std::int32_t>, 1> r{RecvOp<std::int32_t>{in, 0}};
            w.send_recv<std::int32_t>({}, r);
          }
        },
        host::RunOptions{.timeout = timeout});
    INFO("run() threw: " << o.run_msg);
    CHECK(o.run_kind == comm_error);
    CHECK(contains(o.run_msg, "timed out after 200 ms"));
    CHECK(o.seconds >= sleep_s - 0.05);  // run() waits for the sleeping thread
    CHECK(o.seconds < sleep_s + quick);
    const std::string what = kind == "barrier" ? "barrier on group world {0,1,2}"
                                               : "send_recv (receive from rank 0) on group world {0,1,2}";
    check_errors(o, {1, 2}, [&](int) { return std::vector<std::string>{what, "timed out after 200 ms"}; });
    for (int r : {1, 2}) {  // the waiting ranks hear about it at the timeout, not when rank 0 wakes
      CHECK(o.at[r] >= 0.19);
      CHECK(o.at[r] < sleep_s - 0.1);
    }
    // the sleeper finds the run aborted when it finally calls the barrier
    check_errors(o, {0}, [](int) { return std::vector<std::string>{"barrier on group world {0,1,2}", "timed out"}; });
    CHECK(o.at[0] >= sleep_s - 0.05);
  }
}

TEST_CASE("FIVED_HOST_TIMEOUT_S is parsed strictly and never overrides RunOptions::timeout") {
  struct EnvGuard {  // restores the variable whatever the test does
    ~EnvGuard() { unsetenv("FIVED_HOST_TIMEOUT_S"); }
  } guard;

  // values that are not a positive number of seconds: run() refuses them
  // before any rank starts (atof made "abc" a 0 ms timeout: every wait aborted)
  for (const char* bad : {"abc", "5s", "1.5.2", "0", "-3", "inf", "nan", " "}) {
    CAPTURE(bad);
    setenv("FIVED_HOST_TIMEOUT_S", bad, 1);
    std::atomic<int> started{0};
    std::string msg;
    try {
      host::run(2, [&](Comm&) { started.fetch_add(1); });
    } catch (const std::invalid_argument& e) {
      msg = e.what();
    }
    CHECK(started.load() == 0);
    CHECK(msg.rfind("FIVED_HOST_TIMEOUT_S=" + std::string(bad) + " is not a", 0) == 0);
    CHECK(contains(msg, "number of seconds"));
    CHECK(contains(msg, "unset it for the default (300 s)"));
  }
  setenv("FIVED_HOST_TIMEOUT_S", "abc", 1);
  CHECK_THROWS_WITH_AS(util::env_seconds("FIVED_HOST_TIMEOUT_S", 300),
                       "FIVED_HOST_TIMEOUT_S=abc is not a number of seconds: set it to a positive number of seconds "
                       "such as 300, or unset it for the default (300 s)",
                       std::invalid_argument);
  // good values, blanks around them allowed; empty or unset is the default
  for (auto [text, want] : {std::pair{"2.5", 2.5}, {" 7 ", 7.0}, {"1e-3", 1e-3}, {"", 300.0}}) {
    CAPTURE(text);
    setenv("FIVED_HOST_TIMEOUT_S", text, 1);
    CHECK(util::env_seconds("FIVED_HOST_TIMEOUT_S", 300).count() == want);
  }
  unsetenv("FIVED_HOST_TIMEOUT_S");
  CHECK(util::env_seconds("FIVED_HOST_TIMEOUT_S", 300).count() == 300.0);

  // the variable applies when RunOptions::timeout is unset...
  const double sleep_s = 0.6;
  auto sleepy_barrier = [&](Comm& w) {
    if (w.rank() == 0) std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
    w.barrier();
  };
  setenv("FIVED_HOST_TIMEOUT_S", "0.2", 1);
  auto env = run_misuse(2, sleepy_barrier);
  INFO("run() threw: " << env.run_msg);
  CHECK(env.run_kind == comm_error);
  CHECK(contains(env.run_msg, "timed out after 200 ms"));
  check_errors(env, {1}, [](int) { return std::vector<std::string>{"barrier on group world {0,1}", "timed out"}; });

  // ...but an explicit timeout wins: the same run, given 5 s, succeeds
  auto given = run_misuse(2, sleepy_barrier, host::RunOptions{.timeout = std::chrono::seconds(5)});
  INFO("run() threw: " << given.run_msg);
  CHECK(given.run_kind == none);
  CHECK(given.seconds >= sleep_s - 0.05);

  // and an explicit short one is not lengthened by a long variable
  setenv("FIVED_HOST_TIMEOUT_S", "100", 1);
  auto short_one = run_misuse(2, sleepy_barrier, host::RunOptions{.timeout = std::chrono::milliseconds(150)});
  CHECK(short_one.run_kind == comm_error);
  CHECK(contains(short_one.run_msg, "timed out after 150 ms"));

  // an explicit timeout must be positive
  CHECK_THROWS_AS(host::run(2, [](Comm&) {}, host::RunOptions{.timeout = std::chrono::milliseconds(0)}),
                  std::invalid_argument);

  // huge values are a year, not an overflow into a timeout of 1 ms or one already past: a
  // barrier after a short sleep still succeeds
  const auto year = std::chrono::milliseconds(static_cast<std::int64_t>(host::detail::max_timeout_s) * 1000);
  for (const char* huge : {"1e10", "1e300"}) {
    CAPTURE(huge);
    setenv("FIVED_HOST_TIMEOUT_S", huge, 1);
    CHECK(host::detail::resolve_timeout({}) == year);
    auto r = run_misuse(2, [](Comm& w) {
      if (w.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      w.barrier();
    });
    CHECK(r.run_kind == none);
  }
  CHECK(host::detail::resolve_timeout(host::RunOptions{.timeout = std::chrono::hours(24 * 3650)}) == year);
  unsetenv("FIVED_HOST_TIMEOUT_S");
}

TEST_CASE("synchronize is a no-op and name() is the group's name by reference") {
  static_assert(std::is_same_v<decltype(std::declval<const Comm&>().name()), const std::string&>);
  std::vector<int> done(3, 0);
  host::run(3, [&](Comm& w) {
    std::vector<std::int32_t> b(2, w.rank());
    w.all_reduce<std::int32_t>(std::span<std::int32_t>(b));
    w.synchronize();  // the result is there already; nothing to wait for
    done[w.rank()] = b[0] == 3 && w.name() == "world";
  });
  CHECK(done == std::vector<int>(3, 1));
}

TEST_CASE("misuse: after an abort every call fails at once") {
  const int n = 3;
  struct Seen {
    int calls = 0, comm_errors = 0;
    double slowest = 0;
    std::vector<std::string> missed;  // calls that did not throw CommError
  };
  std::vector<Seen> seen(n);
  std::atomic<int> left_split{0};
  std::string run_msg;
  try {
    host::run(n, [&](Comm& w) {
      const int r = w.rank();
      Comm sub = w.split(0, -r, "sub");  // made before the abort
      if (r == 0) {
        // wait until the others have left the split, so that they see the
        // abort in the calls below and not while leaving the split
        while (left_split.load() < n - 1) std::this_thread::yield();
        throw std::runtime_error("rank 0 failed first");
      }
      left_split.fetch_add(1);
      try {
        w.barrier();
      } catch (const CommError&) {
      }
      Seen& s = seen[r];
      auto attempt = [&](const std::string& name, auto&& call) {
        ++s.calls;
        const auto t0 = Clock::now();
        try {
          call();
          s.missed.push_back(name + " returned normally");
        } catch (const CommError& e) {
          const std::string m = e.what();
          if (contains(m, "rank " + str(r) + " in ") && contains(m, "rank 0 failed first")) ++s.comm_errors;
          else s.missed.push_back(name + ": " + m);
        } catch (...) {
          s.missed.push_back(name + " threw something else");
        }
        s.slowest = std::max(s.slowest, seconds_since(t0));
      };
      for (Comm* c : {&w, &sub}) {
        std::vector<std::int32_t> a(3, r), b(3), g(9);
        std::vector<std::size_t> counts{1, 1, 1};
        attempt("all_reduce", [&] { c->all_reduce<std::int32_t>(a, b); });
        attempt("reduce_scatter", [&] { c->reduce_scatter<std::int32_t>(g, b); });
        attempt("all_gather", [&] { c->all_gather<std::int32_t>(a, g); });
        attempt("all_to_all", [&] { c->all_to_all<std::int32_t>(a, b); });
        attempt("all_to_all_v", [&] { c->all_to_all_v<std::int32_t>(a, counts, b, counts); });
        attempt("broadcast", [&] { c->broadcast<std::int32_t>(b, 0); });
        attempt("barrier", [&] { c->barrier(); });
        attempt("split", [&] { (void)c->split(0, 0, "late"); });
        const std::array<SendOp<std::int32_t>, 1> sends{SendOp<std::int32_t>{a, 0}};
        const std::array<RecvOp<std::int32_t>, 1> recvs{RecvOp<std::int32_t>{b, 0}};
        attempt("send_recv (receive)", [&] { c->send_recv<std::int32_t>({}, recvs); });
        attempt("send_recv (send only)", [&] { c->send_recv<std::int32_t>(sends, {}); });
      }
    });
  } catch (const std::runtime_error& e) {
    run_msg = e.what();
  }
  CHECK(run_msg == "rank 0 failed first");
  for (int r = 1; r < n; ++r) {
    CAPTURE(r);
    CHECK(seen[r].calls == 20);
    CHECK(seen[r].comm_errors == 20);
    for (const auto& m : seen[r].missed) CHECK_MESSAGE(false, m);
    CHECK(seen[r].slowest < 0.5);
  }
}

TEST_CASE("misuse: two threads of one rank on one group fail the run at once, naming both calls (20 runs)") {
  for (int run = 0; run < 20; ++run) {
    CAPTURE(run);
    const auto start = std::chrono::steady_clock::now();
    std::string what = "no error";
    std::string helper_error;
    try {
      host::run(2, [&](Comm& w) {
        std::vector<float> x(4, 1.0f);
        if (w.rank() == 0) {
          std::jthread helper([&] {  // joined however rank 0's own call ends
            std::vector<float> y(4, 1.0f);
            try {
              w.all_reduce(std::span<float>(y));
            } catch (const std::exception& e) {
              helper_error = e.what();
            }
          });
          w.all_reduce(std::span<float>(x));
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));  // both of rank 0's calls are in first
          w.all_reduce(std::span<float>(x));
        }
      });
    } catch (const CommError& e) {
      what = e.what();
    }
    const std::string both = what + " | " + helper_error;
    CHECK(both.find("two threads of one rank use one communicator at once") != std::string::npos);
    CHECK(both.find("all_reduce on group world") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(1));
  }
}

TEST_CASE("misuse: a helper thread that has ended does not hide a deadlock from the detector") {
  // Rank 0 does one collective from a helper thread that then ends; later rank 1 skips a
  // barrier. The ended helper must not count as a running thread of rank 0.
  const auto start = std::chrono::steady_clock::now();
  std::string what = "no error";
  try {
    host::run(
        2,
        [&](Comm& w) {
          std::vector<std::int32_t> v(1, 1);
          if (w.rank() == 0) {
            std::jthread([&] { w.all_reduce<std::int32_t>(std::span<std::int32_t>(v)); }).join();
            w.barrier();
          } else {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the helper waits for it (an entry)
            w.all_reduce<std::int32_t>(std::span<std::int32_t>(v));     // and no barrier
          }
        },
        host::RunOptions{.timeout = std::chrono::seconds(20)});
  } catch (const CommError& e) {
    what = e.what();
  }
  CHECK(what.find("deadlock") != std::string::npos);
  CHECK(what.find("rank 1 has returned from its function") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(2));
}

TEST_CASE("misuse: a communicator kept after its run has returned fails at once, saying so") {
  std::unique_ptr<Comm> kept;
  host::run(2, [&](Comm& w) {
    if (w.rank() == 0) kept = std::make_unique<Comm>(w);
  });
  const auto start = std::chrono::steady_clock::now();
  std::string what = "no error";
  try {
    kept->barrier();
  } catch (const CommError& e) {
    what = e.what();
  }
  CHECK(what.find("the host::run this communicator belongs to has returned") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(1));
}

// Run by the ctest comm_host.threads_that_cannot_start under a small address-space limit.
TEST_CASE("threads that cannot be started end the run with a sentence, not std::terminate" *
          doctest::skip(std::getenv("FIVED_TEST_THREAD_LIMIT") == nullptr)) {
  std::atomic<int> started{0};
  std::string what = "no error";
  try {
    host::run(100000, [&](Comm& w) {
      started.fetch_add(1);
      w.barrier();  // the started ranks wait for ranks that never come: the abort must release them
    });
  } catch (const CommError& e) {
    what = e.what();
  }
  MESSAGE(started.load() << " ranks started; " << what);
  CHECK(what.find("could not start the thread of rank") != std::string::npos);
}

TEST_CASE("host::run rejects a world without ranks") {
  CHECK_THROWS_AS(host::run(0, [](Comm&) {}), std::invalid_argument);
}

TEST_CASE("a rank whose compute thread runs while its communication thread waits is not deadlocked") {
  // Rank 0 waits at a barrier for rank 1, whose own thread is busy (it has called no
  // collective yet) while a second thread of rank 1 waits in an all-reduce on another group
  // that rank 0 joins after the barrier. Nothing is stuck: rank 1's own thread is running.
  std::vector<std::int32_t> sums(2, 0);
  host::run(2, [&](Comm& w) {
    Comm g = w.split(0, w.rank(), "g");
    std::vector<std::int32_t> v(1, w.rank() + 1);
    if (w.rank() == 0) {
      w.barrier();
      g.all_reduce<std::int32_t>(std::span<std::int32_t>(v));
    } else {
      std::thread side([&] { g.all_reduce<std::int32_t>(std::span<std::int32_t>(v)); });
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // compute
      w.barrier();
      side.join();
    }
    sums[static_cast<std::size_t>(w.rank())] = v[0];
  });
  CHECK(sums == std::vector<std::int32_t>{3, 3});
}
