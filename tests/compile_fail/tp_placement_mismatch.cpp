// A row-parallel layer without sequence parallelism produces a replicated
// output; a column-parallel layer with sequence parallelism takes a
// sequence-sharded input. Chaining them does not compile.
#include <fived/nn/tp/linear.hpp>
using namespace fived;
using M = Mesh<TP<2>>;
static_assert(nn::tp::Chain<nn::tp::RowParallelLinear<M, false>, nn::tp::ColumnParallelLinear<M, true>>::ok);
int main() {}
