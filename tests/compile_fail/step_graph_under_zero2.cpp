// A step replayed as a graph cannot map pages (ZeRO-2/3) or wait for a mixture of experts'
// counts: under ZeRO<2> set_step_graph does not compile.
#include <fived/nn/gpt.hpp>
#include <fived/train/data_parallel.hpp>
struct cfg : fived::gpt_config {
  static constexpr int layers = 1, d_model = 16, heads = 2, vocab = 32, max_seq = 8, vocab_multiple = 8;
};
using Model = fived::GPT<cfg, fived::Mesh<fived::DP<2>>>;
void turn_on(fived::DataParallel<Model, fived::ZeRO<2>>& dp) { dp.set_step_graph(true); }
int main() { return 0; }
