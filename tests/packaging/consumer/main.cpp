// Uses fived through its umbrella header, as the README shows.
#include <fived/fived.hpp>

using M = fived::Mesh<fived::DP<2>, fived::TP<4>>;
static_assert(M::size == 8);

int main() { return M::coord(5).tp == 1 ? 0 : 1; }
