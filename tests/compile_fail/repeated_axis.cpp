// A mesh that names an axis twice is rejected.
#include <fived/mesh/mesh.hpp>
using M = fived::Mesh<fived::TP<2>, fived::DP<2>, fived::TP<4>>;
int main() { return M::size; }
