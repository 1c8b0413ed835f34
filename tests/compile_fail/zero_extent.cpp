// An axis of extent zero is rejected.
#include <fived/mesh/mesh.hpp>
using M = fived::Mesh<fived::DP<0>>;
int main() { return M::size; }
