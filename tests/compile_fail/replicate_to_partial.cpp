// Replicate -> Partial has no rule, so redistribute does not compile.
#include <fived/comm/host.hpp>
#include <fived/place/redistribute.hpp>
using namespace fived;
using M = Mesh<TP<2>>;
using L = ShardLayout<M, 1, Replicated>;
int main() {
  host::run(2, [](host::Comm& tp) {
    auto x = Sharded<float, L>(L({4}, M::coord(tp.rank())), std::vector<float>(4));
    auto y = redistribute<Axis::tp, Partial>(x, tp);
    (void)y;
  });
}
