// A MeshContext only has communicators for the mesh's named groups.
#include <fived/comm/host.hpp>
#include <fived/mesh/context.hpp>
using namespace fived;
using M = Mesh<TP<2>, DP<2>, PP<2>>;
int main() {
  host::run(8, [](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    ctx.comm<M::over<Axis::tp, Axis::pp>>().barrier();
  });
}
