// Llama-3-405B on 64 GPUs of 80 GiB, TP 8 x DP 8 without ZeRO: every GPU would hold a
// replica's eighth of the model with all of its AdamW state (16 bytes per parameter), about
// 760 GiB. require_fits refuses it with the sentence of the largest part, the optimizer state.
#include <fived/plan/fits.hpp>
#include <fived/plan/models.hpp>

struct run : fived::plan::layout {
  using mesh = fived::Mesh<fived::DP<8>, fived::TP<8>>;
  using recompute = fived::FullRecompute;
  static constexpr bool sequence_parallel = true;
  static constexpr int zero = 0, element_bytes = 2, micro_batch = 1, sequence = 8192;
};
using P = fived::plan::Plan<fived::plan::llama3_405b, run>;
static_assert(fived::plan::require_fits<P, (80ull << 30)>);
int main() { return 0; }
