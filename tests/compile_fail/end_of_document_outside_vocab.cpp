// The token that ends a packed document must be a token of the vocabulary (or -1 for none):
// one past it does not compile, with a sentence that says what to set.
#include <fived/nn/gpt.hpp>
using namespace fived;
struct past_vocab : gpt_config {
  static constexpr int layers = 1, d_model = 16, heads = 2, vocab = 64, max_seq = 8, vocab_multiple = 8;
  static constexpr int end_of_document = 64;
};
int main() { return sizeof(GPT<past_vocab>) > 0 ? 0 : 1; }
