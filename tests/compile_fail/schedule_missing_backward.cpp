// A hand-written 1F1B table (P = 2, M = 2) whose last rank forgets B(1): every
// stage must run one backward per micro-batch.
#include <fived/pipeline/schedule.hpp>
using namespace fived::pipeline::notation;
struct Mine {
  static constexpr fived::pipeline::Table<2, 2> table{
      {F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1).with_previous(), B(0), recv_grad(1, 1), B(1)},
      {recv_act(0, 0), F(0), recv_act(1, 0), B(0), send_grad(0, 0), F(1), send_grad(1, 0)}};
};
static_assert(fived::pipeline::proven<Mine>);
int main() {}
