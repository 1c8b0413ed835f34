// Dimension 0 is sharded over DP and TP; TP cuts the finer pieces, so gathering
// over DP first would give non-contiguous pieces: it does not compile.
#include <fived/comm/host.hpp>
#include <fived/place/redistribute.hpp>
using namespace fived;
using M = Mesh<TP<2>, DP<2>>;
using L = ShardLayout<M, 1, Placements<On<Axis::tp, Shard<0>>, On<Axis::dp, Shard<0>>>>;
int main() {
  host::run(4, [](host::Comm& dp) {
    auto x = Sharded<float, L>(L({8}, M::coord(dp.rank())), std::vector<float>(2));
    auto y = redistribute<Axis::dp, Replicate>(x, dp);
    (void)y;
  });
}
