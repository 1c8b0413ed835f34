// A hand-written GPipe table (P = 2, M = 2): rank 1 posts the receives of
// micro-batches 1 and 0 in that order, while rank 0 sends 0 first. NCCL matches
// point-to-point in order, so micro-batch 0 would land in micro-batch 1's buffer.
#include <fived/pipeline/schedule.hpp>
using namespace fived::pipeline::notation;
struct Mine {
  static constexpr fived::pipeline::Table<2, 2> table{
      {F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1).with_previous(), B(0), recv_grad(1, 1), B(1)},
      {recv_act(1, 0), recv_act(0, 0).with_previous(), F(0), F(1), B(0), send_grad(0, 0), B(1), send_grad(1, 0)}};
};
static_assert(fived::pipeline::proven<Mine>);
int main() {}
