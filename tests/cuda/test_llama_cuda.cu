// Llama on CUDA against Hugging Face transformers and against the host model: the tiny
// LlamaForCausalLM of tests/data/make_hf_llama_fixture.py loaded into Llama<tiny, Mesh<>, T,
// Cuda> gives transformers' fp32 loss (1e-5 relative) and every gradient (1e-4: cuBLASLt and
// the tiled attention sum in other orders than PyTorch's CPU kernels). In bf16 the loss is
// within 1e-2 and the gradients within 0.1 of transformers' fp32 ones: layer 0's norm weight
// gradient, a sum over the 64 rows with much cancellation, is 8.1e-2 away in the host bf16
// model too (measured 0.0808 there, and 0.055 on an H100 with cuDNN's attention); and the
// bf16 CUDA model equals the host bf16 model within 6e-2 (measured 0.047 on that tensor:
// cuDNN rounds the probabilities to bf16 before multiplying by V, the host does not).
//
// Without a GPU the program exits 77 (CTest: skipped) before any test runs.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <fived/nn/cuda/ops.hpp>  // first: Llama<Cfg, Mesh<>, T, Cuda> needs Ops<T, Cuda>
#include <fived/io/safetensors.hpp>
#include <fived/nn/llama.hpp>

#include "gpu_support.hpp"
#include "../support/compare.hpp"

namespace {

using namespace fived;

struct tiny : llama_config {  // as tests/test_llama.cpp
  static constexpr int layers = 2, d_model = 32, heads = 4, kv_heads = 2, ffn = 48, vocab = 61, max_seq = 32;
  static constexpr int vocab_multiple = 16;
  static constexpr double rope_theta = 10000.0, rope_factor = 8.0;
  static constexpr int rope_original_max_seq = 64;
};
constexpr int B = 4, T = 16;
const std::string dir = FIVED_TEST_DATA_DIR;

// The model's loss and gradients on the fixture's batch, on `Device`.
template <class E, class Device>
std::pair<double, std::vector<E>> loss_and_grads(const io::SafetensorsFile& ref) {
  const std::vector<std::int32_t> t32 = ref.read<std::int32_t>("tokens"), g32 = ref.read<std::int32_t>("targets");
  const std::vector<int> tok(t32.begin(), t32.end()), tgt(g32.begin(), g32.end());
  Llama<tiny, Mesh<>, E, Device> m;
  m.load(dir + "/hf_tiny_llama.safetensors");
  const double loss = m.forward(tok.data(), tgt.data(), B, T);
  m.backward();
  return {loss, m.grads_to_host()};
}

template <class E>
void equals_transformers(double loss_tol, double grad_tol) {
  const auto ref = io::SafetensorsFile::read(dir + "/hf_tiny_llama_ref.safetensors");
  const auto [loss, grads] = loss_and_grads<E, Cuda>(ref);
  const double want = ref.read<double>("loss32")[0];
  double worst = 0;
  std::string where;
  for (const ParamInfo& t : Llama<tiny>::serial_layout::tensors) {
    const std::vector<double> r = ref.read<double>("grad32." + t.name());
    const std::vector<E> got(grads.begin() + static_cast<std::ptrdiff_t>(t.offset),
                             grads.begin() + static_cast<std::ptrdiff_t>(t.offset + t.file_size()));
    if (const double e = test::max_rel_error(got, r); e > worst) worst = e, where = t.name();
  }
  MESSAGE("loss " << loss << " vs transformers' " << want << ", every gradient within " << worst << " (" << where << ")");
  CHECK(std::abs(loss - want) / want <= loss_tol);
  CHECK(worst <= grad_tol);
}

}  // namespace

TEST_CASE("CUDA float Llama from the Hugging Face fixture: transformers' loss and gradients") {
  equals_transformers<float>(1e-5, 1e-4);
}
TEST_CASE("CUDA bf16 Llama from the Hugging Face fixture: transformers' loss and gradients within bf16 bounds") {
  equals_transformers<bf16>(1e-2, 1e-1);
}
TEST_CASE("CUDA bf16 Llama = host bf16 Llama within bf16 bounds") {
  const auto ref = io::SafetensorsFile::read(dir + "/hf_tiny_llama_ref.safetensors");
  const auto [loss_d, grads_d] = loss_and_grads<bf16, Cuda>(ref);
  const auto [loss_h, grads_h] = loss_and_grads<bf16, Host>(ref);
  double worst = 0;
  std::string where;
  for (const ParamInfo& t : Llama<tiny>::serial_layout::tensors)
    if (const double e = test::max_rel_error(grads_d, grads_h, t.offset, t.file_size()); e > worst)
      worst = e, where = t.name();
  MESSAGE("loss " << loss_d << " vs the host's " << loss_h << ", every gradient within " << worst << " (" << where << ")");
  CHECK(std::abs(loss_d - loss_h) / loss_h <= 1e-3);
  CHECK(worst <= 6e-2);
}

int main(int argc, char** argv) {
  if (test::gpu_count() == 0) {
    std::puts("test_llama_cuda: no CUDA device, skipping");
    return test::skip_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
