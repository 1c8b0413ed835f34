#pragma once
// Axis tags of the parallel mesh: DP<N>, TP<N>, PP<N>, CP<N>, EP<N>.
//
// A tag carries its axis and its extent. The world is the product of the four
// "world axes" (tp, cp, dp, pp); EP is not a world factor: the expert view is
// carved out of the DP·CP·TP ranks of each pipeline stage (see mesh.hpp).

#include <array>
#include <concepts>
#include <string_view>

namespace fived {

// Canonical order of the world axes, fastest varying first (as in Megatron,
// torchtitan and nanotron): neighbouring ranks share a TP group, so tensor
// parallelism stays inside a node; pipeline stages are the slowest.
enum class Axis : int { tp = 0, cp = 1, dp = 2, pp = 3, ep = 4 };

inline constexpr int world_axis_count = 4;  // tp, cp, dp, pp
inline constexpr std::array<Axis, world_axis_count> world_axes{Axis::tp, Axis::cp, Axis::dp, Axis::pp};

constexpr std::string_view axis_name(Axis a) {
  switch (a) {
    case Axis::tp: return "tp";
    case Axis::cp: return "cp";
    case Axis::dp: return "dp";
    case Axis::pp: return "pp";
    case Axis::ep: return "ep";
  }
  return "?";
}

constexpr bool is_world_axis(Axis a) { return a != Axis::ep; }

namespace detail {
template <Axis A, int N>
struct axis_tag {
  static_assert(N >= 1, "a mesh axis needs an extent of at least 1 (write TP<1> or leave the axis out)");
  static constexpr Axis axis = A;
  static constexpr int extent = N;
};
}  // namespace detail

template <int N> struct TP : detail::axis_tag<Axis::tp, N> {};  // tensor parallel
template <int N> struct CP : detail::axis_tag<Axis::cp, N> {};  // context parallel (ring attention)
template <int N> struct DP : detail::axis_tag<Axis::dp, N> {};  // data parallel (and ZeRO shards)
template <int N> struct PP : detail::axis_tag<Axis::pp, N> {};  // pipeline parallel
template <int N> struct EP : detail::axis_tag<Axis::ep, N> {};  // expert parallel (a view, not a world factor)

template <class T>
concept AxisTag = requires {
  { T::axis } -> std::convertible_to<Axis>;
  { T::extent } -> std::convertible_to<int>;
};

}  // namespace fived
