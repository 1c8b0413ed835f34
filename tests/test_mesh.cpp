// Mesh algebra against a brute-force enumeration: coordinates are assigned by
// nested loops (pp outermost, tp innermost), groups by filtering all ranks,
// expert groups by Megatron's expert order with expert-TP = TP (tp fastest, then ep, edp, pp).
// The same constexpr checker runs inside the compiler (static_assert) for
// small meshes and at run time for large ones.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <array>
#include <tuple>
#include <utility>
#include <vector>

#include "fived/mesh/mesh.hpp"

using namespace fived;

namespace {

// What a group type says about every rank, as plain data.
struct GroupTable {
  int size = 0, count = 0;
  std::vector<int> index, color;           // per rank
  std::vector<std::vector<int>> members;   // per rank
  std::vector<int> member;                 // [color * size + index]
};

template <class G>
constexpr GroupTable table_of(int n) {
  GroupTable t{G::size, G::count, {}, {}, {}, {}};
  for (int r = 0; r < n; ++r) {
    t.index.push_back(G::index(r));
    t.color.push_back(G::color(r));
    const auto m = G::members(r);
    t.members.emplace_back(m.begin(), m.end());
  }
  for (int c = 0; c < G::count; ++c)
    for (int i = 0; i < G::size; ++i) t.member.push_back(G::member(c, i));
  return t;
}

// What a mesh type says, as plain data: the only part instantiated per mesh.
struct Snapshot {
  int tp, cp, dp, pp, ep, size;
  std::vector<Coord> coord;
  std::vector<int> rank_of;        // rank_of[r] = M::rank(brute-force coordinate of r)
  std::vector<AxisSet> sets;       // which axis groups were taken
  std::vector<GroupTable> groups;  // groups[i] is the group over sets[i]
  GroupTable expert, expert_data;
};

template <class M, AxisSet... S>
constexpr Snapshot snapshot(int size) {
  Snapshot s{M::tp, M::cp, M::dp, M::pp, M::ep, size, {}, {}, {S...}, {}, {}, {}};
  for (int r = 0; r < size; ++r) s.coord.push_back(M::coord(r));
  for (int pp = 0; pp < M::pp; ++pp)
    for (int dp = 0; dp < M::dp; ++dp)
      for (int cp = 0; cp < M::cp; ++cp)
        for (int tp = 0; tp < M::tp; ++tp) s.rank_of.push_back(M::rank(Coord{tp, cp, dp, pp}));
  (s.groups.push_back(table_of<AxisGroup<M, S>>(size)), ...);
  s.expert = table_of<typename M::expert_group>(size);
  s.expert_data = table_of<typename M::expert_data_group>(size);
  return s;
}

// members[r] = every rank q with same(r, q), ascending; index, color and
// member() must agree with it and colors must number the groups 0..count-1.
template <class Same>
constexpr bool group_agrees(const GroupTable& g, int n, Same same) {
  std::vector<bool> color_used(g.count, false);
  for (int r = 0; r < n; ++r) {
    std::vector<int> expect;
    for (int q = 0; q < n; ++q)
      if (same(r, q)) expect.push_back(q);
    if (static_cast<int>(expect.size()) != g.size || g.members[r] != expect) return false;
    if (g.color[r] < 0 || g.color[r] >= g.count) return false;
    color_used[g.color[r]] = true;
    for (int i = 0; i < g.size; ++i) {
      if (g.member[g.color[r] * g.size + i] != expect[i] || g.color[expect[i]] != g.color[r]) return false;
      if (expect[i] == r && g.index[r] != i) return false;
    }
  }
  for (bool used : color_used)
    if (!used) return false;
  return true;
}

constexpr bool agrees_with_brute_force(const Snapshot& s) {
  // coordinates by nested loops: pp outermost, tp innermost
  std::vector<Coord> coords;
  for (int pp = 0; pp < s.pp; ++pp)
    for (int dp = 0; dp < s.dp; ++dp)
      for (int cp = 0; cp < s.cp; ++cp)
        for (int tp = 0; tp < s.tp; ++tp) coords.push_back(Coord{tp, cp, dp, pp});
  if (static_cast<int>(coords.size()) != s.size) return false;
  for (int r = 0; r < s.size; ++r)
    if (!(s.coord[r] == coords[r]) || s.rank_of[r] != r) return false;
  for (std::size_t i = 0; i < s.sets.size(); ++i) {
    const AxisSet S = s.sets[i];
    const bool ok = group_agrees(s.groups[i], s.size, [&](int r, int q) {
      for (Axis a : world_axes)
        if (!(S & axis_bit(a)) && coords[r][a] != coords[q][a]) return false;
      return true;
    });
    if (!ok) return false;
  }
  // expert view: Megatron's order with expert-TP = TP — tp fastest, then ep, edp, pp
  const int edp = s.cp * s.dp / s.ep;
  std::vector<int> tp_of(s.size), ep_of(s.size), edp_of(s.size), pp_of(s.size);
  int rank = 0;
  for (int pp = 0; pp < s.pp; ++pp)
    for (int e = 0; e < edp; ++e)
      for (int x = 0; x < s.ep; ++x)
        for (int t = 0; t < s.tp; ++t) tp_of[rank] = t, ep_of[rank] = x, edp_of[rank] = e, pp_of[rank] = pp, ++rank;
  auto same = [&](const std::vector<int>& v, int r, int q) { return v[r] == v[q]; };
  return group_agrees(s.expert, s.size,
                      [&](int r, int q) { return same(pp_of, r, q) && same(edp_of, r, q) && same(tp_of, r, q); }) &&
         group_agrees(s.expert_data, s.size,
                      [&](int r, int q) { return same(pp_of, r, q) && same(ep_of, r, q) && same(tp_of, r, q); });
}

// Every one of the 16 subsets of {tp, cp, dp, pp}.
template <class M, std::size_t... S>
constexpr bool all_groups_match(int size, std::index_sequence<S...>) {
  return agrees_with_brute_force(snapshot<M, static_cast<AxisSet>(S)...>(size));
}
template <class M>
constexpr bool mesh_matches_brute_force(int size = M::size) {
  return all_groups_match<M>(size, std::make_index_sequence<16>{});
}
// The named groups only (cheaper to compile, for sweeps over many meshes).
template <class M>
constexpr bool named_groups_match(int size = M::size) {
  constexpr auto tp = axis_set<Axis::tp>, cp = axis_set<Axis::cp>, dp = axis_set<Axis::dp>, pp = axis_set<Axis::pp>;
  return agrees_with_brute_force(snapshot<M, tp, cp, dp, pp, dp | cp, tp | cp | dp>(size));
}

// Read at run time only: passing it keeps the compiler from treating the
// run-time checks of large meshes as constant expressions.
int runtime_zero = 0;

// ---- compile-time checks ---------------------------------------------------------------
static_assert(mesh_matches_brute_force<Mesh<>>());
static_assert(mesh_matches_brute_force<Mesh<TP<2>, DP<2>>>());
static_assert(mesh_matches_brute_force<Mesh<DP<2>, PP<2>, CP<2>, TP<2>>>());
static_assert(mesh_matches_brute_force<Mesh<TP<3>, CP<2>, DP<2>, PP<2>, EP<4>>>());
static_assert(mesh_matches_brute_force<Mesh<PP<3>, TP<4>, DP<2>, EP<2>>>());

static_assert(Mesh<>::size == 1 && Mesh<>::tp == 1 && Mesh<>::ep == 1);
static_assert(Mesh<DP<2>, TP<4>>::size == 8);
static_assert(Mesh<DP<8>, TP<4>, EP<8>>::size == 32, "EP is not a world factor");
static_assert(Mesh<TP<2>, DP<3>>::coord(1).tp == 1 && Mesh<TP<2>, DP<3>>::coord(2).dp == 1, "TP varies fastest");
static_assert(Mesh<TP<2>, PP<3>, DP<2>>::coord(4).pp == 1, "PP varies slowest");
static_assert(std::is_same_v<Mesh<TP<2>>::over<Axis::dp, Axis::cp>, Mesh<TP<2>>::over<Axis::cp, Axis::dp>>,
              "a group is a set of axes: order does not matter");
static_assert(GroupView<Mesh<TP<2>>::tp_group> && GroupView<Mesh<TP<2>>::expert_group> &&
              GroupView<Mesh<TP<2>>::expert_data_group>);

// ---- every order of the type arguments names the same mesh -----------------------------
template <class... Ts> struct list {};

template <class Ref, class Done, class Rest> struct all_orders_same;
template <class Ref, class... Done>
struct all_orders_same<Ref, list<Done...>, list<>> : std::is_same<Ref, Mesh<Done...>> {};
template <class Ref, class... Done, class... Rest>
struct all_orders_same<Ref, list<Done...>, list<Rest...>> {
  // pick each remaining tag as the next one
  template <std::size_t I>
  static constexpr bool pick() {
    using T = std::tuple_element_t<I, std::tuple<Rest...>>;
    return pick_rest<T, I>(std::make_index_sequence<sizeof...(Rest)>{});
  }
  template <class T, std::size_t I, std::size_t... J>
  static constexpr bool pick_rest(std::index_sequence<J...>) {
    using without = decltype(drop<I>(std::index_sequence<J...>{}));
    return all_orders_same<Ref, list<Done..., T>, without>::value;
  }
  template <std::size_t I, std::size_t... J>
  static auto drop(std::index_sequence<J...>) -> decltype(std::tuple_cat(
      std::conditional_t<J == I, std::tuple<>, std::tuple<std::tuple_element_t<J, std::tuple<Rest...>>>>{}...));
  template <std::size_t... I>
  static constexpr bool all(std::index_sequence<I...>) { return (pick<I>() && ...); }
  static constexpr bool value = all(std::make_index_sequence<sizeof...(Rest)>{});
};
template <class Ref, class... Done, class... T>
struct all_orders_same<Ref, list<Done...>, std::tuple<T...>> : all_orders_same<Ref, list<Done...>, list<T...>> {};

template <class... Tags>
constexpr bool every_order_same() {
  return all_orders_same<Mesh<Tags...>, list<>, list<Tags...>>::value;
}
static_assert(every_order_same<TP<2>, CP<3>, DP<4>, PP<5>>(), "all 24 orders of four axes");
static_assert(every_order_same<TP<2>, CP<3>, DP<4>, PP<5>, EP<6>>(), "all 120 orders of five axes");
static_assert(every_order_same<DP<8>, TP<8>, PP<16>>());

// ---- run-time sweep over extents ----------------------------------------------------------
template <int TP_, int CP_, int DP_, int PP_, int EP_ = 1>
void check() {
  using M = Mesh<PP<PP_>, EP<EP_>, TP<TP_>, DP<DP_>, CP<CP_>>;
  INFO(M::name());
  CHECK(named_groups_match<M>(M::size + runtime_zero));
}
template <int TP_, int CP_, int DP_, int PP_, int EP_ = 1>
void check_all_groups() {
  using M = Mesh<PP<PP_>, EP<EP_>, TP<TP_>, DP<DP_>, CP<CP_>>;
  INFO(M::name());
  CHECK(mesh_matches_brute_force<M>(M::size + runtime_zero));
}

template <int... E>
void sweep_single_axes(std::integer_sequence<int, E...>) {
  (check<E + 1, 1, 1, 1>(), ...);
  (check<1, E + 1, 1, 1>(), ...);
  (check<1, 1, E + 1, 1>(), ...);
  (check<1, 1, 1, E + 1>(), ...);
  (check<1, 1, E + 1, 1, E + 1>(), ...);  // EP over the whole DP group
}

template <int... T>
void sweep_tp_dp(std::integer_sequence<int, T...>) {
  (check<T + 1, 1, 3, 2>(), ...);
  (check<T + 1, 2, 8 - T, 1>(), ...);
}

}  // namespace

TEST_CASE("every axis alone, extents 1..8") { sweep_single_axes(std::make_integer_sequence<int, 8>{}); }

TEST_CASE("TP 1..8 against other axes") { sweep_tp_dp(std::make_integer_sequence<int, 8>{}); }

TEST_CASE("four-axis meshes with expert views, up to 4096 ranks") {
  check_all_groups<2, 3, 4, 5>();
  check_all_groups<2, 3, 4, 5, 6>();
  check_all_groups<4, 2, 8, 2, 16>();
  check_all_groups<8, 1, 4, 3, 4>();
  check_all_groups<8, 8, 8, 8, 64>();
}

TEST_CASE("names for messages") {
  CHECK(Mesh<DP<2>, TP<4>>::name() == "Mesh<TP<4>, DP<2>>");
  CHECK(Mesh<>::name() == "Mesh<>");
  CHECK(Mesh<DP<2>, TP<4>>::grad_group::name() == "cp*dp");
  CHECK(Mesh<DP<2>, TP<4>>::over<>::name() == "self");
}
