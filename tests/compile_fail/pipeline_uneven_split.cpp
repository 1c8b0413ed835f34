// A schedule that needs equal parts (Even) with blocks that do not divide: 6 over 4.
#include <fived/nn/gpt.hpp>
#include <fived/pipeline/stage_layers.hpp>
struct cfg : fived::gpt_config {
  static constexpr int layers = 6, d_model = 16, heads = 2, vocab = 32, max_seq = 8, vocab_multiple = 8;
};
int main() { return fived::StageLayers<fived::GPT<cfg>, 4, fived::FlopCost, true>::first(1); }
