// Every pipeline part needs a block: 2 layers cannot be cut into 4 parts.
#include <fived/nn/gpt.hpp>
#include <fived/pipeline/stage_layers.hpp>
struct cfg : fived::gpt_config {
  static constexpr int layers = 2, d_model = 16, heads = 2, vocab = 32, max_seq = 8, vocab_multiple = 8;
};
int main() { return fived::StageLayers<fived::GPT<cfg>, 4>::first(1); }
