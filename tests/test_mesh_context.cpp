// MeshContext on the host backend: every group communicator it builds has the
// size, rank, members and name the mesh type says, and a collective over it
// involves exactly the ranks of that group. Rank functions record into
// per-rank slots; the main thread checks after host::run() returns.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"

using namespace fived;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// What one rank saw of one group communicator.
struct Seen {
  std::string name;
  int size = -1, rank = -1;
  std::vector<int> members;         // host::Comm::members(): world ranks
  std::int64_t sum = -1;            // all_reduce sum of world ranks
  std::int64_t mask = -1;           // all_reduce sum of 1 << world rank: the exact set of members
  std::vector<std::int32_t> order;  // all_gather of world ranks: the members in group-rank order
};

Seen look(host::Comm& c) {
  Seen s{c.name(), c.size(), c.rank(), c.members(), 0, 0, {}};
  const int me = c.world_rank();
  std::int64_t v[2] = {me, std::int64_t{1} << me};
  c.all_reduce<std::int64_t>(std::span<std::int64_t>(v, 2));
  s.sum = v[0], s.mask = v[1];
  const std::int32_t mine = me;
  s.order.resize(c.size());
  c.all_gather<std::int32_t>(std::span<const std::int32_t>(&mine, 1), s.order);
  return s;
}

template <class M>
using Groups = typename MeshContext<M, host::Comm>::groups;
template <class M>
inline constexpr std::size_t group_count = std::tuple_size_v<Groups<M>>;

struct RankSeen {
  int rank = -1;
  Coord coord;
  int world_size = -1;
  std::vector<Seen> groups;  // in the order of MeshContext::groups
  std::vector<Seen> axes;    // comm<Axis::tp>(), cp, dp, pp
};

template <class M>
void check_mesh() {
  constexpr int n = M::size;
  INFO(M::name());
  std::vector<RankSeen> seen(n);
  host::run(n, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    RankSeen& s = seen[world.rank()];
    s.rank = ctx.rank();
    s.coord = ctx.coord();
    s.world_size = ctx.world().size();
    // one collective per group, each group in turn (every rank in the same
    // order, as collectives require)
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (s.groups.push_back(look(ctx.template comm<std::tuple_element_t<I, Groups<M>>>())), ...);
    }(std::make_index_sequence<group_count<M>>{});
    s.axes.push_back(look(ctx.template comm<Axis::tp>()));
    s.axes.push_back(look(ctx.template comm<Axis::cp>()));
    s.axes.push_back(look(ctx.template comm<Axis::dp>()));
    s.axes.push_back(look(ctx.template comm<Axis::pp>()));
  });

  const std::vector<std::string> group_names{"tp_group", "cp_group",     "dp_group",         "pp_group",
                                             "grad_group", "expert_group", "expert_data_group"};
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    const RankSeen& s = seen[r];
    CHECK(s.rank == r);
    CHECK(s.coord == M::coord(r));
    CHECK(s.world_size == n);
    REQUIRE(s.groups.size() == group_count<M>);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      auto one = [&]<class G>(const Seen& g, std::size_t i) {
        INFO("group " << group_names[i] << " (" << G::name() << ")");
        const auto m = G::members(r);
        const std::vector<int> want(m.begin(), m.end());
        std::int64_t sum = 0, mask = 0;
        for (int q : want) sum += q, mask |= std::int64_t{1} << q;
        CHECK(g.name == G::name());
        CHECK(g.size == G::size);
        CHECK(g.rank == G::index(r));
        CHECK(g.members == want);
        CHECK(g.sum == sum);
        CHECK(g.mask == mask);
        CHECK(std::vector<int>(g.order.begin(), g.order.end()) == want);
      };
      (one.template operator()<std::tuple_element_t<I, Groups<M>>>(s.groups[I], I), ...);
    }(std::make_index_sequence<group_count<M>>{});
    // comm<Axis::a>() is the communicator of over<a>: the same group
    CHECK(s.axes[0].members == s.groups[0].members);
    CHECK(s.axes[1].members == s.groups[1].members);
    CHECK(s.axes[2].members == s.groups[2].members);
    CHECK(s.axes[3].members == s.groups[3].members);
    for (int a = 0; a < 4; ++a) CHECK(s.axes[a].sum == s.groups[a].sum);
  }
}

}  // namespace

TEST_CASE("MeshContext: group communicators match the mesh's groups") {
  check_mesh<Mesh<>>();
  check_mesh<Mesh<TP<2>, DP<2>>>();
  check_mesh<Mesh<DP<2>, CP<2>, TP<2>>>();
  check_mesh<Mesh<PP<2>, TP<3>>>();
  check_mesh<Mesh<TP<2>, DP<4>, EP<4>>>();
  check_mesh<Mesh<PP<2>, DP<2>, CP<2>, EP<2>>>();
  check_mesh<Mesh<TP<2>, DP<3>, PP<2>, EP<3>>>();  // 12 ranks, EP across DP within each TP slice
}

TEST_CASE("MeshContext: the group communicators work together in one step") {
  // A TP reduction, then a gradient reduction over DP x CP, then an expert
  // all-to-all: results are exact and each involves only its own group.
  using M = Mesh<TP<2>, CP<2>, DP<2>, EP<4>>;
  using E = M::expert_group;
  constexpr int n = M::size;
  std::vector<std::vector<std::int64_t>> got(n), tokens(n);
  host::run(n, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    const int r = ctx.rank();
    std::int64_t x = r + 1;
    ctx.comm<Axis::tp>().all_reduce<std::int64_t>(std::span<std::int64_t>(&x, 1));
    std::int64_t g = x;
    ctx.comm<M::grad_group>().all_reduce<std::int64_t>(std::span<std::int64_t>(&g, 1));
    got[r] = {x, g};
    // token dispatch: block j goes to expert rank j, tagged with sender and receiver
    std::vector<std::int64_t> send(E::size * 2), recv(E::size * 2);
    for (int j = 0; j < E::size; ++j) send[2 * j] = 100 * r + j, send[2 * j + 1] = -r;
    ctx.comm<E>().all_to_all<std::int64_t>(send, recv);
    tokens[r] = recv;
  });
  for (int r = 0; r < n; ++r) {
    std::int64_t x = 0;
    for (int q : M::tp_group::members(r)) x += q + 1;
    std::int64_t g = 0;
    for (int q : M::grad_group::members(r)) {
      std::int64_t xq = 0;
      for (int p : M::tp_group::members(q)) xq += p + 1;
      g += xq;
    }
    CHECK(got[r] == std::vector<std::int64_t>{x, g});
    std::vector<std::int64_t> want;
    for (int q : E::members(r)) want.push_back(100 * q + E::index(r)), want.push_back(-q);
    CHECK(tokens[r] == want);
  }
}

TEST_CASE("MeshContext: a world of the wrong size is refused, naming the mesh and the rank count") {
  using M = Mesh<TP<2>, DP<2>>;
  for (int n : {1, 3, 5, 8}) {
    CAPTURE(n);
    std::vector<std::string> msg(n);
    std::vector<int> invalid(n, 0);
    std::string run_msg;
    bool run_invalid = false;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      host::run(n, [&](host::Comm& world) {
        try {
          auto ctx = make_mesh_context<M>(world);
        } catch (const std::invalid_argument& e) {
          msg[world.rank()] = e.what(), invalid[world.rank()] = 1;
          throw;
        }
      });
    } catch (const std::invalid_argument& e) {
      run_invalid = true, run_msg = e.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(seconds < 3.0);  // every rank finds out by itself: nothing waits
    CHECK(run_invalid);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      INFO("message: " << msg[r]);
      CHECK(invalid[r] == 1);
      CHECK(contains(msg[r], "Mesh<TP<2>, DP<2>>"));
      CHECK(contains(msg[r], "needs 4 ranks"));
      CHECK(contains(msg[r], "the world has " + std::to_string(n)));
    }
    CHECK(contains(run_msg, "Mesh<TP<2>, DP<2>> needs 4 ranks"));
  }

  // a bigger mesh, a world one rank short
  std::string run_msg;
  try {
    host::run(7, [](host::Comm& world) { (void)make_mesh_context<Mesh<TP<2>, DP<4>, EP<4>>>(world); });
  } catch (const std::invalid_argument& e) {
    run_msg = e.what();
  }
  CHECK(contains(run_msg, "Mesh<TP<2>, DP<4>, EP<4>> needs 8 ranks, but the world has 7"));
}
