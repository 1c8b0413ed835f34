// ZeRO shards the training state over the data-parallel group: on a mesh whose
// gradient group has one rank there is nothing to shard it over.
#include <fived/nn/gpt.hpp>
#include <fived/train/data_parallel.hpp>
struct cfg : fived::gpt_config {
  static constexpr int layers = 1, d_model = 16, heads = 2, vocab = 32, max_seq = 8, vocab_multiple = 8;
};
using D = fived::DataParallel<fived::GPT<cfg, fived::Mesh<fived::TP<2>>>, fived::ZeRO<1>>;
int main() { return sizeof(D) > 0 ? 0 : 1; }
