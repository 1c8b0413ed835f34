#pragma once
// MeshContext: this rank's place on the mesh and a communicator for each of
// the mesh's groups, all split from the world communicator at construction.
//
//   auto ctx = fived::make_mesh_context<Mesh<DP<2>, TP<4>>>(world);
//   ctx.comm<Axis::tp>().all_reduce(...);
//   ctx.comm<typename M::grad_group>().reduce_scatter(...);

#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "fived/comm/communicator.hpp"
#include "fived/mesh/mesh.hpp"

namespace fived {

template <MeshType M, Communicator C>
class MeshContext {
 public:
  using mesh = M;
  using comm_type = C;
  // The groups a context builds communicators for.
  using groups = std::tuple<typename M::tp_group, typename M::cp_group, typename M::dp_group, typename M::pp_group,
                            typename M::grad_group, typename M::expert_group, typename M::expert_data_group>;

  // Takes the world communicator by value: pass std::move(world) for a
  // move-only one (nccl::Comm).
  explicit MeshContext(C world)
      : world_(check_size(std::move(world))), coord_(M::coord(world_.rank())), comms_(split_all(world_, group_indices{})) {}

  int rank() const { return world_.rank(); }
  const Coord& coord() const { return coord_; }
  C& world() { return world_; }

  // The communicator of group G (one of `groups`); its rank is G::index(rank()).
  template <GroupView G>
  C& comm() {
    return std::get<index_of<G>()>(comms_);
  }
  // The communicator over one world axis.
  template <Axis A>
  C& comm() {
    static_assert(is_world_axis(A), "EP is a view: use comm<typename Mesh::expert_group>()");
    return comm<typename M::template over<A>>();
  }

  // Calls f on the world communicator and on every group communicator, e.g.
  // to order all of them against one compute stream.
  template <class F>
  void for_each_comm(F&& f) {
    f(world_);
    std::apply([&](auto&... c) { (f(c), ...); }, comms_);
  }

 private:
  using group_indices = std::make_index_sequence<std::tuple_size_v<groups>>;
  template <class Seq> struct one_per_group;
  template <std::size_t... I> struct one_per_group<std::index_sequence<I...>> {
    using type = std::tuple<std::enable_if_t<(I >= 0), C>...>;
  };
  using comm_tuple = typename one_per_group<group_indices>::type;

  template <class G, std::size_t I = 0>
  static constexpr std::size_t index_of() {
    static_assert(I < std::tuple_size_v<groups>,
                  "MeshContext has no communicator for this group: use one of the mesh's named groups "
                  "(tp_group, cp_group, dp_group, pp_group, grad_group, expert_group, expert_data_group)");
    if constexpr (std::is_same_v<G, std::tuple_element_t<I, groups>>) return I;
    else return index_of<G, I + 1>();
  }

  static C check_size(C world) {
    if (world.size() != M::size)
      throw std::invalid_argument(M::name() + " needs " + std::to_string(M::size) + " ranks, but the world has " +
                                  std::to_string(world.size()) + ": launch " + std::to_string(M::size) +
                                  " processes (or host threads), or change the mesh to match the world");
    return world;
  }

  template <std::size_t... I>
  static comm_tuple split_all(C& world, std::index_sequence<I...>) {
    const int r = world.rank();
    // Splits are collectives: every rank makes them in the same order (braced
    // initialisation evaluates left to right).
    return comm_tuple{world.split(std::tuple_element_t<I, groups>::color(r), std::tuple_element_t<I, groups>::index(r),
                                  std::tuple_element_t<I, groups>::name())...};
  }

  C world_;
  Coord coord_;
  comm_tuple comms_;
};

template <MeshType M, Communicator C>
MeshContext<M, C> make_mesh_context(C world) {
  return MeshContext<M, C>(std::move(world));
}

}  // namespace fived
