// ZeRO stages 2 and 3 are named but not implemented yet: DataParallel says so.
#include <fived/nn/gpt.hpp>
#include <fived/train/data_parallel.hpp>
struct cfg : fived::gpt_config {
  static constexpr int layers = 1, d_model = 16, heads = 2, vocab = 32, max_seq = 8, vocab_multiple = 8;
};
using D = fived::DataParallel<fived::GPT<cfg>, 2, fived::ZeRO<2>>;
int main() { return sizeof(D) > 0 ? 0 : 1; }
