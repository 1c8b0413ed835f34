// A model type that does not say how to name its pipeline parts: the contract's sentence.
#include <string>

#include <fived/model/contract.hpp>
#include <fived/nn/gpt.hpp>
struct cfg : fived::gpt_config {
  static constexpr int layers = 1, d_model = 16, heads = 2, vocab = 32, max_seq = 8, vocab_multiple = 8;
};
using G = fived::GPT<cfg>;
struct Forgetful {  // everything but `part`
  using mesh = G::mesh;
  using value_type = float;
  using device = fived::Host;
  using ops_type = G::ops_type;
  using init_type = fived::GptInit;
  using layout = G::layout;
  using serial_layout = G::serial_layout;
  static constexpr int layers = 1;
  static constexpr bool has_embedding = true, has_head = true;
  static constexpr double block_flops() { return 1; }
  static constexpr double embedding_flops() { return 0; }
  static constexpr double head_flops() { return 0; }
  static constexpr double flops_per_token(int) { return 6; }
  static std::string config_name() { return "forgetful"; }
};
int main() { return fived::check_model<Forgetful>::ok ? 0 : 1; }
