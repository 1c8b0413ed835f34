// Shard<2> names a dimension a rank-2 tensor does not have.
#include <fived/place/layout.hpp>
using namespace fived;
using L = ShardLayout<Mesh<TP<2>>, 2, Placements<On<Axis::tp, Shard<2>>>>;
int main() { return L({4, 4}, Coord{}).local_size() > 0; }
