// Mesh<...> takes axis tags, nothing else.
#include <fived/mesh/mesh.hpp>
using M = fived::Mesh<fived::TP<2>, int>;
int main() { return M::size; }
