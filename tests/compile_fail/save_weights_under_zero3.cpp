// Trainer::save_weights gathers the weights where the trainer keeps them whole: under ZeRO<3>
// (each rank holds only its shard between steps) it does not compile.
#include <fived/nn/gpt.hpp>
#include <fived/train/trainer.hpp>
struct cfg : fived::gpt_config {
  static constexpr int layers = 1, d_model = 16, heads = 2, vocab = 32, max_seq = 8, vocab_multiple = 8;
};
using Model = fived::GPT<cfg, fived::Mesh<fived::DP<2>>>;
void save(fived::Trainer<Model, fived::ZeRO<3>>& t) { t.save_weights("weights.safetensors"); }
int main() { return 0; }
