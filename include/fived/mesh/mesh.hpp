#pragma once
// Mesh<Axes...>: the compile-time parallel layout.
//
// The world is TP × CP × DP × PP ranks in mixed radix, TP varying fastest and PP
// slowest. Every function here is constexpr; groups are types (AxisGroup,
// ExpertParallel, ExpertDataParallel) with the same static interface, so code
// that builds communicators or lays out buffers does not care which one it has.

#include <array>
#include <string>

#include "fived/mesh/axis.hpp"

namespace fived {

// A rank's position on the four world axes.
struct Coord {
  int tp = 0, cp = 0, dp = 0, pp = 0;
  constexpr int& operator[](Axis a) { return a == Axis::tp ? tp : a == Axis::cp ? cp : a == Axis::dp ? dp : pp; }
  constexpr int operator[](Axis a) const { return a == Axis::tp ? tp : a == Axis::cp ? cp : a == Axis::dp ? dp : pp; }
  friend constexpr bool operator==(const Coord&, const Coord&) = default;
};

// A set of world axes as a bit mask (bit i = Axis(i)); order-free, so
// over<dp, cp> and over<cp, dp> name the same group type.
using AxisSet = unsigned;
constexpr AxisSet axis_bit(Axis a) { return 1u << static_cast<int>(a); }
template <Axis... S>
inline constexpr AxisSet axis_set = (0u | ... | axis_bit(S));

template <class M, AxisSet S> struct AxisGroup;
template <class M> struct ExpertParallel;
template <class M> struct ExpertDataParallel;

// The mesh in canonical form. Users write Mesh<...> (below), which maps any
// order of axis tags to this one type.
template <int TP_, int CP_, int DP_, int PP_, int EP_>
struct BasicMesh {
  static constexpr int tp = TP_, cp = CP_, dp = DP_, pp = PP_, ep = EP_;
  static constexpr int size = tp * cp * dp * pp;

  static_assert((cp * dp) % ep == 0,
                "EP<N> must divide DP*CP: the expert view is carved out of the data- and context-parallel ranks "
                "of each pipeline stage (the experts themselves are split over TP like the dense MLP), so choose "
                "an EP extent that divides DP*CP");

  static constexpr int extent(Axis a) {
    switch (a) {
      case Axis::tp: return tp;
      case Axis::cp: return cp;
      case Axis::dp: return dp;
      case Axis::pp: return pp;
      case Axis::ep: return ep;
    }
    return 1;
  }
  // Distance in rank between neighbours on a world axis.
  static constexpr int stride(Axis a) {
    int s = 1;
    for (Axis b : world_axes) {
      if (b == a) return s;
      s *= extent(b);
    }
    return s;
  }

  static constexpr Coord coord(int rank) {
    Coord c;
    for (Axis a : world_axes) c[a] = (rank / stride(a)) % extent(a);
    return c;
  }
  static constexpr int rank(const Coord& c) {
    int r = 0;
    for (Axis a : world_axes) r += c[a] * stride(a);
    return r;
  }

  template <Axis... S>
  using over = AxisGroup<BasicMesh, axis_set<S...>>;
  using tp_group = over<Axis::tp>;
  using cp_group = over<Axis::cp>;
  using dp_group = over<Axis::dp>;
  using pp_group = over<Axis::pp>;
  using grad_group = over<Axis::dp, Axis::cp>;  // dense gradients reduce over DP×CP
  using expert_group = ExpertParallel<BasicMesh>;
  using expert_data_group = ExpertDataParallel<BasicMesh>;

  // "Mesh<DP<2>, TP<4>>"-style name for messages; extents of 1 are left out.
  static std::string name() {
    std::string s = "Mesh<";
    auto add = [&](const char* tag, int n) {
      if (n == 1) return;
      if (s.size() > 5) s += ", ";
      s.append(tag).append("<").append(std::to_string(n)).append(">");
    };
    add("TP", tp), add("CP", cp), add("DP", dp), add("PP", pp), add("EP", ep);
    return s + ">";
  }
};

namespace detail {
template <class... Axes>
struct make_mesh {
  static_assert((AxisTag<Axes> && ...), "Mesh<...> takes axis tags only: DP<N>, TP<N>, PP<N>, CP<N>, EP<N>");
  static constexpr int count([[maybe_unused]] Axis a) { return (0 + ... + (Axes::axis == a ? 1 : 0)); }
  static_assert(count(Axis::tp) <= 1, "Mesh<...> names the TP axis twice: give each axis once");
  static_assert(count(Axis::cp) <= 1, "Mesh<...> names the CP axis twice: give each axis once");
  static_assert(count(Axis::dp) <= 1, "Mesh<...> names the DP axis twice: give each axis once");
  static_assert(count(Axis::pp) <= 1, "Mesh<...> names the PP axis twice: give each axis once");
  static_assert(count(Axis::ep) <= 1, "Mesh<...> names the EP axis twice: give each axis once");
  static constexpr int extent([[maybe_unused]] Axis a) { return (1 * ... * (Axes::axis == a ? Axes::extent : 1)); }
  using type = BasicMesh<extent(Axis::tp), extent(Axis::cp), extent(Axis::dp), extent(Axis::pp), extent(Axis::ep)>;
};
}  // namespace detail

// Mesh<DP<2>, TP<4>>: axes in any order, absent axes have extent 1.
template <class... Axes>
using Mesh = typename detail::make_mesh<Axes...>::type;

template <class M>
concept MeshType = requires {
  { M::size } -> std::convertible_to<int>;
  { M::coord(0) } -> std::same_as<Coord>;
};

// What every group type derives from its member(color, index): the ranks of
// a rank's group, in index order.
template <class G>
struct GroupMembers {
  static constexpr auto members(int rank) {
    std::array<int, G::size> m{};
    for (int i = 0; i < G::size; ++i) m[i] = G::member(G::color(rank), i);
    return m;
  }
};

// The group of ranks that differ only on the axes in S. A rank's index in its
// group is its mixed-radix coordinate over S (canonical order), which is also
// the order of increasing world rank; its color numbers the groups.
template <class M, AxisSet S>
struct AxisGroup : GroupMembers<AxisGroup<M, S>> {
  static_assert((S & axis_bit(Axis::ep)) == 0,
                "EP is not a world axis: use Mesh::expert_group / expert_data_group for the expert view");
  static constexpr bool in(Axis a) { return (S & axis_bit(a)) != 0; }
  static constexpr int size = [] {
    int n = 1;
    for (Axis a : world_axes) n *= in(a) ? M::extent(a) : 1;
    return n;
  }();
  static constexpr int count = M::size / size;

  static constexpr int index(int rank) { return radix(M::coord(rank), true); }
  static constexpr int color(int rank) { return radix(M::coord(rank), false); }
  static constexpr int member(int color, int index) {
    Coord c;
    for (bool inside : {true, false}) {
      int v = inside ? index : color;
      for (Axis a : world_axes)
        if (in(a) == inside) c[a] = v % M::extent(a), v /= M::extent(a);
    }
    return M::rank(c);
  }
  static std::string name() {
    std::string s;
    for (Axis a : world_axes) {
      if (!in(a)) continue;
      if (!s.empty()) s += '*';
      s += axis_name(a);
    }
    return s.empty() ? "self" : s;
  }

 private:
  static constexpr int radix(const Coord& c, bool inside) {
    int v = 0, w = 1;
    for (Axis a : world_axes)
      if (in(a) == inside) v += c[a] * w, w *= M::extent(a);
    return v;
  }
};

// The expert view (Megatron's expert rank order with expert-TP = TP): each expert is split
// over TP like the dense MLP, and the DP·CP ranks of one pipeline stage that share a TP
// coordinate are refactored as EP × EDP, EP fastest. So a TP group never spans two EP
// ranks: every rank of an EP group holds the same TP slice of different experts, and
// tokens cross the EP group while the TP ranks of a replica route the same tokens alike.
template <class M>
struct ExpertView {
  static constexpr int stage_size = M::tp * M::cp * M::dp;
  static constexpr int edp = M::cp * M::dp / M::ep;
  static constexpr int local(int rank) { return rank % stage_size; }
  static constexpr int stage(int rank) { return rank / stage_size; }
  static constexpr int tp_coord(int rank) { return local(rank) % M::tp; }
  static constexpr int data(int rank) { return local(rank) / M::tp; }  // cp + CP * dp
  static constexpr int ep_coord(int rank) { return data(rank) % M::ep; }
  static constexpr int edp_coord(int rank) { return data(rank) / M::ep; }
  static constexpr int rank_of(int stage, int tp, int ep, int edp_c) {
    return stage * stage_size + (edp_c * M::ep + ep) * M::tp + tp;
  }
};

// Ranks holding different experts of the same layer: all-to-all of tokens.
template <class M>
struct ExpertParallel : GroupMembers<ExpertParallel<M>> {
  using V = ExpertView<M>;
  static constexpr int size = M::ep;
  static constexpr int count = M::size / size;
  static constexpr int index(int rank) { return V::ep_coord(rank); }
  static constexpr int color(int rank) { return (V::stage(rank) * V::edp + V::edp_coord(rank)) * M::tp + V::tp_coord(rank); }
  static constexpr int member(int color, int index) {
    const int c = color / M::tp;
    return V::rank_of(c / V::edp, color % M::tp, index, c % V::edp);
  }
  static std::string name() { return "ep"; }
};

// Ranks holding the same experts (the same TP slice of them): expert gradients reduce over
// this group.
template <class M>
struct ExpertDataParallel : GroupMembers<ExpertDataParallel<M>> {
  using V = ExpertView<M>;
  static constexpr int size = V::edp;
  static constexpr int count = M::size / size;
  static constexpr int index(int rank) { return V::edp_coord(rank); }
  static constexpr int color(int rank) { return (V::stage(rank) * M::ep + V::ep_coord(rank)) * M::tp + V::tp_coord(rank); }
  static constexpr int member(int color, int index) {
    const int c = color / M::tp;
    return V::rank_of(c / M::ep, color % M::tp, c % M::ep, index);
  }
  static std::string name() { return "edp"; }
};

// What every group type offers; communicators are built from it.
template <class G>
concept GroupView = requires(int r) {
  { G::size } -> std::convertible_to<int>;
  { G::count } -> std::convertible_to<int>;
  { G::index(r) } -> std::same_as<int>;
  { G::color(r) } -> std::same_as<int>;
  { G::member(r, r) } -> std::same_as<int>;
  { G::name() } -> std::same_as<std::string>;
};

}  // namespace fived
