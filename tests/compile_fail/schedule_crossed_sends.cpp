// A hand-written 1F1B table (P = 2, M = 2) where rank 0 sends activations 1
// while rank 1 sends gradient 0, each in its own comm step before the matching
// receive: with blocking point-to-point both wait forever. Grouping rank 0's
// send_act(1, 1) with recv_grad(0, 1).with_previous() would fix it.
#include <fived/pipeline/schedule.hpp>
using namespace fived::pipeline::notation;
struct Mine {
  static constexpr fived::pipeline::Table<2, 2> table{
      {F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1), B(0), recv_grad(1, 1), B(1)},
      {recv_act(0, 0), F(0), B(0), send_grad(0, 0), recv_act(1, 0), F(1), B(1), send_grad(1, 0)}};
};
static_assert(fived::pipeline::proven<Mine>);
int main() {}
