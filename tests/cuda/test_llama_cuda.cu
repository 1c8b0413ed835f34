// Llama on CUDA against Hugging Face transformers and against the host model: the tiny
// LlamaForCausalLM of tests/data/make_hf_llama_fixture.py loaded into Llama<tiny, Mesh<>, T,
// Cuda> gives transformers' fp32 loss (1e-5 relative) and every gradient (1e-4: cuBLASLt and
// the tiled attention sum in other orders than PyTorch's CPU kernels); bf16 within 3e-2.
//
// Without a GPU the program exits 77 (CTest: skipped) before any test runs.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
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

template <class E>
void equals_transformers(double loss_tol, double grad_tol) {
  const auto ref = io::SafetensorsFile::read(dir + "/hf_tiny_llama_ref.safetensors");
  const std::vector<std::int32_t> t32 = ref.read<std::int32_t>("tokens"), g32 = ref.read<std::int32_t>("targets");
  const std::vector<int> tok(t32.begin(), t32.end()), tgt(g32.begin(), g32.end());
  Llama<tiny, Mesh<>, E, Cuda> m;
  m.load(dir + "/hf_tiny_llama.safetensors");
  const double loss = m.forward(tok.data(), tgt.data(), B, T);
  m.backward();
  const std::vector<E> grads = m.grads_to_host();
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
  equals_transformers<bf16>(1e-2, 3e-2);
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
