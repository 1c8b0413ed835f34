// ZeRO-3 gathers each unit's parameters when the model is about to use it, so it needs a
// model that calls UnitHooks; the TP model bound to its communicator does not (yet).
#include <fived/comm/host.hpp>
#include <fived/nn/tp/gpt.hpp>
#include <fived/train/data_parallel.hpp>
struct cfg : fived::gpt_config {
  static constexpr int layers = 1, d_model = 16, heads = 2, vocab = 32, max_seq = 8, vocab_multiple = 8;
};
using M = fived::Mesh<fived::DP<2>, fived::TP<2>>;
using Bound = fived::nn::tp::Bound<fived::nn::tp::GPT<cfg, M, fived::nn::tp::SequenceParallel>, fived::host::Comm>;
using D = fived::DataParallel<Bound, 2, fived::ZeRO<3>>;
int main() { return sizeof(D) > 0 ? 0 : 1; }
