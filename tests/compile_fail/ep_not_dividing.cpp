// The expert view is carved out of DP*CP = 3 ranks: EP<4> does not divide it.
#include <fived/mesh/mesh.hpp>
using M = fived::Mesh<fived::TP<2>, fived::DP<3>, fived::EP<4>>;
int main() { return M::size; }
