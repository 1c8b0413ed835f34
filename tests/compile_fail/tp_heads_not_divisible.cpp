// Tensor parallelism splits the attention heads over TP: a model with 6 heads
// on TP<4> does not compile, with a sentence that says what to change.
#include <fived/nn/gpt.hpp>
using namespace fived;
struct six_heads : gpt_config {
  static constexpr int layers = 1, d_model = 48, heads = 6, vocab = 64, max_seq = 8, vocab_multiple = 8;
};
int main() { return sizeof(GPT<six_heads, Mesh<TP<4>>>) > 0 ? 0 : 1; }
