#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

// Host reference kernels (include/fived/kernels/host/): every backward against
// central finite differences in double, every forward against a closed form or a
// naive formula written out here, the vocab-shard cross-entropy against the
// single-shard call, AdamW against a hand-computed update, and float / bf16 runs
// against double on the same (rounded) inputs.
//
// Error measure, unless a check says otherwise: relative error of a tensor =
// max_i |x_i - ref_i| / max_i |ref_i|. Bounds: double vs finite differences 1e-6
// (h = 1e-5: truncation ~h^2, cancellation ~1e-16/h, both far below), double vs
// closed form 1e-12, float vs double 1e-5, bf16 vs double 2e-2 (bf16 keeps 8
// significant bits; outputs are rounded once, accumulation is in float).
// Inputs are random in +-[0.1, 1] (never zero) from fixed seeds.

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <vector>

#include "fived/kernels/host.hpp"
#include "fived/optim/adamw.hpp"
#include "support/compare.hpp"

namespace {

using fived::bf16;
namespace k = fived::kernels::host;
using Vec = std::vector<double>;

constexpr double fd_bound = 1e-6;
constexpr double exact_bound = 1e-12;

Vec random_vec(std::size_t n, unsigned seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> mag(0.1, 1.0);
  std::bernoulli_distribution sign(0.5);
  Vec v(n);
  for (auto& x : v) x = scale * (sign(rng) ? mag(rng) : -mag(rng));
  return v;
}

template <class T>
std::vector<T> to(const Vec& v) {
  std::vector<T> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<T>(static_cast<fived::acc_t<T>>(v[i]));
  return r;
}
template <class T>
Vec from(const std::vector<T>& v) {
  Vec r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<double>(static_cast<fived::acc_t<T>>(v[i]));
  return r;
}
// The double values a T tensor would hold: so precision runs compare kernels, not input rounding.
template <class T>
Vec rounded(const Vec& v) {
  return from(to<T>(v));
}

using fived::test::max_rel_error;

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of loss() with respect to every element of x, against analytic.
double fd_error(Vec& x, const Vec& analytic, const std::function<double()>& loss, double h = 1e-5) {
  Vec numeric(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double save = x[i];
    x[i] = save + h;
    const double lp = loss();
    x[i] = save - h;
    const double lm = loss();
    x[i] = save;
    numeric[i] = (lp - lm) / (2 * h);
  }
  return max_rel_error(analytic, numeric);
}

double gelu_ref(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x))); }

// ---------------------------------------------------------------- matmul

struct Dims {
  int M, N, K;
  bool ta, tb;
};

Vec naive_matmul(const Vec& a, const Vec& b, const Vec* bias, const Dims& d) {
  Vec out(static_cast<std::size_t>(d.M) * d.N);
  for (int i = 0; i < d.M; ++i)
    for (int j = 0; j < d.N; ++j) {
      double s = bias ? (*bias)[j] : 0.0;
      for (int kk = 0; kk < d.K; ++kk) {
        const double av = d.ta ? a[static_cast<std::size_t>(kk) * d.M + i] : a[static_cast<std::size_t>(i) * d.K + kk];
        const double bv = d.tb ? b[static_cast<std::size_t>(j) * d.K + kk] : b[static_cast<std::size_t>(kk) * d.N + j];
        s += av * bv;
      }
      out[static_cast<std::size_t>(i) * d.N + j] = s;
    }
  return out;
}

template <class T>
Vec run_matmul(const Vec& a, const Vec& b, const Vec* bias, const Dims& d, const Vec* prefill = nullptr,
               k::Epilogue ep = k::Epilogue::none, Vec* pre_act = nullptr) {
  auto ta = to<T>(a), tb = to<T>(b);
  std::vector<T> tbias = bias ? to<T>(*bias) : std::vector<T>{};
  std::vector<T> out = prefill ? to<T>(*prefill) : std::vector<T>(static_cast<std::size_t>(d.M) * d.N);
  std::vector<T> pre(out.size());
  k::matmul(out.data(), ta.data(), tb.data(), bias ? tbias.data() : nullptr, d.M, d.N, d.K, d.ta, d.tb,
            prefill != nullptr, ep, ep == k::Epilogue::gelu ? pre.data() : nullptr);
  if (pre_act) *pre_act = from(pre);
  return from(out);
}

// Gradients of L = <dout, op(a) op(b) + bias> computed with matmul itself, as a linear
// layer's backward does (accumulate = true into pre-filled gradients, which are then
// subtracted again: this also checks "+=").
struct MatmulGrads {
  Vec da, db, dbias;
};
MatmulGrads matmul_grads(const Vec& a, const Vec& b, const Vec& dout, const Dims& d) {
  const std::size_t na = a.size(), nb = b.size(), nn = static_cast<std::size_t>(d.N);
  Vec pa = random_vec(na, 901), pb = random_vec(nb, 902), pbias = random_vec(nn, 903);
  Vec da = pa, db = pb, dbias = pbias;
  if (!d.ta)  // da [M,K] = dout [M,N] * op(b)^T
    k::matmul(da.data(), dout.data(), b.data(), nullptr, d.M, d.K, d.N, false, !d.tb, true);
  else  // da [K,M] = op(b) [K,N] * dout^T
    k::matmul(da.data(), b.data(), dout.data(), nullptr, d.K, d.M, d.N, d.tb, true, true);
  if (!d.tb)  // db [K,N] = op(a)^T * dout
    k::matmul(db.data(), a.data(), dout.data(), nullptr, d.K, d.N, d.M, !d.ta, false, true);
  else  // db [N,K] = dout^T * op(a)
    k::matmul(db.data(), dout.data(), a.data(), nullptr, d.N, d.K, d.M, true, d.ta, true);
  k::bias_backward(dbias.data(), dout.data(), d.M, d.N);
  for (std::size_t i = 0; i < na; ++i) da[i] -= pa[i];
  for (std::size_t i = 0; i < nb; ++i) db[i] -= pb[i];
  for (std::size_t i = 0; i < nn; ++i) dbias[i] -= pbias[i];
  return {da, db, dbias};
}

const Dims all_transposes[] = {{5, 7, 6, false, false}, {5, 7, 6, true, false}, {5, 7, 6, false, true},
                               {5, 7, 6, true, true}};

}  // namespace

TEST_CASE("matmul forward: all four transposes, bias, accumulate, gelu epilogue, across tile boundaries") {
  // 70 x 300 x 140 crosses the 64-row, 256-column and 128-deep tiles (and the 4-row remainder).
  for (Dims d : {Dims{70, 300, 140, false, false}, Dims{70, 300, 140, true, false}, Dims{70, 300, 140, false, true},
                 Dims{70, 300, 140, true, true}, Dims{3, 5, 1, false, true}}) {
    CAPTURE(d.M);
    CAPTURE(d.ta);
    CAPTURE(d.tb);
    const Vec a = random_vec(static_cast<std::size_t>(d.M) * d.K, 1), b = random_vec(static_cast<std::size_t>(d.K) * d.N, 2);
    const Vec bias = random_vec(static_cast<std::size_t>(d.N), 3);
    const Vec ref = naive_matmul(a, b, &bias, d);
    CHECK(max_rel_error(run_matmul<double>(a, b, &bias, d), ref) < exact_bound);
    CHECK(max_rel_error(run_matmul<double>(a, b, nullptr, d), naive_matmul(a, b, nullptr, d)) < exact_bound);
    // accumulate: out = prefill + product + bias
    const Vec prefill = random_vec(ref.size(), 4);
    Vec acc_ref = ref;
    for (std::size_t i = 0; i < ref.size(); ++i) acc_ref[i] += prefill[i];
    CHECK(max_rel_error(run_matmul<double>(a, b, &bias, d, &prefill), acc_ref) < exact_bound);
    // gelu epilogue: pre_act = product + bias, out = gelu(pre_act)
    Vec pre;
    const Vec g = run_matmul<double>(a, b, &bias, d, nullptr, k::Epilogue::gelu, &pre);
    Vec gref(ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i) gref[i] = gelu_ref(ref[i]);
    CHECK(max_rel_error(pre, ref) < exact_bound);
    CHECK(max_rel_error(g, gref) < exact_bound);
  }
}

TEST_CASE("matmul in float: the same bits as a plain loop adding k by k, whichever register tile the CPU runs") {
  // N 40 is five strips of 8 columns: on an AVX CPU two pairs go through the wide tile and the
  // fifth through the 16-byte one, so both meet one plain loop here. 300 x 140 crosses the
  // tiles as above (the last column tile is 44 wide: six strips).
  for (Dims d : {Dims{9, 40, 130, false, false}, Dims{9, 40, 130, true, true}, Dims{70, 300, 140, false, true},
                 Dims{70, 300, 140, true, false}}) {
    CAPTURE(d.N);
    CAPTURE(d.ta);
    CAPTURE(d.tb);
    const auto a = to<float>(random_vec(static_cast<std::size_t>(d.M) * d.K, 5));
    const auto b = to<float>(random_vec(static_cast<std::size_t>(d.K) * d.N, 6));
    const auto bias = to<float>(random_vec(static_cast<std::size_t>(d.N), 7));
    std::vector<float> out(static_cast<std::size_t>(d.M) * d.N);
    k::matmul(out.data(), a.data(), b.data(), bias.data(), d.M, d.N, d.K, d.ta, d.tb);
    std::size_t differ = 0;
    for (int i = 0; i < d.M; ++i)
      for (int j = 0; j < d.N; ++j) {
        float s = 0;
        for (int kk = 0; kk < d.K; ++kk)
          s += (d.ta ? a[static_cast<std::size_t>(kk) * d.M + i] : a[static_cast<std::size_t>(i) * d.K + kk]) *
               (d.tb ? b[static_cast<std::size_t>(j) * d.K + kk] : b[static_cast<std::size_t>(kk) * d.N + j]);
        s += bias[static_cast<std::size_t>(j)];
        differ += std::bit_cast<std::uint32_t>(s) != std::bit_cast<std::uint32_t>(out[static_cast<std::size_t>(i) * d.N + j]);
      }
    CHECK(differ == 0);
  }
}

TEST_CASE("matmul: K = 0 gives the bias; impossible arguments throw") {
  Dims d{2, 3, 0, false, false};
  const Vec bias = random_vec(3, 5);
  const Vec out = run_matmul<double>({}, {}, &bias, d);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) CHECK(out[static_cast<std::size_t>(i) * 3 + j] == bias[static_cast<std::size_t>(j)]);
  std::vector<double> o(4), a(4), b(4), pre(4);
  CHECK_THROWS_AS(k::matmul(o.data(), a.data(), b.data(), (const double*)nullptr, 2, 2, 2, false, false, true,
                            k::Epilogue::gelu, pre.data()),
                  std::invalid_argument);
  CHECK_THROWS_AS(k::matmul(o.data(), a.data(), b.data(), (const double*)nullptr, 2, 2, 2, false, false, false,
                            k::Epilogue::gelu, (double*)nullptr),
                  std::invalid_argument);
  CHECK_THROWS_AS(k::matmul(o.data(), a.data(), b.data(), (const double*)nullptr, -1, 2, 2, false, false),
                  std::invalid_argument);
}

TEST_CASE("a strided batch of GEMMs is its products one by one, the gaps between them untouched") {
  // Three products a stride apart (padded experts' GEMMs, nn/moe.hpp): every operand of
  // product i is found i strides on, a null bias stays null, and nothing between them is
  // written. Bit for bit the single calls, for matmul (bias, GELU), matmul_dgelu and
  // matmul_weight_grad (both layouts).
  constexpr std::int64_t count = 3, gap = 5;
  const int M = 7, N = 9, K = 6;
  const std::int64_t sa = M * K + gap, sb = K * N + gap, so = M * N + gap, sbias = N + gap, sw = K * N + gap;
  const Vec a = random_vec(count * sa, 70), b = random_vec(count * sb, 71), bias = random_vec(count * sbias, 72);
  const Vec init = random_vec(count * so, 73), pre0 = random_vec(count * so, 74);
  const double* none = nullptr;
  for (const bool with_bias : {false, true}) {
    CAPTURE(with_bias);
    Vec out = init, pre = pre0, one = init, one_pre = pre0;
    k::matmul(out.data(), a.data(), b.data(), with_bias ? bias.data() : none, M, N, K, false, true, false,
              k::Epilogue::gelu, pre.data(), {.count = count, .out = so, .a = sa, .b = sb, .bias = sbias, .pre_act = so});
    for (std::int64_t i = 0; i < count; ++i)
      k::matmul(one.data() + i * so, a.data() + i * sa, b.data() + i * sb, with_bias ? bias.data() + i * sbias : none, M,
                N, K, false, true, false, k::Epilogue::gelu, one_pre.data() + i * so);
    CHECK(out == one);
    CHECK(pre == one_pre);
  }
  {
    Vec out = init, one = init;
    k::matmul_dgelu(out.data(), a.data(), b.data(), pre0.data(), M, N, K, false, true,
                    {.count = count, .out = so, .a = sa, .b = sb, .pre_act = so});
    for (std::int64_t i = 0; i < count; ++i)
      k::matmul_dgelu(one.data() + i * so, a.data() + i * sa, b.data() + i * sb, pre0.data() + i * so, M, N, K, false,
                      true);
    CHECK(out == one);
  }
  for (const bool transposed : {false, true}) {  // dW [K, N] += x^T dy over M rows, db += dy's sums
    CAPTURE(transposed);
    const Vec dy = random_vec(count * so, 75);
    Vec dw = random_vec(count * sw, 76), db = random_vec(count * sbias, 77), one_dw = dw, one_db = db;
    k::matmul_weight_grad(dw.data(), db.data(), dy.data(), a.data(), M, K, N, transposed,
                          {.count = count, .dw = sw, .db = sbias, .dy = so, .x = sa});
    for (std::int64_t i = 0; i < count; ++i)
      k::matmul_weight_grad(one_dw.data() + i * sw, one_db.data() + i * sbias, dy.data() + i * so, a.data() + i * sa, M,
                            K, N, transposed);
    CHECK(dw == one_dw);
    CHECK(db == one_db);
    CHECK(dw != random_vec(count * sw, 76));  // it added something
  }
  Vec o(4);
  CHECK_THROWS_AS(k::matmul(o.data(), o.data(), o.data(), none, 2, 2, 1, false, false, false, k::Epilogue::none,
                            static_cast<double*>(nullptr), {.count = 0}),
                  std::invalid_argument);
}

TEST_CASE("matmul backward (da, db, dbias via matmul + bias_backward) against finite differences, all transposes") {
  for (const Dims& d : all_transposes) {
    CAPTURE(d.ta);
    CAPTURE(d.tb);
    Vec a = random_vec(static_cast<std::size_t>(d.M) * d.K, 11), b = random_vec(static_cast<std::size_t>(d.K) * d.N, 12);
    Vec bias = random_vec(static_cast<std::size_t>(d.N), 13);
    const Vec dout = random_vec(static_cast<std::size_t>(d.M) * d.N, 14);
    auto loss = [&] { return dot(dout, run_matmul<double>(a, b, &bias, d)); };
    const MatmulGrads g = matmul_grads(a, b, dout, d);
    CHECK(fd_error(a, g.da, loss) < fd_bound);
    CHECK(fd_error(b, g.db, loss) < fd_bound);
    CHECK(fd_error(bias, g.dbias, loss) < fd_bound);
  }
}

TEST_CASE("matmul with the gelu epilogue: backward through gelu_backward(pre_act) against finite differences") {
  for (const Dims& d : all_transposes) {
    CAPTURE(d.ta);
    CAPTURE(d.tb);
    Vec a = random_vec(static_cast<std::size_t>(d.M) * d.K, 21), b = random_vec(static_cast<std::size_t>(d.K) * d.N, 22);
    Vec bias = random_vec(static_cast<std::size_t>(d.N), 23);
    const Vec dout = random_vec(static_cast<std::size_t>(d.M) * d.N, 24);
    auto loss = [&] { return dot(dout, run_matmul<double>(a, b, &bias, d, nullptr, k::Epilogue::gelu, nullptr)); };
    Vec pre;
    run_matmul<double>(a, b, &bias, d, nullptr, k::Epilogue::gelu, &pre);
    Vec dpre = dout;
    k::gelu_backward(dpre.data(), pre.data(), dpre.data(), dpre.size());  // in place (dinp aliases dout)
    const MatmulGrads g = matmul_grads(a, b, dpre, d);
    CHECK(fd_error(a, g.da, loss) < fd_bound);
    CHECK(fd_error(b, g.db, loss) < fd_bound);
    CHECK(fd_error(bias, g.dbias, loss) < fd_bound);
  }
}

TEST_CASE("matmul_dgelu: the gradient at a GELU's input from the GEMM after it, against finite differences") {
  // loss(pre) = <dout, gelu(pre) op(w)>, pre [M, F], op(w) [F, C]: d loss / d pre is
  // gelu'(pre) * dout op(w)^T = matmul_dgelu(dout, w, pre) with w's transpose flipped.
  const int M = 5, F = 7, C = 6;
  for (const bool stored_transposed : {false, true}) {  // w stored [F, C] (Conv1D) or [C, F] (torch.nn.Linear)
    CAPTURE(stored_transposed);
    Vec pre = random_vec(static_cast<std::size_t>(M) * F, 25, 2.0), w = random_vec(static_cast<std::size_t>(F) * C, 26);
    const Vec dout = random_vec(static_cast<std::size_t>(M) * C, 27);
    auto loss = [&] {
      Vec h(pre.size()), y(static_cast<std::size_t>(M) * C);
      k::gelu_forward(h.data(), pre.data(), h.size());
      k::matmul(y.data(), h.data(), w.data(), static_cast<const double*>(nullptr), M, C, F, false, stored_transposed);
      return dot(dout, y);
    };
    Vec dpre(pre.size());
    k::matmul_dgelu(dpre.data(), dout.data(), w.data(), pre.data(), M, F, C, false, !stored_transposed);
    CHECK(fd_error(pre, dpre, loss) < fd_bound);
  }
  Vec o(4);
  CHECK_THROWS_AS(k::matmul_dgelu(o.data(), o.data(), o.data(), static_cast<const double*>(nullptr), 2, 2, 1, false,
                                  false),
                  std::invalid_argument);
}

// ---------------------------------------------------------------- gelu, residual

TEST_CASE("gelu forward against the tanh formula, backward against finite differences; dinp may alias dout") {
  Vec x = random_vec(50, 31, 3.0);
  const Vec dout = random_vec(50, 32);
  Vec y(50), ref(50);
  k::gelu_forward(y.data(), x.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) ref[i] = gelu_ref(x[i]);
  CHECK(max_rel_error(y, ref) < exact_bound);
  Vec dx(50, 7.0);  // "=": the pre-filled value must disappear
  k::gelu_backward(dx.data(), x.data(), dout.data(), x.size());
  Vec inplace = dout;
  k::gelu_backward(inplace.data(), x.data(), inplace.data(), x.size());
  CHECK(max_rel_error(inplace, dx) == 0.0);
  auto loss = [&] {
    Vec o(x.size());
    k::gelu_forward(o.data(), x.data(), x.size());
    return dot(dout, o);
  };
  CHECK(fd_error(x, dx, loss) < fd_bound);
}

TEST_CASE("residual_forward adds") {
  const Vec a = random_vec(9, 41), b = random_vec(9, 42);
  Vec out(9);
  k::residual_forward(out.data(), a.data(), b.data(), a.size());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(out[i] == a[i] + b[i]);
  auto fa = to<bf16>(a), fb = to<bf16>(b);
  k::residual_forward(fa.data(), fa.data(), fb.data(), fa.size());  // out aliases a
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(float(fa[i]) == float(bf16(float(bf16(float(a[i]))) + float(bf16(float(b[i]))))));
}

// ---------------------------------------------------------------- layernorm, rmsnorm

namespace {
constexpr int LN_N = 4, LN_C = 8;

template <class T>
struct LnResult {
  Vec out, mean, rstd, dinp, dweight, dbias;
};
template <class T>
LnResult<T> run_layernorm(const Vec& x, const Vec& w, const Vec& b, const Vec& dout, const Vec* prefill_dx = nullptr,
                          const Vec* prefill_dw = nullptr, const Vec* prefill_db = nullptr) {
  using A = fived::acc_t<T>;
  auto tx = to<T>(x), tw = to<T>(w), tb = to<T>(b), tg = to<T>(dout);
  std::vector<T> out(x.size());
  std::vector<A> mean(LN_N), rstd(LN_N);
  k::layernorm_forward(out.data(), mean.data(), rstd.data(), tx.data(), tw.data(), tb.data(), LN_N, LN_C);
  std::vector<T> dx = prefill_dx ? to<T>(*prefill_dx) : std::vector<T>(x.size());
  std::vector<T> dw = prefill_dw ? to<T>(*prefill_dw) : std::vector<T>(w.size());
  std::vector<T> db = prefill_db ? to<T>(*prefill_db) : std::vector<T>(b.size());
  k::layernorm_backward(dx.data(), dw.data(), db.data(), tg.data(), tx.data(), tw.data(), mean.data(), rstd.data(), LN_N,
                        LN_C);
  return {from(out), Vec(mean.begin(), mean.end()), Vec(rstd.begin(), rstd.end()), from(dx), from(dw), from(db)};
}

template <class T>
struct RmsResult {
  Vec out, rstd, dinp, dweight;
};
template <class T>
RmsResult<T> run_rmsnorm(const Vec& x, const Vec& w, const Vec& dout, const Vec* prefill_dx = nullptr,
                         const Vec* prefill_dw = nullptr) {
  using A = fived::acc_t<T>;
  auto tx = to<T>(x), tw = to<T>(w), tg = to<T>(dout);
  std::vector<T> out(x.size());
  std::vector<A> rstd(LN_N);
  k::rmsnorm_forward(out.data(), rstd.data(), tx.data(), tw.data(), LN_N, LN_C);
  std::vector<T> dx = prefill_dx ? to<T>(*prefill_dx) : std::vector<T>(x.size());
  std::vector<T> dw = prefill_dw ? to<T>(*prefill_dw) : std::vector<T>(w.size());
  k::rmsnorm_backward(dx.data(), dw.data(), tg.data(), tx.data(), tw.data(), rstd.data(), LN_N, LN_C);
  return {from(out), Vec(rstd.begin(), rstd.end()), from(dx), from(dw)};
}
}  // namespace

TEST_CASE("layernorm forward: mean 0, variance var/(var+eps) before the affine; mean, rstd and affine closed form") {
  const Vec x = random_vec(LN_N * LN_C, 51, 2.0), w = random_vec(LN_C, 52), b = random_vec(LN_C, 53);
  const Vec dout = random_vec(LN_N * LN_C, 54);
  const auto plain = run_layernorm<double>(x, Vec(LN_C, 1.0), Vec(LN_C, 0.0), dout);
  const auto affine = run_layernorm<double>(x, w, b, dout);
  for (int i = 0; i < LN_N; ++i) {
    double m = 0, v = 0, om = 0, ov = 0;
    for (int c = 0; c < LN_C; ++c) m += x[static_cast<std::size_t>(i * LN_C + c)] / LN_C;
    for (int c = 0; c < LN_C; ++c) v += std::pow(x[static_cast<std::size_t>(i * LN_C + c)] - m, 2) / LN_C;
    for (int c = 0; c < LN_C; ++c) om += plain.out[static_cast<std::size_t>(i * LN_C + c)] / LN_C;
    for (int c = 0; c < LN_C; ++c) ov += std::pow(plain.out[static_cast<std::size_t>(i * LN_C + c)] - om, 2) / LN_C;
    CHECK(std::abs(om) < exact_bound);
    CHECK(std::abs(ov - v / (v + 1e-5)) < exact_bound);
    CHECK(std::abs(plain.mean[static_cast<std::size_t>(i)] - m) < exact_bound);
    CHECK(std::abs(plain.rstd[static_cast<std::size_t>(i)] - 1 / std::sqrt(v + 1e-5)) < exact_bound);
    for (int c = 0; c < LN_C; ++c) {
      const std::size_t e = static_cast<std::size_t>(i * LN_C + c);
      CHECK(std::abs(affine.out[e] - (plain.out[e] * w[static_cast<std::size_t>(c)] + b[static_cast<std::size_t>(c)])) <
            exact_bound);
    }
  }
}

TEST_CASE("layernorm backward: dinp, dweight, dbias against finite differences, and all three accumulate (+=)") {
  Vec x = random_vec(LN_N * LN_C, 61), w = random_vec(LN_C, 62), b = random_vec(LN_C, 63);
  const Vec dout = random_vec(LN_N * LN_C, 64);
  const auto r = run_layernorm<double>(x, w, b, dout);
  auto loss = [&] { return dot(dout, run_layernorm<double>(x, w, b, dout).out); };
  CHECK(fd_error(x, r.dinp, loss) < fd_bound);
  CHECK(fd_error(w, r.dweight, loss) < fd_bound);
  CHECK(fd_error(b, r.dbias, loss) < fd_bound);
  const Vec px = random_vec(x.size(), 65), pw = random_vec(w.size(), 66), pb = random_vec(b.size(), 67);
  const auto acc = run_layernorm<double>(x, w, b, dout, &px, &pw, &pb);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(acc.dinp[i] == doctest::Approx(px[i] + r.dinp[i]).epsilon(1e-12));
  for (std::size_t i = 0; i < w.size(); ++i) {
    CHECK(acc.dweight[i] == doctest::Approx(pw[i] + r.dweight[i]).epsilon(1e-12));
    CHECK(acc.dbias[i] == doctest::Approx(pb[i] + r.dbias[i]).epsilon(1e-12));
  }
}

TEST_CASE("rmsnorm: forward closed form (mean square 1/(1+eps/ms)), backward against finite differences, +=") {
  Vec x = random_vec(LN_N * LN_C, 71), w = random_vec(LN_C, 72);
  const Vec dout = random_vec(LN_N * LN_C, 73);
  const auto plain = run_rmsnorm<double>(x, Vec(LN_C, 1.0), dout);
  const auto r = run_rmsnorm<double>(x, w, dout);
  for (int i = 0; i < LN_N; ++i) {
    double ms = 0, oms = 0;
    for (int c = 0; c < LN_C; ++c) ms += std::pow(x[static_cast<std::size_t>(i * LN_C + c)], 2) / LN_C;
    for (int c = 0; c < LN_C; ++c) oms += std::pow(plain.out[static_cast<std::size_t>(i * LN_C + c)], 2) / LN_C;
    CHECK(std::abs(oms - ms / (ms + 1e-5)) < exact_bound);
    CHECK(std::abs(r.rstd[static_cast<std::size_t>(i)] - 1 / std::sqrt(ms + 1e-5)) < exact_bound);
    for (int c = 0; c < LN_C; ++c) {
      const std::size_t e = static_cast<std::size_t>(i * LN_C + c);
      CHECK(std::abs(r.out[e] - plain.out[e] * w[static_cast<std::size_t>(c)]) < exact_bound);
    }
  }
  auto loss = [&] { return dot(dout, run_rmsnorm<double>(x, w, dout).out); };
  CHECK(fd_error(x, r.dinp, loss) < fd_bound);
  CHECK(fd_error(w, r.dweight, loss) < fd_bound);
  const Vec px = random_vec(x.size(), 74), pw = random_vec(w.size(), 75);
  const auto acc = run_rmsnorm<double>(x, w, dout, &px, &pw);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(acc.dinp[i] == doctest::Approx(px[i] + r.dinp[i]).epsilon(1e-12));
  for (std::size_t i = 0; i < w.size(); ++i)
    CHECK(acc.dweight[i] == doctest::Approx(pw[i] + r.dweight[i]).epsilon(1e-12));
}

// ---------------------------------------------------------------- attention

namespace {
constexpr int AB = 2, AT = 5, AC = 8, ANH = 2;

template <class T>
struct AttnResult {
  Vec out, lse, dqkv;
};
template <class T>
AttnResult<T> run_attention(const Vec& qkv, const Vec& dout, bool backward = true, int B = AB, int T_ = AT, int C = AC,
                            int NH = ANH, int NKV = ANH) {  // NKV: key/value heads
  using A = fived::acc_t<T>;
  auto tq = to<T>(qkv), tg = to<T>(dout);
  std::vector<T> out(static_cast<std::size_t>(B * T_ * C));
  std::vector<A> lse(static_cast<std::size_t>(B * NH * T_));
  k::attention_forward(out.data(), lse.data(), tq.data(), B, T_, C, NH, NKV);
  std::vector<T> dqkv(qkv.size(), static_cast<T>(A(123)));  // "=": must be overwritten
  if (backward) k::attention_backward(dqkv.data(), tg.data(), tq.data(), out.data(), lse.data(), B, T_, C, NH, NKV);
  return {from(out), Vec(lse.begin(), lse.end()), from(dqkv)};
}

// Elements of q|k|v [B, T, C + 2 NKV hs] for NH query heads over NKV key/value heads.
int qkv_elements(int B, int T_, int C, int NH, int NKV) { return B * T_ * (C + 2 * C / NH * NKV); }

// softmax(Q K^T / sqrt(hs) + causal mask) V with the full T x T matrix, and the row log-sum-exp;
// query head h reads key/value head h / (NH / NKV), as Hugging Face's repeat_kv.
void naive_attention(const Vec& qkv, Vec& out, Vec& lse, int B, int T_, int C, int NH, int NKV) {
  const int hs = C / NH, ld = C + 2 * hs * NKV;
  out.assign(static_cast<std::size_t>(B * T_ * C), 0.0);
  lse.assign(static_cast<std::size_t>(B * NH * T_), 0.0);
  auto at = [&](int b, int t, int part, int h, int d) {  // part 0: query head h; 1, 2: key, value of h's group
    const int col = part == 0 ? h * hs : C + (part - 1) * hs * NKV + h / (NH / NKV) * hs;
    return qkv[static_cast<std::size_t>((b * T_ + t) * ld + col + d)];
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h) {
      std::vector<Vec> S(static_cast<std::size_t>(T_), Vec(static_cast<std::size_t>(T_)));
      for (int t = 0; t < T_; ++t)
        for (int j = 0; j < T_; ++j) {
          double s = 0;
          for (int d = 0; d < hs; ++d) s += at(b, t, 0, h, d) * at(b, j, 1, h, d);
          S[t][j] = j <= t ? s / std::sqrt(double(hs)) : -std::numeric_limits<double>::infinity();
        }
      for (int t = 0; t < T_; ++t) {
        double z = 0;
        for (int j = 0; j < T_; ++j) z += std::exp(S[t][j]);  // exp(-inf) = 0; small scores, no max needed
        lse[static_cast<std::size_t>((b * NH + h) * T_ + t)] = std::log(z);
        for (int d = 0; d < hs; ++d) {
          double o = 0;
          for (int j = 0; j < T_; ++j) o += std::exp(S[t][j]) / z * at(b, j, 2, h, d);
          out[static_cast<std::size_t>((b * T_ + t) * C + h * hs + d)] = o;
        }
      }
    }
}
}  // namespace

// Query heads over key/value heads: multi-head (NKV = NH), grouped-query, and multi-query (NKV = 1).
constexpr std::array<std::array<int, 2>, 6> attention_heads{{{1, 1}, {2, 2}, {4, 4}, {2, 1}, {4, 2}, {4, 1}}};

TEST_CASE("attention forward against naive softmax(QK^T/sqrt(hs) + mask) V; lse against log-sum-exp; grouped key/value "
          "heads read in place") {
  for (const auto [NH, NKV] : attention_heads) {
    CAPTURE(NH);
    CAPTURE(NKV);
    const Vec qkv = random_vec(qkv_elements(AB, AT, AC, NH, NKV), 81, 2.0), dout = random_vec(AB * AT * AC, 82);
    const auto r = run_attention<double>(qkv, dout, false, AB, AT, AC, NH, NKV);
    Vec out, lse;
    naive_attention(qkv, out, lse, AB, AT, AC, NH, NKV);
    CHECK(max_rel_error(r.out, out) < exact_bound);
    CHECK(max_rel_error(r.lse, lse) < exact_bound);
  }
  std::vector<double> o(8), l(8), q(24);
  CHECK_THROWS_AS(k::attention_forward(o.data(), l.data(), q.data(), 1, 1, 8, 3, 3), std::invalid_argument);
  CHECK_THROWS_AS(k::attention_forward(o.data(), l.data(), q.data(), 1, 1, 8, 4, 3), std::invalid_argument);  // 3 ∤ 4
}

TEST_CASE("attention backward: dq, dk, dv (all of dqkv; a key/value head's summed over its query heads) against finite "
          "differences; dqkv is overwritten") {
  for (const auto [NH, NKV] : attention_heads) {
    CAPTURE(NH);
    CAPTURE(NKV);
    Vec qkv = random_vec(qkv_elements(AB, AT, AC, NH, NKV), 91, 1.5);
    const Vec dout = random_vec(AB * AT * AC, 92);
    const auto r = run_attention<double>(qkv, dout, true, AB, AT, AC, NH, NKV);
    auto loss = [&] { return dot(dout, run_attention<double>(qkv, dout, false, AB, AT, AC, NH, NKV).out); };
    CHECK(fd_error(qkv, r.dqkv, loss) < fd_bound);
  }
}

// Packed documents (context/documents.hpp): rows holding several documents, and each
// document attended alone as a sequence of its own, B = 1. Row 0 ends documents at 3, 4, 7
// and 11 (documents of 4, 1, 3 and 4 tokens), row 1 holds one.
TEST_CASE("attention over packed documents: each document's output, lse and gradients are those of the document "
          "alone, bit for bit; as ring blocks (a past chunk that some rows see nothing of, then the diagonal) too") {
  constexpr int B = 2, T = 12, C = 8, NH = 4, NKV = 2, hs = C / NH, ld = C + 2 * hs * NKV, eod = 7;
  std::vector<int> ids(B * T, 1), first(B * T);
  for (int t : {3, 4, 7}) ids[static_cast<std::size_t>(t)] = eod;
  ids[T - 1] = eod;  // a last token that ends its document changes nothing
  fived::document_starts(ids, B, T, eod, first);
  CHECK(std::vector<int>(first.begin(), first.begin() + T) == std::vector<int>{0, 0, 0, 0, 4, 5, 5, 5, 8, 8, 8, 8});
  CHECK(std::all_of(first.begin() + T, first.end(), [](int f) { return f == 0; }));

  const Vec qkv = random_vec(B * T * ld, 95, 2.0), dout = random_vec(B * T * C, 96);
  Vec out(B * T * C), lse(B * NH * T), dqkv(qkv.size());
  k::attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NKV, first.data());
  k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH, NKV, first.data());
  const std::vector<std::array<int, 3>> documents{{0, 0, 4}, {0, 4, 5}, {0, 5, 8}, {0, 8, 12}, {1, 0, 12}};  // row, begin, end
  for (const auto [b, begin, end] : documents) {
    CAPTURE(b);
    CAPTURE(begin);
    const int n = end - begin;
    const auto row = static_cast<std::size_t>(b * T + begin);
    Vec o(n * C), l(NH * n), g(n * ld);
    k::attention_forward(o.data(), l.data(), qkv.data() + row * ld, 1, n, C, NH, NKV);
    k::attention_backward(g.data(), dout.data() + row * C, qkv.data() + row * ld, o.data(), l.data(), 1, n, C, NH, NKV);
    CHECK(std::equal(o.begin(), o.end(), out.begin() + static_cast<std::ptrdiff_t>(row * C)));
    CHECK(std::equal(g.begin(), g.end(), dqkv.begin() + static_cast<std::ptrdiff_t>(row * ld)));
    for (int h = 0; h < NH; ++h)
      CHECK(std::equal(l.begin() + h * n, l.begin() + (h + 1) * n,
                       lse.begin() + (b * NH + h) * T + begin));
  }

  // Row 0 as two chunks of 6: the second chunk's queries against the first chunk's keys (rows
  // 6 and 7, of document 5..7, see key 5 only; rows 8-11 see none), then against its own.
  constexpr int n = T / 2;
  const double* q1 = qkv.data() + static_cast<std::size_t>(n) * ld;
  Vec o(n * C), l(NH * n), Dd(NH * n), dq(n * C), dkv(T * 2 * hs * NKV);
  const fived::DocumentMask past{first.data() + n, 0}, diagonal{first.data() + n, n};
  k::attention_block_forward(o.data(), l.data(), q1, qkv.data() + C, qkv.data() + C + hs * NKV, ld, ld, 1, n, C, NH,
                             NKV, false, past, true);
  k::attention_block_forward(o.data(), l.data(), q1, q1 + C, q1 + C + hs * NKV, ld, ld, 1, n, C, NH, NKV, true,
                             diagonal, false);
  for (int r = 0; r < n; ++r)
    for (int h = 0; h < NH; ++h) {
      CHECK(l[static_cast<std::size_t>(h * n + r)] ==
            doctest::Approx(lse[static_cast<std::size_t>(h * T + n + r)]).epsilon(1e-13));
      for (int d = 0; d < hs; ++d)
        CHECK(o[static_cast<std::size_t>(r * C + h * hs + d)] ==
              doctest::Approx(out[static_cast<std::size_t>((n + r) * C + h * hs + d)]).epsilon(1e-13));
    }
  // The backward of the two blocks gives chunk 1's dq and its share of every key's d[k | v].
  const double* dout1 = dout.data() + static_cast<std::size_t>(n) * C;
  k::attention_row_dot(Dd.data(), dout1, out.data() + static_cast<std::size_t>(n) * C, 1, n, C, NH);
  const int ldkv = 2 * hs * NKV;
  Vec lse1;  // chunk 1's rows of row 0's lse, [NH, n]
  for (int h = 0; h < NH; ++h) lse1.insert(lse1.end(), lse.begin() + h * T + n, lse.begin() + h * T + T);
  k::attention_block_backward(dq.data(), dkv.data(), dkv.data() + hs * NKV, ldkv, dout1, Dd.data(), lse1.data(), q1,
                              qkv.data() + C, qkv.data() + C + hs * NKV, ld, ld, 1, n, C, NH, NKV, false, past);
  k::attention_block_backward(dq.data(), dkv.data() + n * ldkv, dkv.data() + n * ldkv + hs * NKV, ldkv, dout1,
                              Dd.data(), lse1.data(), q1, q1 + C, q1 + C + hs * NKV, ld, ld, 1, n, C, NH, NKV, true,
                              diagonal);
  // Chunk 1's dq is its rows' whole; keys 6-11 are read by chunk 1's queries alone (their
  // whole d[k | v]), keys 0-4 by none of them; key 5 also by query 5, in chunk 0.
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < C; ++c)
      CHECK(dq[static_cast<std::size_t>(r * C + c)] ==
            doctest::Approx(dqkv[static_cast<std::size_t>((n + r) * ld + c)]).epsilon(1e-12));
  for (int key = 0; key < T; ++key)
    for (int c = 0; c < ldkv; ++c)
      if (key != 5)
        CHECK(dkv[static_cast<std::size_t>(key * ldkv + c)] ==
              doctest::Approx(key < 5 ? 0.0 : dqkv[static_cast<std::size_t>(key * ld + C + c)]).epsilon(1e-12));
}

// ---------------------------------------------------------------- cross-entropy

namespace {
constexpr int CE_N = 3, CE_V = 10, CE_VP = 16;

// Logits [N, Vp] with padding columns holding large values (they must never win).
Vec ce_logits(unsigned seed) {
  Vec l = random_vec(CE_N * CE_VP, seed, 2.0);
  for (int i = 0; i < CE_N; ++i)
    for (int j = CE_V; j < CE_VP; ++j) l[static_cast<std::size_t>(i * CE_VP + j)] = 50.0 + j;
  return l;
}
const std::vector<int> ce_targets = {3, 0, 9};

// Loss sum and dlogits through the three-step API on one shard, everything in acc_t.
template <class T>
double ce_single(const Vec& logits, Vec* dlogits, Vec* losses, double dloss) {
  using A = fived::acc_t<T>;
  auto tl = to<T>(logits);
  std::vector<A> m(CE_N), s(CE_N), t(CE_N);
  k::logits_max(m.data(), tl.data(), CE_N, CE_VP, 0, CE_V);
  k::crossentropy_partials(s.data(), t.data(), tl.data(), ce_targets.data(), m.data(), CE_N, CE_VP, 0, CE_V);
  std::vector<T> d(tl.size());
  std::vector<A> lo(CE_N);
  k::crossentropy_backward(lo.data(), d.data(), tl.data(), ce_targets.data(), m.data(), s.data(), t.data(), CE_N, CE_VP,
                           0, CE_V, dloss);
  if (dlogits) *dlogits = from(d);
  if (losses) *losses = Vec(lo.begin(), lo.end());
  double total = 0;
  for (int i = 0; i < CE_N; ++i)
    total += std::log(double(s[static_cast<std::size_t>(i)])) + double(m[static_cast<std::size_t>(i)]) -
             double(t[static_cast<std::size_t>(i)]);
  return total;
}
}  // namespace

TEST_CASE("cross-entropy: loss against -log softmax over the real vocabulary, dlogits against finite differences") {
  Vec logits = ce_logits(101);
  const double dloss = 0.37;
  Vec d, losses;
  ce_single<double>(logits, &d, &losses, dloss);
  for (int i = 0; i < CE_N; ++i) {
    double z = 0;
    for (int j = 0; j < CE_V; ++j) z += std::exp(logits[static_cast<std::size_t>(i * CE_VP + j)]);
    const double ref = -std::log(std::exp(logits[static_cast<std::size_t>(i * CE_VP + ce_targets[static_cast<std::size_t>(i)])]) / z);
    CHECK(losses[static_cast<std::size_t>(i)] == doctest::Approx(ref).epsilon(1e-13));  // in the model's precision
    for (int j = CE_V; j < CE_VP; ++j) CHECK(d[static_cast<std::size_t>(i * CE_VP + j)] == 0.0);
  }
  // Padding columns included: their finite difference is 0, as their dlogits.
  auto loss = [&] { return double(dloss) * ce_single<double>(logits, nullptr, nullptr, dloss); };
  CHECK(fd_error(logits, d, loss) < fd_bound);

  // The convenience call, and dlogits aliasing logits, give the same.
  std::vector<double> inplace = logits;
  std::vector<double> lo(CE_N);
  k::crossentropy_forward_backward(lo.data(), inplace.data(), inplace.data(), ce_targets.data(), CE_N, CE_VP, CE_V, dloss);
  CHECK(max_rel_error(inplace, d) < exact_bound);
  for (int i = 0; i < CE_N; ++i) CHECK(lo[static_cast<std::size_t>(i)] == losses[static_cast<std::size_t>(i)]);
  // crossentropy_fused also leaves the statistics: mean_loss of them is the mean of the losses.
  std::vector<double> mx(CE_N), se(CE_N), tl(CE_N), lf(CE_N), fused = logits;
  k::crossentropy_fused(lf.data(), fused.data(), mx.data(), se.data(), tl.data(), fused.data(), ce_targets.data(), CE_N,
                        CE_VP, CE_V, dloss);
  CHECK(fused == inplace);
  CHECK(lf == lo);
  double mean = 0;
  for (double l : lo) mean += l / CE_N;
  CHECK(k::mean_loss(mx.data(), se.data(), tl.data(), CE_N) == doctest::Approx(mean).epsilon(1e-14));

  const std::vector<int> bad = {3, 10, 0};  // 10 is a padding column, not a token
  CHECK_THROWS_AS(k::crossentropy_forward_backward(lo.data(), inplace.data(), logits.data(), bad.data(), CE_N, CE_VP,
                                                   CE_V, dloss),
                  std::invalid_argument);
}

TEST_CASE("cross-entropy vocab shards (2 and 4): combined by hand, same losses and dlogits as one shard") {
  const Vec logits = ce_logits(111);
  const double dloss = 1.0 / 3;
  Vec d_ref, loss_ref;
  ce_single<double>(logits, &d_ref, &loss_ref, dloss);
  for (int S : {2, 4}) {
    CAPTURE(S);
    const int Vs = CE_VP / S;
    std::vector<Vec> shard(static_cast<std::size_t>(S), Vec(static_cast<std::size_t>(CE_N * Vs)));
    for (int s = 0; s < S; ++s)
      for (int i = 0; i < CE_N; ++i)
        for (int j = 0; j < Vs; ++j)
          shard[static_cast<std::size_t>(s)][static_cast<std::size_t>(i * Vs + j)] =
              logits[static_cast<std::size_t>(i * CE_VP + s * Vs + j)];
    // all-reduce(max)
    Vec gmax(CE_N, -std::numeric_limits<double>::infinity());
    for (int s = 0; s < S; ++s) {
      Vec m(CE_N);
      k::logits_max(m.data(), shard[static_cast<std::size_t>(s)].data(), CE_N, Vs, s * Vs, CE_V);
      for (int i = 0; i < CE_N; ++i) {
        if (s * Vs >= CE_V) CHECK(m[static_cast<std::size_t>(i)] == -std::numeric_limits<double>::infinity());
        CHECK(m[static_cast<std::size_t>(i)] < 50.0);  // padding never wins
        gmax[static_cast<std::size_t>(i)] = std::max(gmax[static_cast<std::size_t>(i)], m[static_cast<std::size_t>(i)]);
      }
    }
    // all-reduce(sum) of sumexp and target_logit
    Vec sumexp(CE_N, 0.0), tlogit(CE_N, 0.0);
    for (int s = 0; s < S; ++s) {
      Vec se(CE_N), tl(CE_N);
      k::crossentropy_partials(se.data(), tl.data(), shard[static_cast<std::size_t>(s)].data(), ce_targets.data(),
                               gmax.data(), CE_N, Vs, s * Vs, CE_V);
      for (int i = 0; i < CE_N; ++i) {
        sumexp[static_cast<std::size_t>(i)] += se[static_cast<std::size_t>(i)];
        tlogit[static_cast<std::size_t>(i)] += tl[static_cast<std::size_t>(i)];
      }
    }
    Vec d_cat(logits.size());
    for (int s = 0; s < S; ++s) {
      Vec lo(CE_N);
      Vec& sh = shard[static_cast<std::size_t>(s)];
      k::crossentropy_backward(lo.data(), sh.data(), sh.data(), ce_targets.data(), gmax.data(), sumexp.data(),
                               tlogit.data(), CE_N, Vs, s * Vs, CE_V, dloss);  // in place
      for (int i = 0; i < CE_N; ++i) {
        CHECK(lo[static_cast<std::size_t>(i)] == doctest::Approx(loss_ref[static_cast<std::size_t>(i)]).epsilon(1e-13));
        for (int j = 0; j < Vs; ++j)
          d_cat[static_cast<std::size_t>(i * CE_VP + s * Vs + j)] = sh[static_cast<std::size_t>(i * Vs + j)];
      }
    }
    CHECK(max_rel_error(d_cat, d_ref) < exact_bound);
  }
}

// ---------------------------------------------------------------- embedding

TEST_CASE("embedding backward sums a frequent token in fp32 before rounding to bf16") {
  // 1000 occurrences of one token: adding each in bf16 would stop growing at 256.
  const int n = 1000, C = 2;
  std::vector<int> tok(n, 3);
  std::vector<bf16> dout(static_cast<std::size_t>(n) * C, bf16(1.0f));
  std::vector<bf16> dwte(5 * C, bf16(0.0f)), dwpe(static_cast<std::size_t>(n) * C, bf16(0.0f));
  k::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), 1, n, C, 0, 5);
  CHECK(float(dwte[3 * C]) == float(bf16(1000.0f)));
  CHECK(float(dwte[3 * C + 1]) == float(bf16(1000.0f)));
  CHECK(float(dwte[0]) == 0.0f);
  CHECK(float(dwpe[0]) == 1.0f);
}

namespace {
constexpr int EB = 2, ET = 3, EC = 4, EV = 5, EMAXT = 4;
const std::vector<int> e_tokens = {1, 3, 1, 4, 1, 0};
}  // namespace

TEST_CASE("embedding forward (wte[tok] + wpe[t]) and backward against finite differences; dwte, dwpe +=") {
  Vec wte = random_vec(EV * EC, 121), wpe = random_vec(EMAXT * EC, 122);
  const Vec dout = random_vec(EB * ET * EC, 123);
  auto forward = [&] {
    Vec out(static_cast<std::size_t>(EB * ET * EC));
    k::embedding_forward(out.data(), e_tokens.data(), wte.data(), 0, EV, wpe.data(), EB, ET, EC);
    return out;
  };
  const Vec out = forward();
  for (int b = 0; b < EB; ++b)
    for (int t = 0; t < ET; ++t)
      for (int c = 0; c < EC; ++c)
        CHECK(out[static_cast<std::size_t>((b * ET + t) * EC + c)] ==
              wte[static_cast<std::size_t>(e_tokens[static_cast<std::size_t>(b * ET + t)] * EC + c)] +
                  wpe[static_cast<std::size_t>(t * EC + c)]);
  const Vec pte = random_vec(wte.size(), 124), ppe = random_vec(wpe.size(), 125);
  Vec dwte = pte, dwpe = ppe;
  k::embedding_backward(dwte.data(), dwpe.data(), dout.data(), e_tokens.data(), EB, ET, EC, 0, EV);
  for (std::size_t i = 0; i < dwte.size(); ++i) dwte[i] -= pte[i];
  for (std::size_t i = 0; i < dwpe.size(); ++i) dwpe[i] -= ppe[i];
  auto loss = [&] { return dot(dout, forward()); };
  CHECK(fd_error(wte, dwte, loss) < fd_bound);
  CHECK(fd_error(wpe, dwpe, loss) < fd_bound);  // row 3 of wpe is unused: 0 both ways
  for (std::size_t c = 0; c < EC; ++c) CHECK(dwte[2 * EC + c] == 0.0);  // token 2 never occurs

  const std::vector<int> bad = {1, -1, 0, 0, 0, 0};
  Vec o(static_cast<std::size_t>(EB * ET * EC));
  CHECK_THROWS_AS(k::embedding_forward(o.data(), bad.data(), wte.data(), 0, EV, wpe.data(), EB, ET, EC),
                  std::invalid_argument);
}

TEST_CASE("embedding over vocabulary shards: the shards' outputs and gradients add up to the whole table's") {
  // Two shards [0, 3) and [3, 5) of wte; positions added by the first only, as the
  // vocab-parallel embedding does, so the sum of the shards' outputs is the full forward.
  const Vec wte = random_vec(EV * EC, 131), wpe = random_vec(EMAXT * EC, 132), dout = random_vec(EB * ET * EC, 133);
  const std::size_t n = static_cast<std::size_t>(EB * ET * EC);
  Vec full(n), lo(n), hi(n);
  k::embedding_forward(full.data(), e_tokens.data(), wte.data(), 0, EV, wpe.data(), EB, ET, EC);
  k::embedding_forward(lo.data(), e_tokens.data(), wte.data(), 0, 3, wpe.data(), EB, ET, EC);
  k::embedding_forward(hi.data(), e_tokens.data(), wte.data() + 3 * EC, 3, 2, static_cast<const double*>(nullptr), EB,
                       ET, EC);
  for (std::size_t i = 0; i < n; ++i) CHECK(lo[i] + hi[i] == doctest::Approx(full[i]).epsilon(1e-15));
  Vec dwte(wte.size(), 0.0), dwpe(wpe.size(), 0.0), dshard(wte.size(), 0.0), dwpe_none(wpe.size(), 0.0);
  k::embedding_backward(dwte.data(), dwpe.data(), dout.data(), e_tokens.data(), EB, ET, EC, 0, EV);
  k::embedding_backward(dshard.data(), dwpe_none.data(), dout.data(), e_tokens.data(), EB, ET, EC, 0, 3);
  k::embedding_backward(dshard.data() + 3 * EC, static_cast<double*>(nullptr), dout.data(), e_tokens.data(), EB, ET,
                        EC, 3, 2);
  for (std::size_t i = 0; i < dwte.size(); ++i) CHECK(dshard[i] == dwte[i]);
  for (std::size_t i = 0; i < dwpe.size(); ++i) CHECK(dwpe_none[i] == dwpe[i]);
}

// ---------------------------------------------------------------- adamw

TEST_CASE("adamw: two steps against a hand-computed update; fp32 master with bf16 param (param == bf16(master))") {
  const std::size_t n = 6;
  const Vec w0 = random_vec(n, 131), g1 = random_vec(n, 132), g2 = random_vec(n, 133);
  const float lr = 0.01f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  // Hand computation in double.
  Vec w = w0, m(n, 0.0), v(n, 0.0);
  for (int step = 1; step <= 2; ++step) {
    const Vec& g = step == 1 ? g1 : g2;
    for (std::size_t i = 0; i < n; ++i) {
      w[i] -= double(lr) * double(wd) * w[i];
      m[i] = double(b1) * m[i] + (1 - double(b1)) * g[i];
      v[i] = double(b2) * v[i] + (1 - double(b2)) * g[i] * g[i];
      const double mh = m[i] / (1 - std::pow(double(b1), step)), vh = v[i] / (1 - std::pow(double(b2), step));
      w[i] -= double(lr) * mh / (std::sqrt(vh) + double(eps));
    }
  }
  // float param, no master
  std::vector<float> pf(w0.begin(), w0.end()), mf(n, 0.f), vf(n, 0.f);
  const auto gf1 = to<float>(g1), gf2 = to<float>(g2);
  k::adamw_update(pf.data(), nullptr, gf1.data(), mf.data(), vf.data(), n, lr, b1, b2, eps, wd, 1);
  k::adamw_update(pf.data(), nullptr, gf2.data(), mf.data(), vf.data(), n, lr, b1, b2, eps, wd, 2);
  CHECK(max_rel_error(from(pf), w) < 1e-6);
  CHECK(max_rel_error(from(mf), m) < 1e-6);
  CHECK(max_rel_error(from(vf), v) < 1e-6);
  // double param, no master: the moments are double too, so exact to a double's precision
  std::vector<double> pd = w0, md(n, 0.0), vd(n, 0.0);
  k::adamw_update(pd.data(), nullptr, g1.data(), md.data(), vd.data(), n, lr, b1, b2, eps, wd, 1);
  k::adamw_update(pd.data(), nullptr, g2.data(), md.data(), vd.data(), n, lr, b1, b2, eps, wd, 2);
  CHECK(max_rel_error(pd, w) < 1e-14);
  CHECK(max_rel_error(md, m) < 1e-14);
  CHECK(max_rel_error(vd, v) < 1e-14);
  // bf16 param, fp32 master (same float gradients): master equals the float run exactly.
  std::vector<float> master(w0.begin(), w0.end()), mb(n, 0.f), vb(n, 0.f);
  std::vector<bf16> pb = to<bf16>(w0);
  const auto gb1 = to<bf16>(g1), gb2 = to<bf16>(g2);
  std::vector<float> gb1f(gb1.begin(), gb1.end()), gb2f(gb2.begin(), gb2.end());
  std::vector<float> pref(w0.begin(), w0.end()), mref(n, 0.f), vref(n, 0.f);
  k::adamw_update(pb.data(), master.data(), gb1.data(), mb.data(), vb.data(), n, lr, b1, b2, eps, wd, 1);
  k::adamw_update(pb.data(), master.data(), gb2.data(), mb.data(), vb.data(), n, lr, b1, b2, eps, wd, 2);
  k::adamw_update(pref.data(), nullptr, gb1f.data(), mref.data(), vref.data(), n, lr, b1, b2, eps, wd, 1);
  k::adamw_update(pref.data(), nullptr, gb2f.data(), mref.data(), vref.data(), n, lr, b1, b2, eps, wd, 2);
  for (std::size_t i = 0; i < n; ++i) {
    CHECK(master[i] == pref[i]);
    CHECK(pb[i].bits == bf16(master[i]).bits);
  }
  CHECK(max_rel_error(Vec(master.begin(), master.end()), w) < 2e-2);  // bf16 gradients
  CHECK_THROWS_AS(k::adamw_update(pb.data(), nullptr, gb1.data(), mb.data(), vb.data(), n, lr, b1, b2, eps, wd, 3),
                  std::invalid_argument);
  CHECK_THROWS_AS(k::adamw_update(pf.data(), nullptr, gf1.data(), mf.data(), vf.data(), n, lr, b1, b2, eps, wd, 0),
                  std::invalid_argument);
}

// A layout's tensors as adamw_chunks reads them.
struct ChunkTensor {
  std::size_t offset, size;
  bool decay;
  std::size_t end() const { return offset + size; }
  bool decays() const { return decay; }
};

TEST_CASE("adamw_chunks: a range cut at its tensors' edges and every max_elements, with each tensor's decay") {
  constexpr std::size_t M = fived::AdamWChunk::max_elements;
  const std::vector<ChunkTensor> tensors = {{0, 10, false}, {10, 2 * M + 5, true}, {2 * M + 15, 3, false}};
  // The range starts inside the first tensor and ends inside the second: offsets from its start.
  const auto c = fived::adamw_chunks(tensors, fived::FlatRange{4, 10 + M + 7});
  REQUIRE(c.size() == 3);
  CHECK((c[0].begin == 0 && c[0].end == 6 && !c[0].decays));
  CHECK((c[1].begin == 6 && c[1].end == 6 + M && c[1].decays));
  CHECK((c[2].begin == 6 + M && c[2].end == 6 + M + 7 && c[2].decays));
  const auto all = fived::adamw_chunks(tensors, fived::FlatRange{0, 2 * M + 18});
  REQUIRE(all.size() == 5);  // 1 + 3 (M, M, 5) + 1
  std::size_t covered = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    CHECK(all[i].begin == covered);  // in order, nothing left out, nothing longer than M
    CHECK(all[i].end - all[i].begin <= M);
    covered = all[i].end;
  }
  CHECK(covered == 2 * M + 18);
  CHECK(fived::adamw_chunks(tensors, fived::FlatRange{7, 7}).empty());
}

TEST_CASE("adamw_update_chunks: each chunk with its tensor's decay, the gradients clipped as read, equal to a call "
          "per tensor on clipped gradients") {
  // Three tensors, decay on the middle one, cut in chunks; the clip the update computes from
  // the squared norm it is given (16: norm 4, max_norm 1.5, factor 1.5 / (4 + 1e-6)) equals
  // scaling the gradients first by that factor (float and double: the same products). No
  // norm, or max_norm 0: no clip.
  const std::vector<ChunkTensor> tensors = {{0, 5, false}, {5, 9, true}, {14, 4, false}};
  const std::size_t n = 18;
  const double total = 16.0, lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  const auto chunks = fived::adamw_chunks(tensors, fived::FlatRange{0, n});
  auto run = [&]<class T>(T, fived::GradClip clip, double f) {
    const auto w0 = to<T>(random_vec(n, 140)), g = to<T>(random_vec(n, 141));
    std::vector<T> p1 = w0, m1(n), v1(n), p2 = w0, m2(n), v2(n), gs = g;
    k::scale(gs.data(), n, f);
    for (int step = 1; step <= 2; ++step) {
      const fived::AdamWStep at = fived::AdamWStep::at(step, lr, b1, b2);
      k::adamw_update_chunks(p1.data(), static_cast<T*>(nullptr), g.data(), m1.data(), v1.data(), chunks.data(),
                             chunks.size(), &at, b1, b2, eps, wd, clip);
      for (const ChunkTensor& t : tensors)
        k::adamw_update(p2.data() + t.offset, static_cast<T*>(nullptr), gs.data() + t.offset, m2.data() + t.offset,
                        v2.data() + t.offset, t.size, lr, b1, b2, eps, t.decay ? wd : 0.0, step);
    }
    for (std::size_t i = 0; i < n; ++i) CHECK((p1[i] == p2[i] && m1[i] == m2[i] && v1[i] == v2[i]));
  };
  const double f = 1.5 / (4.0 + 1e-6);
  REQUIRE(k::clip_factor(total, 1.5) == f);
  run(float{}, {&total, 1.5}, f);
  run(double{}, {&total, 1.5}, f);
  run(double{}, {&total, 0.0}, 1.0);    // clipping off
  run(double{}, {nullptr, 1.5}, 1.0);   // no norm given
  run(double{}, {&total, 100.0}, 1.0);  // under the limit
}

TEST_CASE("adamw_update_chunks with skip_non_finite: a squared norm that is nan or inf writes nothing (parameters, "
          "moments, masters); a finite one updates as without it") {
  const std::vector<ChunkTensor> tensors = {{0, 5, false}, {5, 9, true}};
  const std::size_t n = 14;
  const auto chunks = fived::adamw_chunks(tensors, fived::FlatRange{0, n});
  const fived::AdamWStep at = fived::AdamWStep::at(1, 0.01, 0.9, 0.95);
  const std::vector<float> w0 = to<float>(random_vec(n, 150));
  std::vector<float> g = to<float>(random_vec(n, 151));
  g[3] = std::numeric_limits<float>::quiet_NaN();
  for (const double total : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    std::vector<float> p = w0, m(n, 0.25f), v(n, 0.5f), master(n, 7.0f);
    std::vector<fived::bf16> pb(n);
    k::adamw_update_chunks(p.data(), static_cast<float*>(nullptr), g.data(), m.data(), v.data(), chunks.data(),
                           chunks.size(), &at, 0.9, 0.95, 1e-8, 0.1, fived::GradClip{&total, 1.0, true});
    CHECK(p == w0);
    CHECK(m == std::vector<float>(n, 0.25f));
    CHECK(v == std::vector<float>(n, 0.5f));
    const std::vector<fived::bf16> gb(n, fived::bf16(0.5f));
    k::adamw_update_chunks(pb.data(), master.data(), gb.data(), m.data(), v.data(), chunks.data(), chunks.size(), &at,
                           0.9, 0.95, 1e-8, 0.1, fived::GradClip{&total, 0.0, true});
    CHECK(master == std::vector<float>(n, 7.0f));
    CHECK(m == std::vector<float>(n, 0.25f));
    CHECK(v == std::vector<float>(n, 0.5f));
    for (const fived::bf16 x : pb) CHECK(static_cast<float>(x) == 0.0f);
  }
  const double finite = 4.0;
  g[3] = 0.5f;
  std::vector<float> p1 = w0, m1(n), v1(n), p2 = w0, m2(n), v2(n);
  k::adamw_update_chunks(p1.data(), static_cast<float*>(nullptr), g.data(), m1.data(), v1.data(), chunks.data(),
                         chunks.size(), &at, 0.9, 0.95, 1e-8, 0.1, fived::GradClip{&finite, 1.0, true});
  k::adamw_update_chunks(p2.data(), static_cast<float*>(nullptr), g.data(), m2.data(), v2.data(), chunks.data(),
                         chunks.size(), &at, 0.9, 0.95, 1e-8, 0.1, fived::GradClip{&finite, 1.0, false});
  CHECK(p1 == p2);
  CHECK(p1 != w0);
}

TEST_CASE("expert_bias_step leaves the bias where its skip value is not finite, and moves it where it is") {
  const std::vector<float> loads = {1, 5, 3, 3};  // one block of 4 experts, mean 3
  const double nan = std::numeric_limits<double>::quiet_NaN(), finite = 2.0;
  std::vector<float> bias(4, 0.0f);
  k::expert_bias_step(bias.data(), loads.data(), 1, 4, 0.25, &nan);
  CHECK(bias == std::vector<float>(4, 0.0f));
  k::expert_bias_step(bias.data(), loads.data(), 1, 4, 0.25, &finite);
  CHECK(bias == std::vector<float>{0.25f, -0.25f, 0.0f, 0.0f});
  k::expert_bias_step(bias.data(), loads.data(), 1, 4, 0.25);  // no skip value: always
  CHECK(bias == std::vector<float>{0.5f, -0.5f, 0.0f, 0.0f});
}

// ---------------------------------------------------------------- norm

TEST_CASE("sum_of_squares_chunks: the chunks' sums in order, written (not added); add_scalar adds one double") {
  // Chunks of one array, out of order and with a gap: each partial is its chunk's sum, the
  // total their sum in chunk order, and what *out held before is gone.
  std::vector<double> g(40);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.5 * static_cast<double>(i) - 3.0;
  const std::vector<fived::SquaresChunk> chunks = {{20, 37}, {0, 7}, {7, 8}, {38, 40}};
  std::vector<double> partials(chunks.size(), -1.0);
  double out = 1e9;
  k::sum_of_squares_chunks(&out, partials.data(), g.data(), chunks.data(), chunks.size());
  double want = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    CAPTURE(c);
    CHECK(partials[c] == k::sum_of_squares(g.data() + chunks[c].begin, chunks[c].end - chunks[c].begin));
    want += partials[c];
  }
  CHECK(out == want);  // written: the 1e9 it held is gone
  const std::vector<bf16> gb = {bf16(3.0f), bf16(-4.0f), bf16(12.0f)};
  const fived::SquaresChunk whole{0, 3};
  double p = 0;
  k::sum_of_squares_chunks(&out, &p, gb.data(), &whole, 1);
  CHECK(out == 169.0);
  k::sum_of_squares_chunks(&out, &p, gb.data(), &whole, 0);
  CHECK(out == 0.0);  // no chunks: zero
  double into = 2.5;
  const double x = 0.25;
  k::add_scalar(&into, &x);
  CHECK(into == 2.75);
}

TEST_CASE("sum_of_squares, scale, clip_factor closed forms") {
  const std::vector<double> g = {3.0, -4.0, 12.0};
  CHECK(k::sum_of_squares(g.data(), g.size()) == 169.0);
  const std::vector<bf16> gb = {bf16(3.0f), bf16(-4.0f), bf16(12.0f)};
  CHECK(k::sum_of_squares(gb.data(), gb.size()) == 169.0);
  const std::vector<float> gf = {0.5f, 0.25f};
  CHECK(k::sum_of_squares(gf.data(), gf.size()) == 0.3125);
  std::vector<float> s = {1.0f, -2.0f, 4.0f};
  k::scale(s.data(), s.size(), 0.5f);
  CHECK(s == std::vector<float>{0.5f, -1.0f, 2.0f});
  std::vector<bf16> sb = {bf16(1.0f), bf16(-2.0f)};
  k::scale(sb.data(), sb.size(), 0.25f);
  CHECK(float(sb[0]) == 0.25f);
  CHECK(float(sb[1]) == -0.5f);
  // A double factor reaches a double gradient unrounded: 1/3 is a double's 1/3, not a float's.
  std::vector<double> sd = {3.0, -6.0};
  k::scale(sd.data(), sd.size(), 1.0 / 3.0);
  CHECK(sd == std::vector<double>{3.0 * (1.0 / 3.0), -6.0 * (1.0 / 3.0)});
  CHECK(sd[0] != 3.0 * static_cast<double>(1.0f / 3.0f));
  CHECK(k::clip_factor(169.0, 1.0) == 1.0 / (13.0 + 1e-6));  // in double, never through float
  CHECK(k::clip_factor(169.0, 6.5) == 6.5 / (13.0 + 1e-6));
  // where the +1e-6 matters: norm 1e-5, so the factor is 1e-6 / 1.1e-5, not 0.1
  const double tiny = 1e-6 / (1e-5 + 1e-6);
  CHECK(std::abs(k::clip_factor(1e-10, 1e-6f) - tiny) <= 1e-5 * tiny);
  CHECK(k::clip_factor(169.0, 26.0f) == 1.0f);
  CHECK(k::clip_factor(0.25, 1.0f) == 1.0f);
  CHECK(k::clip_factor(0.0, 1.0f) == 1.0f);
}

// ---------------------------------------------------------------- regroup

TEST_CASE("regroup: split cuts [outer][n][block] into [n][outer][block], join puts it back") {
  // outer = 2 rows, n = 3 pieces of block = 2: row o holds a(o,k,b) = 100*o + 10*k + b
  const std::vector<int> joined = {0, 1, 10, 11, 20, 21,  //
                                   100, 101, 110, 111, 120, 121};
  std::vector<int> split(12, -1), back(12, -1);
  k::regroup(split.data(), joined.data(), 2, 3, 2, k::Blocks::split);
  CHECK(split == std::vector<int>{0, 1, 100, 101,  //  piece 0 of both rows
                                  10, 11, 110, 111,  //  piece 1
                                  20, 21, 120, 121});
  k::regroup(back.data(), split.data(), 2, 3, 2, k::Blocks::join);
  CHECK(back == joined);

  // split then join is the identity for any shape, including the degenerate ones
  for (const auto& [outer, n, block] : {std::tuple{5, 4, 3}, std::tuple{1, 4, 3}, std::tuple{5, 1, 3},
                                        std::tuple{5, 4, 1}, std::tuple{0, 4, 3}, std::tuple{5, 4, 0}}) {
    const std::size_t size = static_cast<std::size_t>(outer * n * block);
    const std::vector<bf16> x = to<bf16>(random_vec(size, 181));
    std::vector<bf16> s(size), j(size);
    k::regroup(s.data(), x.data(), outer, n, block, k::Blocks::split);
    k::regroup(j.data(), s.data(), outer, n, block, k::Blocks::join);
    CHECK(from(j) == from(x));
    if (outer == 1 || n == 1) CHECK(from(s) == from(x));  // one row or one piece: nothing moves
  }
  CHECK_THROWS_AS(k::regroup(split.data(), joined.data(), 2, 0, 2, k::Blocks::split), std::invalid_argument);
  CHECK_THROWS_AS(k::regroup(split.data(), joined.data(), -1, 3, 2, k::Blocks::join), std::invalid_argument);
}

// ---------------------------------------------------------------- float and bf16 against double

TEST_CASE_TEMPLATE("float and bf16 kernels against double on the same rounded inputs", T, float, bf16) {
  const double bound = std::is_same_v<T, float> ? 1e-5 : 2e-2;
  CAPTURE(bound);
  SUBCASE("matmul (bias, gelu epilogue, accumulate), all transposes") {
    for (Dims d : {Dims{37, 70, 33, false, false}, Dims{37, 70, 33, true, false}, Dims{37, 70, 33, false, true},
                   Dims{37, 70, 33, true, true}}) {
      const Vec a = rounded<T>(random_vec(static_cast<std::size_t>(d.M) * d.K, 141));
      const Vec b = rounded<T>(random_vec(static_cast<std::size_t>(d.K) * d.N, 142));
      const Vec bias = rounded<T>(random_vec(static_cast<std::size_t>(d.N), 143));
      const Vec pre = rounded<T>(random_vec(static_cast<std::size_t>(d.M) * d.N, 144));
      CHECK(max_rel_error(run_matmul<T>(a, b, &bias, d), run_matmul<double>(a, b, &bias, d)) < bound);
      CHECK(max_rel_error(run_matmul<T>(a, b, &bias, d, &pre), run_matmul<double>(a, b, &bias, d, &pre)) < bound);
      Vec pt, pd;
      CHECK(max_rel_error(run_matmul<T>(a, b, &bias, d, nullptr, k::Epilogue::gelu, &pt),
                      run_matmul<double>(a, b, &bias, d, nullptr, k::Epilogue::gelu, &pd)) < bound);
      CHECK(max_rel_error(pt, pd) < bound);
    }
  }
  SUBCASE("layernorm and rmsnorm forward and backward") {
    const Vec x = rounded<T>(random_vec(LN_N * LN_C, 151, 2.0)), w = rounded<T>(random_vec(LN_C, 152));
    const Vec b = rounded<T>(random_vec(LN_C, 153)), dout = rounded<T>(random_vec(LN_N * LN_C, 154));
    const auto t = run_layernorm<T>(x, w, b, dout);
    const auto r = run_layernorm<double>(x, w, b, dout);
    CHECK(max_rel_error(t.out, r.out) < bound);
    CHECK(max_rel_error(t.mean, r.mean) < bound);
    CHECK(max_rel_error(t.rstd, r.rstd) < bound);
    CHECK(max_rel_error(t.dinp, r.dinp) < bound);
    CHECK(max_rel_error(t.dweight, r.dweight) < bound);
    CHECK(max_rel_error(t.dbias, r.dbias) < bound);
    const auto tr = run_rmsnorm<T>(x, w, dout);
    const auto rr = run_rmsnorm<double>(x, w, dout);
    CHECK(max_rel_error(tr.out, rr.out) < bound);
    CHECK(max_rel_error(tr.dinp, rr.dinp) < bound);
    CHECK(max_rel_error(tr.dweight, rr.dweight) < bound);
  }
  SUBCASE("attention forward, lse and backward (4 query heads over 2 key/value heads)") {
    const int B = 2, Tn = 16, C = 32, NH = 4, NKV = 2;
    const Vec qkv = rounded<T>(random_vec(static_cast<std::size_t>(qkv_elements(B, Tn, C, NH, NKV)), 161, 1.5));
    const Vec dout = rounded<T>(random_vec(static_cast<std::size_t>(B * Tn * C), 162));
    const auto t = run_attention<T>(qkv, dout, true, B, Tn, C, NH, NKV);
    // The double reference runs its own forward: the T error includes its rounded out in D = dout . out.
    const auto r = run_attention<double>(qkv, dout, true, B, Tn, C, NH, NKV);
    CHECK(max_rel_error(t.out, r.out) < bound);
    CHECK(max_rel_error(t.lse, r.lse) < bound);
    CHECK(max_rel_error(t.dqkv, r.dqkv) < bound);
  }
  SUBCASE("cross-entropy losses and dlogits; gelu forward and backward") {
    const Vec logits = rounded<T>(ce_logits(171));
    Vec dt, lt, dd, ld;
    ce_single<T>(logits, &dt, &lt, 0.5f);
    ce_single<double>(logits, &dd, &ld, 0.5f);
    CHECK(max_rel_error(lt, ld) < bound);
    CHECK(max_rel_error(dt, dd) < bound);
    const Vec x = rounded<T>(random_vec(64, 172, 3.0)), g = rounded<T>(random_vec(64, 173));
    auto tx = to<T>(x), tg = to<T>(g);
    std::vector<T> y(64), dx(64);
    k::gelu_forward(y.data(), tx.data(), 64);
    k::gelu_backward(dx.data(), tx.data(), tg.data(), 64);
    Vec yd(64), dxd(64);
    k::gelu_forward(yd.data(), x.data(), 64);
    k::gelu_backward(dxd.data(), x.data(), g.data(), 64);
    CHECK(max_rel_error(from(y), yd) < bound);
    CHECK(max_rel_error(from(dx), dxd) < bound);
  }
}
