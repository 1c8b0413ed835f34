// The GPT on CUDA against the same GPT on the host: one algorithm (nn/gpt.hpp), two
// kernel sets (Ops<T, Host>, Ops<T, Cuda>). Same configuration, same initialisation seed,
// same batch; float on the host is the reference for CUDA float and CUDA bf16.
//
// Error measure: |cuda - host| over a tensor (or the buffer), relative to max |host| there.
// Bounds:
//   fp32: 1e-4 for logits, every gradient tensor, and the parameters after one AdamW step;
//         the loss within 1e-5 relative (it is a mean of N values summed in double).
//         The step itself (p1 - p0) agrees within 1e-2 of the largest step: Adam divides
//         by sqrt(v) + eps, which amplifies gradient differences on small gradients.
//   bf16: 3e-2 for logits, every gradient tensor and the parameters after the step
//         (bf16 keeps 8 bits; the host bf16 model differs from the host float model by
//         up to 1.4e-2 on this configuration); the loss within 1e-2.
// Initial parameters are identical on both devices (same bits: the initialisation is
// computed on the host and uploaded), and save (CUDA) + load (host) and back is exact.
//
// Without a GPU the program exits 77 (CTest: skipped) before any test runs.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <fived/nn/cuda/ops.hpp>  // first: GPT<Cfg, Mesh<>, T, Cuda> needs Ops<T, Cuda>
#include <fived/nn/gpt.hpp>
#include <fived/train/data_parallel.hpp>

#include "gpu_support.hpp"
#include "../support/compare.hpp"

namespace {

using fived::bf16;
using fived::Buffer;
using fived::Cuda;
using fived::GPT;
using fived::GptInit;
using fived::Host;
using fived::Mesh;
using fived::ParamInfo;

// 2 layers, C = 64, 4 heads (head size 16), vocab 101 padded to 112; T = 20 is not a
// multiple of the attention tile (32), so partial tiles are exercised.
struct tiny : fived::gpt_config {
  static constexpr int layers = 2, d_model = 64, heads = 4, vocab = 101, max_seq = 32, vocab_multiple = 16;
};
struct tiny_untied : tiny {
  static constexpr bool tied = false;
};

constexpr int B = 2, T = 20;
const GptInit init{7, 0.1};

void batch(std::vector<int>& tok, std::vector<int>& tgt, unsigned salt = 0) {
  tok.resize(static_cast<std::size_t>(B * T));
  tgt.resize(tok.size());
  for (std::size_t i = 0; i < tok.size(); ++i) {
    tok[i] = static_cast<int>((i * 37 + 11 + salt) % tiny::vocab);
    tgt[i] = static_cast<int>((i * 53 + 29 + 3 * salt) % tiny::vocab);
  }
}

using fived::test::max_rel_error;

// One AdamW step on every tensor (weight decay on all: the decay path is exercised too).
// eps = 1e-2 keeps the step a smooth function of the gradient, so that tiny gradient
// differences cannot flip a whole lr-sized step.
constexpr float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-2f, wd = 0.1f;

void host_step(GPT<tiny, Mesh<>, float, Host>& m) {
  std::vector<float> mm(m.params().size()), vv(m.params().size());
  fived::kernels::host::adamw_update(m.params().data(), static_cast<float*>(nullptr), m.grads().data(), mm.data(),
                                     vv.data(), m.params().size(), lr, beta1, beta2, eps, wd, 1);
}

// On CUDA; bf16 with fp32 master weights (initialised from the bf16 parameters).
template <class Cfg, class TT>
void cuda_step(GPT<Cfg, Mesh<>, TT, Cuda>& m) {
  auto& ops = m.ops();
  const std::size_t n = m.params().size();
  Buffer<float, Cuda> mm(n), vv(n), master;
  ops.synchronize();
  FIVED_CUDA_CHECK(cudaDeviceSynchronize());  // the zero-fills above (legacy stream) are done
  float* mp = nullptr;
  if constexpr (std::is_same_v<TT, bf16>) {
    const std::vector<bf16> p = m.params_to_host();
    std::vector<float> f(p.begin(), p.end());
    master = Buffer<float, Cuda>(std::span<const float>(f), ops.stream());
    mp = master.data();
  }
  fived::kernels::cuda::adamw_update(ops.stream(), m.params().data(), mp, m.grads().data(), mm.data(), vv.data(), n, lr,
                                     beta1, beta2, eps, wd, 1);
  ops.synchronize();
}

template <class TT>
void compare_with_host(double tol, double loss_tol) {
  std::vector<int> tok, tgt;
  batch(tok, tgt);
  GPT<tiny, Mesh<>, float, Host> h(init);
  GPT<tiny, Mesh<>, TT, Cuda> d(init);
  using Lay = GPT<tiny>::layout;

  // identical initial parameters (same rounding of the same doubles)
  {
    const std::vector<TT> p = d.params_to_host();
    std::vector<TT> want(h.params().size());
    fived::init_params<Lay>(std::span<TT>(want), 0, init);
    REQUIRE(p.size() == want.size());
    CHECK(std::memcmp(p.data(), want.data(), p.size() * sizeof(TT)) == 0);
  }

  // logits (forward without targets)
  h.forward(tok.data(), nullptr, B, T);
  d.forward(tok.data(), nullptr, B, T);
  const std::vector<float> lh(h.logits().begin(), h.logits().end());
  const std::vector<TT> ld = d.logits_to_host();
  CHECK(max_rel_error(ld, lh) < tol);

  // loss
  const double loss_h = h.forward(tok.data(), tgt.data(), B, T);
  const double loss_d = d.forward(tok.data(), tgt.data(), B, T);
  CAPTURE(loss_h);
  CAPTURE(loss_d);
  CHECK(std::fabs(loss_d - loss_h) <= loss_tol * std::fabs(loss_h));
  CHECK(static_cast<float>(d.loss()) == static_cast<float>(loss_d));

  // every gradient tensor
  h.zero_grad();
  d.zero_grad();
  h.backward();
  d.backward();
  const std::vector<float> gh = h.grads_to_host();
  const std::vector<TT> gd = d.grads_to_host();
  for (const ParamInfo& t : Lay::tensors) {
    const double e = max_rel_error(gd, gh, t.offset, t.size());
    CAPTURE(t.name());
    CAPTURE(e);
    CHECK(e < tol);
  }
  // padded vocabulary rows get no gradient
  const ParamInfo& wte = Lay::tensors[static_cast<std::size_t>(*Lay::find("wte.weight"))];
  for (std::size_t i = wte.file_size(); i < wte.size(); ++i) REQUIRE(float(gd[wte.offset + i]) == 0.0f);

  // one AdamW step
  const std::vector<float> p0h = h.params_to_host();
  const std::vector<TT> p0d = d.params_to_host();
  host_step(h);
  cuda_step(d);
  const std::vector<float> p1h = h.params_to_host();
  const std::vector<TT> p1d = d.params_to_host();
  CHECK(max_rel_error(p1d, p1h) < tol);
  double moved = 0;
  for (std::size_t i = 0; i < p1h.size(); ++i) moved = std::max(moved, std::fabs(double(p1h[i]) - double(p0h[i])));
  CHECK(moved > 0.5 * static_cast<double>(lr));  // the step is visible at these bounds
  if constexpr (std::is_same_v<TT, float>) {
    std::vector<float> sh(p1h.size()), sd(p1h.size());
    for (std::size_t i = 0; i < sh.size(); ++i) {
      sh[i] = p1h[i] - p0h[i];
      sd[i] = p1d[i] - p0d[i];
    }
    CHECK(max_rel_error(sd, sh) < 1e-2);
  }
}

}  // namespace

TEST_CASE("CUDA float model = host float model: logits, loss, every gradient, one AdamW step") {
  compare_with_host<float>(1e-4, 1e-5);
}

TEST_CASE("CUDA bf16 model = host float model within bf16 bounds (fp32 master weights)") {
  compare_with_host<bf16>(3e-2, 1e-2);
}

TEST_CASE("enqueue_forward + loss() = forward; gradients accumulate until zero_grad") {
  std::vector<int> tok, tgt;
  batch(tok, tgt, 5);
  GPT<tiny, Mesh<>, float, Cuda> d(init);
  const float l1 = d.forward(tok.data(), tgt.data(), B, T);
  d.zero_grad();
  d.backward();
  const std::vector<float> once = d.grads_to_host();
  d.enqueue_forward(tok.data(), tgt.data(), B, T);
  d.backward();
  CHECK(static_cast<float>(d.loss()) == l1);
  const std::vector<float> twice = d.grads_to_host();
  double e = 0, m = 0;
  for (std::size_t i = 0; i < once.size(); ++i) {
    e = std::max(e, std::fabs(double(twice[i]) - 2.0 * double(once[i])));
    m = std::max(m, std::fabs(double(once[i])));
  }
  CHECK(e <= 1e-6 * m);
  d.zero_grad();
  for (float g : d.grads_to_host()) REQUIRE(g == 0.0f);
  // a smaller batch reuses the buffers
  CHECK(std::isfinite(d.forward(tok.data(), tgt.data(), 1, 7)));
}

TEST_CASE("token ids are checked on the host before they reach the device") {
  std::vector<int> tok, tgt;
  batch(tok, tgt);
  GPT<tiny, Mesh<>, float, Cuda> d(init);
  tok[3] = tiny::vocab;
  CHECK_THROWS_WITH_AS(d.forward(tok.data(), tgt.data(), B, T), doctest::Contains("tokens[3] = 101"),
                       std::invalid_argument);
  batch(tok, tgt);
  tgt[5] = -1;
  CHECK_THROWS_WITH_AS(d.forward(tok.data(), tgt.data(), B, T), doctest::Contains("targets[5] = -1"),
                       std::invalid_argument);
  CHECK_THROWS_AS(d.forward(tok.data(), tgt.data(), B, tiny::max_seq + 1), std::invalid_argument);
}

TEST_CASE("save on CUDA, load on the host (and back): exact, float and bf16, tied and untied") {
  const auto dir = std::filesystem::temp_directory_path();
  auto roundtrip = [&]<class Cfg, class TT>(const char* name) {
    CAPTURE(name);
    const auto path = dir / (std::string("fived_test_gpt_cuda_") + name + ".safetensors");
    GPT<Cfg, Mesh<>, TT, Cuda> d(GptInit{11, 0.05});
    // change the parameters on the device first, so that the file is not just the init
    std::vector<int> tok, tgt;
    batch(tok, tgt);
    d.forward(tok.data(), tgt.data(), B, T);
    d.zero_grad();
    d.backward();
    cuda_step(d);
    d.save(path);
    GPT<Cfg, Mesh<>, TT, Host> h(GptInit{12, 0.05});
    h.load(path);
    const std::vector<TT> pd = d.params_to_host();
    REQUIRE(pd.size() == h.params().size());
    CHECK(std::memcmp(pd.data(), h.params().data(), pd.size() * sizeof(TT)) == 0);
    // and back: host save, CUDA load
    GPT<Cfg, Mesh<>, TT, Cuda> d2(GptInit{13, 0.05});
    h.save(path);
    d2.load(path);
    const std::vector<TT> p2 = d2.params_to_host();
    CHECK(std::memcmp(p2.data(), pd.data(), pd.size() * sizeof(TT)) == 0);
    std::filesystem::remove(path);
  };
  roundtrip.operator()<tiny, float>("float");
  roundtrip.operator()<tiny, bf16>("bf16");
  roundtrip.operator()<tiny_untied, float>("untied_float");
}

// A whole step replayed as a CUDA graph (nn/step_graph.hpp): the first step of a shape runs
// plain, the second is captured (in thread-local mode, where a synchronising call fails the
// capture) and launched, every later one replays it, its uploads (token ids, AdamW's learning
// rate and bias corrections) refilled from the host and nothing queued around the graph.
// Against plain steps over the same batches (a new one each step, two micro-batches) and a
// learning rate that changes every step: the same losses and weights, bit for bit (bf16: the
// masters too); no buffer allocated after the first step; a new batch size captures again.
TEST_CASE_TEMPLATE("steps replayed as a CUDA graph equal plain steps bit for bit", TT, float, bf16) {
  using Model = GPT<tiny, Mesh<>, TT, Cuda>;
  const fived::AdamWConfig hp{.lr = 1e-2, .beta2 = 0.95, .weight_decay = 0.1, .max_norm = 0.05};  // clips
  Model a(init), b(init);
  fived::DataParallel<Model> plain(a, hp, 2), graphed(b, hp, 2);
  graphed.set_step_graph(true);
  std::vector<int> tok, tgt, t2, g2;
  auto both = [&](int s, int rows) {
    CAPTURE(s);
    batch(tok, tgt, static_cast<unsigned>(2 * s)), batch(t2, g2, static_cast<unsigned>(2 * s + 1));
    tok.insert(tok.end(), t2.begin(), t2.end()), tgt.insert(tgt.end(), g2.begin(), g2.end());  // two micro-batches
    if (rows < B) tok.resize(static_cast<std::size_t>(2 * rows * T)), tgt.resize(tok.size());
    plain.optimizer().hp.lr = graphed.optimizer().hp.lr = 1e-2 / s;
    CHECK(plain.step(tok, tgt, rows, T) == graphed.step(tok, tgt, rows, T));
  };
  both(1, B);
  const std::size_t allocations = fived::buffer_allocations<Cuda>().load();
  for (int s = 2; s <= 5; ++s) {
    both(s, B);
    CHECK(b.ops().step_graph_captured());
  }
  CHECK(fived::buffer_allocations<Cuda>().load() == allocations);
  CHECK(plain.last_clip() < 1.0);  // clipped: the factor came from the device's norm
  CHECK(plain.grad_norm() == graphed.grad_norm());
  auto same = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  CHECK(same(a.params_to_host(), b.params_to_host()));
  if constexpr (fived::AdamWFor<Model>::has_master)
    CHECK(same(a.ops().to_host(plain.optimizer().master()), b.ops().to_host(graphed.optimizer().master())));
  CHECK(plain.optimizer().step_count() == graphed.optimizer().step_count());
  both(6, 1);  // a new shape: plain, then captured again
  CHECK_FALSE(b.ops().step_graph_captured());
  both(7, 1);
  both(8, 1);
  CHECK(b.ops().step_graph_captured());
  CHECK(same(a.params_to_host(), b.params_to_host()));
}

int main(int argc, char** argv) {
  if (fived::test::gpu_count() == 0) {
    std::puts("test_gpt_cuda: no CUDA device, skipping");
    return fived::test::skip_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
