// The README's example, kept compiling and running here.
#include <fived/fived.hpp>
using namespace fived;

using mesh = Mesh<DP<2>, TP<4>>;                         // 8 ranks, TP fastest
static_assert(mesh::tp_group::members(5)[0] == 4);       // groups are compile-time

int main() {
  host::run(mesh::size, [](host::Comm& world) {          // 8 ranks as threads
    auto ctx = make_mesh_context<mesh>(world);           // checks world size, splits groups

    // a [rows, cols] tensor whose columns are split over TP
    using W = ShardLayout<mesh, 2, Placements<On<Axis::tp, Shard<1>>>>;
    auto w = Sharded<float, W>(W({16, 32}, ctx.coord()), std::vector<float>(16 * 8, 1.f));

    auto full = redistribute<Axis::tp, Replicate>(w, ctx.comm<Axis::tp>());  // all-gather, chosen statically
    // redistribute<Axis::tp, Partial>(full, ...) would not compile: Replicate -> Partial has no rule
    if (full.local().size() != 16 * 32) throw std::logic_error("quickstart: the gathered tensor has the wrong size");
  });
}
