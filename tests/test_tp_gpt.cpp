// The one GPT on Mesh<TP<N>> against the same model on Mesh<> (the serial model) on the
// host backend, for Mesh<TP<2>> and Mesh<TP<4>>, each with and without sequence
// parallelism, in fp32 and fp64, from the same (perturbed) weights:
//  - the logits (gathered over TP) and the loss;
//  - every parameter gradient (gathered into the serial layout), per tensor;
//  - every weight after one clipped AdamW step with weight decay, and the loss
//    of a second step;
// each within 1e-5 relative in fp32 and 1e-9 in fp64 (max |tp - serial| /
// max |serial| per tensor; see Precision for AdamW's eps).
// A Counting communicator checks the model's collectives per step against
// Megatron's counts (per block: 2 all-reduces each way without SP; 2
// all-gathers + 2 reduce-scatters each way with SP), and zero collectives for
// Mesh<>. bf16 under TP tracks the bf16 serial run. The safetensors file a TP
// model saves is the serial model's file, and loads back into either.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/place/redistribute.hpp"
#include "fived/train/data_parallel.hpp"
#include "support/compare.hpp"

using namespace fived;
using fived::test::max_rel_error;

namespace {

// vocab 61 is padded to 64 (a multiple of TP 4); 4 heads split over TP 2 and 4.
struct tiny : gpt_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, vocab = 61, max_seq = 16, vocab_multiple = 8;
};
struct tiny_untied : tiny {
  static constexpr bool tied = false;
};

constexpr int kB = 2, kT = 8;

// Precision, tolerance and AdamW's eps. One AdamW step moves an element by
// about lr * g / (|g| + eps), so a rounding error δ in g moves it by up to
// lr * δ / eps where |g| is near zero; a gradient that is zero in exact
// arithmetic (the key bias: softmax ignores it) moves by ±lr on the sign of
// its rounding. fp32 gradients carry δ ≈ 1e-9 here, so the fp32 run uses
// eps = 1e-3 (lr * δ / eps ≈ 1e-8); the fp64 run uses the default eps = 1e-8
// (δ ≈ 1e-18) and checks everything to 1e-9.
template <class T>
struct Precision;
template <>
struct Precision<float> {
  static constexpr double tol = 1e-5;
  static constexpr float eps = 1e-3f;
  static constexpr const char* name = "fp32";
};
template <>
struct Precision<double> {
  static constexpr double tol = 1e-9;
  static constexpr float eps = 1e-8f;
  static constexpr const char* name = "fp64";
};
template <class T>
AdamWConfig hparams() {
  return {.lr = 1e-2f, .eps = Precision<T>::eps, .weight_decay = 0.1f, .max_norm = 0.5f};
}

std::vector<int> ids(int n, unsigned seed, int vocab) {
  std::vector<int> v(static_cast<std::size_t>(n));
  unsigned s = seed;
  for (int& e : v) e = static_cast<int>((s = s * 1103515245u + 12345u) >> 16) % vocab;
  return v;
}

// Adds 0.1 * (±[0.1, 1)) to every parameter, so no tensor is zero (GPT-2
// starts its biases at 0): a tensor that starts at zero holds only lr-sized
// AdamW updates after one step, and comparing those relative to their own size
// measures AdamW's sensitivity to gradient rounding, not the model.
template <class T>
void perturb(std::span<T> p) {
  const auto r = test::random_values<T>(p.size(), 17);
  for (std::size_t i = 0; i < p.size(); ++i) p[i] += T(0.1) * r[i];
}

// What the serial model gives; the TP ranks are compared with it.
template <class T>
struct Serial {
  std::vector<T> params_before, logits, grads, params_after;
  double loss = 0, loss2 = 0, clip = 0;
};

template <class Cfg, class T>
Serial<T> serial_run(const std::vector<int>& tok, const std::vector<int>& tgt) {
  Serial<T> s;
  GPT<Cfg, Mesh<>, T> m(GptInit{.seed = 7});
  DataParallel<GPT<Cfg, Mesh<>, T>> opt(m, hparams<T>());
  perturb(m.params());
  s.params_before = m.params_to_host();
  m.forward(tok.data(), nullptr, kB, kT);
  s.logits.assign(m.logits().begin(), m.logits().end());
  m.zero_grad();
  m.forward(tok.data(), tgt.data(), kB, kT);
  s.loss = m.loss();
  m.backward();
  s.grads = m.grads_to_host();
  s.clip = opt.apply_gradients();
  s.params_after = m.params_to_host();
  m.forward(tok.data(), tgt.data(), kB, kT);
  s.loss2 = m.loss();
  return s;
}

// Worst per-tensor error of a serial-layout buffer against the reference; names the tensor.
template <class Layout, class T>
std::pair<double, std::string> worst_tensor(const std::vector<T>& got, const std::vector<T>& ref) {
  std::pair<double, std::string> w{0.0, ""};
  if (got.size() != ref.size()) return {INFINITY, "size"};
  for (const ParamInfo& t : Layout::tensors) {
    const double e = max_rel_error(got, ref, t.offset, t.size());
    if (!(e <= w.first)) w = {e, t.name()};
  }
  return w;
}

struct RankResult {
  double err_logits = INFINITY, err_loss = INFINITY, err_loss2 = INFINITY, err_clip = INFINITY;
  std::pair<double, std::string> err_grads{INFINITY, ""}, err_params{INFINITY, ""};
  CommCounts fwd, bwd;
};

// This rank's logits [B*T, Vp/TP] gathered over TP into [B*T, Vp].
template <class M, class Comm, class T>
std::vector<T> gathered_logits(std::span<const T> local, int vp, const Coord& coord, Comm& tp) {
  using L = ShardLayout<M, 2, Placements<On<Axis::tp, Shard<1>>>>;
  const Sharded<T, L> piece(L({kB * kT, vp}, coord), std::vector<T>(local.begin(), local.end()));
  return redistribute<Axis::tp, Replicate>(piece, tp).storage();
}

template <class Cfg, int N, class SP, class T>
void tp_case() {
  using M = Mesh<TP<N>>;
  using Model = GPT<Cfg, M, T, Host, SP>;
  using Lay = typename Model::layout;
  constexpr double kTol = Precision<T>::tol;
  constexpr int L = Cfg::layers;
  const auto tok = ids(kB * kT, 1, Cfg::vocab), tgt = ids(kB * kT, 2, Cfg::vocab);
  const Serial<T> ref = serial_run<Cfg, T>(tok, tgt);
  std::vector<RankResult> rs(N);
  host::run(N, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(Counting<host::Comm>(world));
    auto& tp = ctx.template comm<Axis::tp>();
    RankResult& r = rs[static_cast<std::size_t>(ctx.rank())];
    Model m(ctx);
    Lay::slice(std::span<const T>(ref.params_before), m.params(), ctx.coord().tp);  // this rank's piece
    m.forward(tok.data(), nullptr, kB, kT);
    r.err_logits = max_rel_error(gathered_logits<M>(m.logits(), Model::Vp, ctx.coord(), tp), ref.logits);
    m.zero_grad();
    const CommCounts c0 = tp.counts();
    m.forward(tok.data(), tgt.data(), kB, kT);
    const double loss = m.loss();
    const CommCounts c1 = tp.counts();
    m.backward();
    const CommCounts c2 = tp.counts();
    r.fwd = c1 - c0;
    r.bwd = c2 - c1;
    r.err_loss = std::abs(loss - ref.loss) / std::abs(ref.loss);
    r.err_grads = worst_tensor<typename Model::serial_layout>(m.gather_grads(), ref.grads);
    DataParallel<Model> opt(m, hparams<T>());  // one replica: the clip sums over TP, counting each parameter once
    r.err_clip = std::abs(opt.apply_gradients() - ref.clip) / ref.clip;
    r.err_params = worst_tensor<typename Model::serial_layout>(m.gather_params(), ref.params_after);
    m.forward(tok.data(), tgt.data(), kB, kT);
    r.err_loss2 = std::abs(m.loss() - ref.loss2) / std::abs(ref.loss2);
  });

  // Megatron's counts: embedding, L blocks (2 per block each way), head, the
  // loss's 3 all-reduces of [B*T] statistics; with SP also the all-reduce of the
  // LayerNorms' partial gradients, once per unit that has them (each block and
  // ln_f), so a trainer may reduce a unit as soon as it is done.
  const bool sp = SP::enabled;
  const int block = 2 * L;
  const std::int64_t fwd_ar = sp ? 3 : 1 + block + 3, fwd_rs = sp ? 1 + block : 0, fwd_ag = sp ? block + 1 : 0;
  const std::int64_t bwd_ar = sp ? L + 1 : 1 + block, bwd_rs = sp ? 1 + block : 0, bwd_ag = sp ? block + 1 : 0;
  const std::string what =
      std::string(M::name()) + (sp ? " SP" : "") + (Cfg::tied ? "" : " untied") + " " + Precision<T>::name;
  for (int r = 0; r < N; ++r) {
    INFO(what << " rank " << r);
    const RankResult& x = rs[static_cast<std::size_t>(r)];
    CHECK(x.err_logits <= kTol);
    CHECK(x.err_loss <= kTol);
    INFO("worst gradient " << x.err_grads.second << ", worst weight " << x.err_params.second);
    CHECK(x.err_grads.first <= kTol);
    CHECK(x.err_clip <= kTol);
    CHECK(x.err_params.first <= kTol);
    CHECK(x.err_loss2 <= kTol);
    CHECK(x.fwd.all_reduce.calls == fwd_ar);
    CHECK(x.fwd.reduce_scatter.calls == fwd_rs);
    CHECK(x.fwd.all_gather.calls == fwd_ag);
    CHECK(x.bwd.all_reduce.calls == bwd_ar);
    CHECK(x.bwd.reduce_scatter.calls == bwd_rs);
    CHECK(x.bwd.all_gather.calls == bwd_ag);
    CHECK(x.fwd.total_calls() == fwd_ar + fwd_rs + fwd_ag);
    CHECK(x.bwd.total_calls() == bwd_ar + bwd_rs + bwd_ag);
  }
  const RankResult& x = rs[0];
  std::printf("%-24s logits %.1e  loss %.1e  grads %.1e (%s)  clip %.1e  weights %.1e (%s)  loss2 %.1e\n",
              what.c_str(), x.err_logits, x.err_loss, x.err_grads.first, x.err_grads.second.c_str(), x.err_clip,
              x.err_params.first, x.err_params.second.c_str(), x.err_loss2);
  CHECK(ref.clip < 1.0);  // the clipping path was taken
}

}  // namespace

TEST_CASE("TP<2> GPT equals serial") {
  tp_case<tiny, 2, NoSequenceParallel, float>();
  tp_case<tiny, 2, NoSequenceParallel, double>();
}
TEST_CASE("TP<2> GPT with sequence parallelism equals serial") {
  tp_case<tiny, 2, SequenceParallel, float>();
  tp_case<tiny, 2, SequenceParallel, double>();
}
TEST_CASE("TP<4> GPT equals serial") {
  tp_case<tiny, 4, NoSequenceParallel, float>();
  tp_case<tiny, 4, NoSequenceParallel, double>();
}
TEST_CASE("TP<4> GPT with sequence parallelism equals serial") {
  tp_case<tiny, 4, SequenceParallel, float>();
  tp_case<tiny, 4, SequenceParallel, double>();
}
TEST_CASE("TP<2> untied GPT with sequence parallelism equals serial") {
  tp_case<tiny_untied, 2, SequenceParallel, float>();
}

TEST_CASE("Mesh<> issues no collective at all; a TP model is initialised as the serial one, exactly") {
  // GPT<cfg, Mesh<>> built on a (counting) one-rank mesh context: forward and backward issue nothing.
  host::run(1, [](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<>>(Counting<host::Comm>(world));
    GPT<tiny> m(ctx, GptInit{.seed = 3});
    const auto tok = ids(kB * kT, 1, tiny::vocab);
    m.forward(tok.data(), tok.data(), kB, kT);
    m.backward();
    CHECK(ctx.world().counts().total_calls() == 0);
    CHECK(ctx.comm<Axis::tp>().counts().total_calls() == 0);
  });
  const std::vector<float> want = GPT<tiny>(GptInit{.seed = 3}).params_to_host();
  std::vector<std::vector<float>> got(4);
  host::run(4, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<TP<4>>>(world);
    GPT<tiny, Mesh<TP<4>>> m(ctx, GptInit{.seed = 3});
    got[static_cast<std::size_t>(ctx.rank())] = m.gather_params();
  });
  for (const auto& g : got) CHECK(g == want);
}

TEST_CASE("the TP table slices and assembles the serial buffer element for element") {
  using Lay = ParamTable<GptSpecs<tiny>, 4>;
  using Serial = ParamTable<GptSpecs<tiny>, 1>;
  std::vector<float> serial(Serial::size), pieces(Lay::size * 4), back(Serial::size, -1.0f);
  for (std::size_t i = 0; i < serial.size(); ++i) serial[i] = static_cast<float>(i);
  for (int r = 0; r < 4; ++r)
    Lay::slice(std::span<const float>(serial), std::span<float>(pieces).subspan(Lay::size * r, Lay::size), r);
  Lay::assemble(std::span<const float>(pieces), std::span<float>(back));
  CHECK(back == serial);
  // Rank 1's c_attn piece is the [q|k|v] of head 1: columns [8,16), [40,48), [72,80) of [32, 96].
  const int i = *Lay::find("h.0.attn.c_attn.weight");
  CHECK(Lay::tensors[static_cast<std::size_t>(i)].cols == 24);
  CHECK(Lay::global_index(i, 1, 0) == 8);
  CHECK(Lay::global_index(i, 1, 8) == 40);
  CHECK(Lay::global_index(i, 1, 16) == 72);
  CHECK(Lay::global_index(i, 1, 24) == 96 + 8);
  // The clip counts a replicated tensor on TP rank 0 only, a split one on every rank.
  const int ln = *Lay::find("h.0.ln_1.weight");
  CHECK(Lay::counted_once(ln, 0));
  CHECK_FALSE(Lay::counted_once(ln, 1));
  CHECK(Lay::counted_once(i, 3));
}

TEST_CASE("sequence parallelism refuses a token count TP does not divide, naming the fix") {
  host::run(2, [](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<TP<2>>>(world);
    GPT<tiny, Mesh<TP<2>>, float, Host, SequenceParallel> m(ctx);
    const auto tok = ids(7, 3, tiny::vocab);
    try {
      m.forward(tok.data(), tok.data(), 1, 7);
      throw std::runtime_error("no exception");
    } catch (const std::invalid_argument& e) {
      if (std::string(e.what()).find("multiple of TP") == std::string::npos) throw;
    }
  });
}

TEST_CASE("bf16 under TP with SP tracks the bf16 serial model (fp32 masters)") {
  using M = Mesh<TP<2>>;
  const auto tok = ids(kB * kT, 1, tiny::vocab), tgt = ids(kB * kT, 2, tiny::vocab);
  const AdamWConfig hp{.lr = 1e-2f, .weight_decay = 0.1f, .max_norm = 0.5f};
  GPT<tiny, Mesh<>, bf16> serial(GptInit{.seed = 5});
  DataParallel<GPT<tiny, Mesh<>, bf16>> serial_opt(serial, hp);
  std::vector<double> want;
  for (int step = 0; step < 3; ++step) want.push_back(serial_opt.step(tok, tgt, kB, kT));
  const std::vector<bf16> want_params = serial.params_to_host();
  std::vector<std::vector<double>> got(2);
  std::vector<double> err(2);
  host::run(2, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    GPT<tiny, M, bf16, Host, SequenceParallel> m(ctx, GptInit{.seed = 5});
    DataParallel<decltype(m)> opt(m, hp);
    for (int step = 0; step < 3; ++step) got[static_cast<std::size_t>(ctx.rank())].push_back(opt.step(tok, tgt, kB, kT));
    err[static_cast<std::size_t>(ctx.rank())] = max_rel_error(m.gather_params(), want_params);
  });
  MESSAGE("bf16 TP<2> SP: losses " << got[0][0] << " " << got[0][1] << " " << got[0][2] << " vs serial " << want[0]
                                   << " " << want[1] << " " << want[2] << "; weights max error " << err[0]);
  for (int r = 0; r < 2; ++r) {
    for (int step = 0; step < 3; ++step)
      CHECK(got[static_cast<std::size_t>(r)][static_cast<std::size_t>(step)] ==
            doctest::Approx(want[static_cast<std::size_t>(step)]).epsilon(2e-3));
    // An element whose tiny gradient changes sign under bf16 rounding moves by an lr-sized
    // AdamW update the other way: up to 3 steps x lr 1e-2 against weights of size ~1.
    CHECK(err[static_cast<std::size_t>(r)] <= 5e-2);
  }
}

TEST_CASE("a TP model saves the serial model's safetensors file and loads it back") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fived_tp_gpt_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  GPT<tiny> serial(GptInit{.seed = 11});
  serial.save(dir / "serial.safetensors");
  const std::vector<float> want = serial.params_to_host();
  std::vector<std::vector<float>> loaded(4);
  host::run(4, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<TP<4>>>(world);
    GPT<tiny, Mesh<TP<4>>, float, Host, SequenceParallel> m(ctx, GptInit{.seed = 99});
    m.load(dir / "serial.safetensors");  // slice on load
    loaded[static_cast<std::size_t>(ctx.rank())] = m.gather_params();
    m.save(dir / "tp.safetensors");  // gather on save
  });
  GPT<tiny> back(GptInit{.seed = 5});
  back.load(dir / "tp.safetensors");
  for (const auto& l : loaded) CHECK(l == want);
  CHECK(back.params_to_host() == want);
  fs::remove_all(dir);
}
