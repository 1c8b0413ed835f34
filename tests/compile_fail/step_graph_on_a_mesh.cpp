// A step replayed as a graph cannot wait for a collective: on a mesh of more than one rank
// set_step_graph does not compile.
#include <fived/nn/gpt.hpp>
#include <fived/train/data_parallel.hpp>
struct cfg : fived::gpt_config {
  static constexpr int layers = 1, d_model = 16, heads = 2, vocab = 32, max_seq = 8, vocab_multiple = 8;
};
using Model = fived::GPT<cfg, fived::Mesh<fived::TP<2>>>;
void turn_on(fived::DataParallel<Model>& dp) { dp.set_step_graph(true); }
int main() { return 0; }
