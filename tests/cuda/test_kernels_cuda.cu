// CUDA kernels against the host reference kernels, on random inputs (never
// zeros: every value is pushed away from 0), for float and bf16.
//
// Error measure: normwise relative error, max_i |cuda_i - host_i| / max_i |host_i|.
// Bounds: bf16 2e-2 for every kernel (both sides round to bf16, in different
// orders: one bf16 ulp is 2^-8 ~ 3.9e-3). fp32 1e-5 for elementwise and row-wise
// kernels (layernorm, gelu, residual, embedding, cross-entropy, AdamW, norm);
// fp32 1e-4 for GEMM and attention, whose long dot products are summed in a
// different order (cuBLASLt's split-K / tile order, tiled online softmax)
// than the host's blocked loops.
//
// Without a GPU the program exits 77 (CTest: skipped) before any test runs.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <fived/comm/nccl.hpp>
#include <fived/device/bf16.hpp>
#include <fived/device/cuda.hpp>
#include <fived/kernels/cuda.hpp>
#include <fived/kernels/host.hpp>
#include <fived/nn/cuda/ops.hpp>
#include <fived/optim/adamw.hpp>
#include <fived/place/redistribute.hpp>

#include "gpu_support.hpp"
#include "../support/compare.hpp"

namespace {

using fived::bf16;
using fived::Buffer;
using fived::Cuda;
namespace hk = fived::kernels::host;
namespace ck = fived::kernels::cuda;

cudaStream_t stream() {
  static fived::cuda::Stream s;
  return s.get();
}

template <class T>
std::vector<T> rnd(std::size_t n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) {
    float f = dist(gen);
    if (std::fabs(f) < 1e-2f * (hi - lo)) f += (f < 0 ? -1.0f : 1.0f) * 1e-2f * (hi - lo);  // never (near) zero
    x = T(f);
  }
  return v;
}

template <class T>
Buffer<T, Cuda> up(const std::vector<T>& v) {
  return Buffer<T, Cuda>(std::span<const T>(v), stream());
}
template <class T>
std::vector<T> down(const Buffer<T, Cuda>& b) {
  std::vector<T> v(b.size());
  b.download(std::span<T>(v), stream());
  return v;
}

// This file states comparisons as (reference, result).
template <class A, class B>
double rel_err(const std::vector<A>& ref, const std::vector<B>& got) {
  return fived::test::max_rel_error(got, ref);
}

template <class T>
constexpr double bound(double fp32) {
  return std::is_same_v<T, bf16> ? 2e-2 : fp32;
}

#define CHECK_CLOSE(ref, got, tol)                                        \
  do {                                                                    \
    const double e_ = rel_err((ref), (got));                              \
    INFO(#got << ": relative error " << e_ << ", bound " << (tol));      \
    CHECK(e_ <= (tol));                                                   \
  } while (0)

constexpr double fp32_elem = 1e-5, fp32_sum = 1e-4;

}  // namespace

#define ELEMENT_TYPES float, fived::bf16

TEST_CASE("device layer: Buffer<T, Cuda>, Stream, Event, checks") {
  const auto h = rnd<float>(1000, 1);
  Buffer<float, Cuda> b = up(h);
  CHECK(b.size() == 1000);
  CHECK(b.bytes() == 4000);
  CHECK(down(b) == h);
  Buffer<float, Cuda> moved(std::move(b));
  CHECK(b.data() == nullptr);
  CHECK(b.size() == 0);
  CHECK(down(moved) == h);
  moved.zero(stream());
  CHECK(down(moved) == std::vector<float>(1000, 0.0f));
  Buffer<float, Cuda> fresh(17);
  CHECK(down(fresh) == std::vector<float>(17, 0.0f));
  std::vector<float> wrong(3);
  CHECK_THROWS_AS(fresh.upload(std::span<const float>(wrong), stream()), std::invalid_argument);

  fived::cuda::Event e0, e1;
  e0.record(stream());
  e1.record(stream());
  CHECK(fived::cuda::Event::elapsed_ms(e0, e1) >= 0.0f);

  // A failing call throws with file:line, the call and CUDA's description.
  try {
    FIVED_CUDA_CHECK(cudaSetDevice(1 << 20));
    FAIL("no exception");
  } catch (const fived::cuda::Error& err) {
    const std::string what = err.what();
    CHECK(what.find("test_kernels_cuda.cu:") != std::string::npos);
    CHECK(what.find("cudaSetDevice") != std::string::npos);
  }
  (void)cudaGetLastError();
  FIVED_CUDA_CHECK(cudaSetDevice(0));
  // A bad launch configuration is caught by the launch check.
  Buffer<float, Cuda> x(4);
  ck::detail::elementwise_kernel<1>
      <<<1, 4096, 0, stream()>>>(ck::detail::MapUnary<float, ck::detail::Gelu>{x.data(), x.data(), {}}, std::size_t{4});
  CHECK_THROWS_AS(FIVED_CUDA_CHECK_LAUNCH("elementwise_kernel"), fived::cuda::Error);
}

TEST_CASE_TEMPLATE("matmul: transposes, bias, accumulate, GELU epilogue", T, ELEMENT_TYPES) {
  ck::CublasLt lt(stream());
  const double tol = bound<T>(fp32_sum);
  for (const int N : {72, 50}) {  // 50: the aux leading dimension is not a multiple of 8 (fallback epilogue)
    const int M = 37, K = 45;
    const auto a = rnd<T>(static_cast<std::size_t>(M) * K, 2), b = rnd<T>(static_cast<std::size_t>(K) * N, 3);
    const auto bias = rnd<T>(N, 4), init = rnd<T>(static_cast<std::size_t>(M) * N, 5);
    auto da = up(a), db = up(b), dbias = up(bias);
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const bool with_bias : {false, true})
          for (const bool acc : {false, true}) {
            CAPTURE(N);
            CAPTURE(ta);
            CAPTURE(tb);
            CAPTURE(with_bias);
            CAPTURE(acc);
            auto ref = init;
            hk::matmul(ref.data(), a.data(), b.data(), with_bias ? bias.data() : nullptr, M, N, K, ta, tb, acc);
            auto dout = up(init);
            ck::matmul(lt, dout.data(), da.data(), db.data(), with_bias ? dbias.data() : nullptr, M, N, K, ta, tb, acc);
            CHECK_CLOSE(ref, down(dout), tol);
          }
    for (const bool with_bias : {false, true}) {
      CAPTURE(with_bias);
      std::vector<T> ref(static_cast<std::size_t>(M) * N), pre(ref.size());
      hk::matmul(ref.data(), a.data(), b.data(), with_bias ? bias.data() : nullptr, M, N, K, false, true, false,
                 hk::Epilogue::gelu, pre.data());
      Buffer<T, Cuda> dout(ref.size()), dpre(ref.size());
      ck::matmul(lt, dout.data(), da.data(), db.data(), with_bias ? dbias.data() : nullptr, M, N, K, false, true, false,
                 ck::Epilogue::gelu, dpre.data());
      CHECK_CLOSE(pre, down(dpre), tol);
      CHECK_CLOSE(ref, down(dout), tol);
    }
  }
  Buffer<T, Cuda> o(4), p(4);
  CHECK_THROWS_AS(ck::matmul(lt, o.data(), o.data(), o.data(), nullptr, 2, 2, 1, false, false, true,
                             ck::Epilogue::gelu, p.data()),
                  std::invalid_argument);
}

TEST_CASE_TEMPLATE("matmul_dgelu: GELU's backward in the GEMM (cuBLASLt's DGELU epilogue) against the host", T,
                   ELEMENT_TYPES) {
  // dh[M,F] = gelu'(pre) * dy[M,C] op(w), as the MLP's c_proj backward; F = 72 takes the
  // epilogue, 50 (the aux leading dimension not a multiple of 8) the product and then
  // gelu_backward. The host rounds the product to T before the GELU's backward, the
  // epilogue does not: bf16 within its rounding.
  ck::CublasLt lt(stream());
  const double tol = bound<T>(fp32_sum);
  for (const int F : {72, 50}) {
    const int M = 37, C = 45;
    const auto dy = rnd<T>(static_cast<std::size_t>(M) * C, 8), w = rnd<T>(static_cast<std::size_t>(F) * C, 9);
    const auto pre = rnd<T>(static_cast<std::size_t>(M) * F, 10, -3.0f, 3.0f);
    auto ddy = up(dy), dw = up(w), dpre = up(pre);
    for (const bool tb : {true, false}) {
      CAPTURE(F);
      CAPTURE(tb);
      std::vector<T> ref(static_cast<std::size_t>(M) * F);
      hk::matmul_dgelu(ref.data(), dy.data(), w.data(), pre.data(), M, F, C, false, tb);
      Buffer<T, Cuda> dh(ref.size());
      ck::matmul_dgelu(lt, dh.data(), ddy.data(), dw.data(), dpre.data(), M, F, C, false, tb);
      CHECK_CLOSE(ref, down(dh), tol);
    }
  }
  Buffer<T, Cuda> o(4);
  ck::matmul_dgelu(lt, o.data(), o.data(), o.data(), o.data(), 2, 2, 0, false, false);  // K = 0: a zero gradient
  for (const T& x : down(o)) CHECK(static_cast<float>(x) == 0.0f);
  CHECK_THROWS_AS(ck::matmul_dgelu(lt, o.data(), o.data(), o.data(), static_cast<const T*>(nullptr), 2, 2, 1, false,
                                   false),
                  std::invalid_argument);
}

TEST_CASE_TEMPLATE("matmul_weight_grad: a linear layer's dW and db (the bias summed in the GEMM) against the host", T,
                   ELEMENT_TYPES) {
  // Both weight layouts (GPT-2's Conv1D: dy is cuBLASLt's A, BGRADA; torch.nn.Linear's: its B,
  // BGRADB), "+=" onto non-zero gradients, twice (a second micro-batch adds again); out = 77
  // leaves rows unaligned (cuBLASLt may have no epilogue algorithm: the plain GEMM and
  // bias_backward). Whether the epilogue ran is printed for the record.
  ck::CublasLt lt(stream());
  const double tol = bound<T>(fp32_sum);
  const int rows = 300, in = 48;
  for (const int out : {64, 77})
    for (const bool transposed : {false, true})
      for (const bool with_bias : {true, false}) {
        CAPTURE(out);
        CAPTURE(transposed);
        CAPTURE(with_bias);
        const auto dy = rnd<T>(static_cast<std::size_t>(rows) * out, 50), x = rnd<T>(static_cast<std::size_t>(rows) * in, 51);
        auto dw = rnd<T>(static_cast<std::size_t>(in) * out, 52), db = rnd<T>(static_cast<std::size_t>(out), 53);
        auto d_dw = up(dw), d_db = up(db);
        const auto d_dy = up(dy), d_x = up(x);
        bool fused = false;
        for (int pass = 0; pass < 2; ++pass) {
          hk::matmul_weight_grad(dw.data(), with_bias ? db.data() : nullptr, dy.data(), x.data(), rows, in, out,
                                 transposed);
          fused = ck::matmul_weight_grad(lt, d_dw.data(), with_bias ? d_db.data() : nullptr, d_dy.data(), d_x.data(),
                                         rows, in, out, transposed);
        }
        CHECK_CLOSE(dw, down(d_dw), tol);
        CHECK_CLOSE(db, down(d_db), tol);  // unchanged without a bias
        if (with_bias) {
          MESSAGE("out=" << out << (transposed ? " torch Linear" : " Conv1D")
                         << (fused ? ": bias gradient in the GEMM's epilogue" : ": plain GEMM, then bias_backward"));
          WARN(fused);  // not an error (the fallback is tested above), but the step's speed counts on it
        } else
          CHECK_FALSE(fused);
      }
}

TEST_CASE_TEMPLATE("a strided batch of GEMMs (padded experts) against the host, every epilogue", T, ELEMENT_TYPES) {
  // Three products of one shape whose operands lie a stride apart with gaps between them (the
  // gaps must keep what they held), as a mixture of experts padded to capacity runs them
  // (nn/moe.hpp): the forward in all four transposes with bias and GELU (its pre-activation
  // as the aux matrix), the plain and accumulating product, GELU's backward, and the weight
  // half with and without the bias summed in the GEMM. The host runs them one after another
  // (its batch is a loop, tested in test_kernels_host). Strides of whole 16 bytes take
  // cuBLASLt's batched call; odd strides (a later product less aligned than the first) one
  // product at a time, as does N = 50 for the aux matrix. Which epilogues ran batched is
  // printed; that the plain product did is checked.
  ck::CublasLt lt(stream());
  const double tol = bound<T>(fp32_sum);
  constexpr std::int64_t count = 3;
  const int M = 37, K = 45;
  for (const bool aligned : {true, false})
    for (const int N : {72, 50}) {
      CAPTURE(aligned);
      CAPTURE(N);
      // n elements and a gap, rounded up to 16 bytes' worth (8 elements) when aligned
      const auto stride = [aligned](std::int64_t n) { return aligned ? (n + 8 + 7) / 8 * 8 : n + 3; };
      const std::int64_t sa = stride(M * K), sb = stride(K * N), so = stride(M * N), sbias = stride(N);
      const auto a = rnd<T>(count * sa, 60), b = rnd<T>(count * sb, 61), bias = rnd<T>(count * sbias, 62);
      const auto init = rnd<T>(count * so, 63), pre_init = rnd<T>(count * so, 64, -3.0f, 3.0f);
      const auto da = up(a), db = up(b), dbias = up(bias);
      for (const bool ta : {false, true})
        for (const bool tb : {false, true})
          for (const bool with_bias : {false, true})
            for (const bool acc : {false, true})
              for (const bool gelu : {false, true}) {
                if (gelu && acc) continue;
                CAPTURE(ta);
                CAPTURE(tb);
                CAPTURE(with_bias);
                CAPTURE(acc);
                CAPTURE(gelu);
                const hk::Batch batch{.count = count, .out = so, .a = sa, .b = sb, .bias = sbias, .pre_act = so};
                auto ref = init, pre = pre_init;
                hk::matmul(ref.data(), a.data(), b.data(), with_bias ? bias.data() : nullptr, M, N, K, ta, tb, acc,
                           gelu ? hk::Epilogue::gelu : hk::Epilogue::none, gelu ? pre.data() : nullptr, batch);
                auto dout = up(init), dpre = up(pre_init);
                ck::matmul(lt, dout.data(), da.data(), db.data(), with_bias ? dbias.data() : nullptr, M, N, K, ta, tb,
                           acc, gelu ? ck::Epilogue::gelu : ck::Epilogue::none, gelu ? dpre.data() : nullptr, batch);
                CHECK_CLOSE(ref, down(dout), tol);
                CHECK_CLOSE(pre, down(dpre), tol);
              }
      {  // GELU's backward: dh = gelu'(pre) * dy w^T, pre the aux matrix
        const hk::Batch batch{.count = count, .out = so, .a = sa, .b = sb, .pre_act = so};
        auto ref = init;
        hk::matmul_dgelu(ref.data(), a.data(), b.data(), pre_init.data(), M, N, K, false, true, batch);
        auto dout = up(init);
        const auto dpre = up(pre_init);
        ck::matmul_dgelu(lt, dout.data(), da.data(), db.data(), dpre.data(), M, N, K, false, true, batch);
        CHECK_CLOSE(ref, down(dout), tol);
      }
      for (const bool transposed : {false, true})
        for (const bool with_bias : {true, false}) {  // dW [K, N] += x^T dy over M rows (transposed: [N, K])
          CAPTURE(transposed);
          CAPTURE(with_bias);
          const std::int64_t sdw = stride(K * N);
          const hk::WeightGradBatch batch{.count = count, .dw = sdw, .db = sbias, .dy = so, .x = sa};
          const auto dy = rnd<T>(count * so, 65), x = a;
          auto dw = rnd<T>(count * sdw, 66), dbv = rnd<T>(count * sbias, 67);
          auto d_dw = up(dw), d_db = up(dbv);
          const auto d_dy = up(dy), d_x = up(x);
          hk::matmul_weight_grad(dw.data(), with_bias ? dbv.data() : nullptr, dy.data(), x.data(), M, K, N, transposed,
                                 batch);
          ck::matmul_weight_grad(lt, d_dw.data(), with_bias ? d_db.data() : nullptr, d_dy.data(), d_x.data(), M, K, N,
                                 transposed, batch);
          CHECK_CLOSE(dw, down(d_dw), tol);
          CHECK_CLOSE(dbv, down(d_db), tol);
        }
    }
  // What ran as one call: cuBLASLt's cache holds each batched configuration it was asked for,
  // ok where it had an algorithm. The plain product (a strided batched GEMM) must have one.
  int plain = 0;
  for (const auto& [key, entry] : lt.algo_cache())
    if (key.count == count) {
      MESSAGE("batched, epilogue " << key.epilogue << (entry.ok ? ": one call" : ": one product at a time"));
      if (key.epilogue == CUBLASLT_EPILOGUE_DEFAULT && entry.ok) ++plain;
    }
  CHECK(plain > 0);
  Buffer<T, Cuda> o(4);
  CHECK_THROWS_AS(ck::matmul(lt, o.data(), o.data(), o.data(), nullptr, 2, 2, 1, false, false, false,
                             ck::Epilogue::none, nullptr, hk::Batch{.count = 0}),
                  std::invalid_argument);
}

TEST_CASE_TEMPLATE("bias_backward", T, ELEMENT_TYPES) {
  const int M = 300;
  for (const int N : {77, 96}) {  // 96: 16-byte column reads (and a partial block of columns)
    CAPTURE(N);
    const auto dout = rnd<T>(static_cast<std::size_t>(M) * N, 6);
    auto dbias = rnd<T>(N, 7);
    auto d_dout = up(dout), d_dbias = up(dbias);
    hk::bias_backward(dbias.data(), dout.data(), M, N);
    ck::bias_backward(stream(), d_dbias.data(), d_dout.data(), M, N);
    CHECK_CLOSE(dbias, down(d_dbias), bound<T>(fp32_elem * 10));  // a sum of 300 terms
  }
}

TEST_CASE_TEMPLATE("layernorm and rmsnorm, forward and backward", T, ELEMENT_TYPES) {
  // 128: the weight gradients' 16-byte column reads in bf16 too; 768 over 4099 rows: the
  // backward's single pass (rows in registers) with several rows a warp and a partial last
  // block; 1500: rows too wide for registers (read again, weight gradients by column_reduce).
  // 384 and 512: three and four pieces a lane in float; 1024: four in bf16, the single pass's
  // 64 KiB of dynamic shared memory (over the default 48 KiB: the opt-in attribute).
  for (const auto& [N, C] : {std::pair{19, 100}, std::pair{19, 128}, std::pair{4099, 768}, std::pair{37, 1500},
                             std::pair{67, 384}, std::pair{67, 512}, std::pair{129, 1024}}) {
    CAPTURE(N);
    CAPTURE(C);
    const std::size_t n = static_cast<std::size_t>(N) * C;
    const auto x = rnd<T>(n, 8, -2.0f, 2.0f), w = rnd<T>(C, 9), bias = rnd<T>(C, 10), dout = rnd<T>(n, 11);
    const double tol = bound<T>(fp32_elem * 10);
    auto dx = up(x), dw = up(w), db = up(bias), ddout = up(dout);
    {  // layernorm
      std::vector<T> out(n);
      std::vector<float> mean(N), rstd(N);
      hk::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(), N, C);
      Buffer<T, Cuda> dout_(n);
      Buffer<float, Cuda> dmean(N), drstd(N);
      ck::layernorm_forward(stream(), dout_.data(), dmean.data(), drstd.data(), dx.data(), dw.data(), db.data(), N, C);
      CHECK_CLOSE(out, down(dout_), bound<T>(fp32_elem));
      CHECK_CLOSE(mean, down(dmean), fp32_elem);
      CHECK_CLOSE(rstd, down(drstd), fp32_elem);
      auto dinp = rnd<T>(n, 12), dweight = rnd<T>(C, 13), dbias = rnd<T>(C, 14);  // "+=": start non-zero
      auto d_dinp = up(dinp), d_dweight = up(dweight), d_dbias = up(dbias);
      hk::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), x.data(), w.data(), mean.data(),
                             rstd.data(), N, C);
      ck::layernorm_backward(stream(), d_dinp.data(), d_dweight.data(), d_dbias.data(), ddout.data(), dx.data(),
                             dw.data(), dmean.data(), drstd.data(), N, C);
      CHECK_CLOSE(dinp, down(d_dinp), tol);
      CHECK_CLOSE(dweight, down(d_dweight), tol);
      CHECK_CLOSE(dbias, down(d_dbias), tol);
      // The weight gradients alone (dinp null, and the weight too, as a deferred weight-gradient
      // step passes them) add the same sums again.
      hk::layernorm_backward(static_cast<T*>(nullptr), dweight.data(), dbias.data(), dout.data(), x.data(),
                             static_cast<const T*>(nullptr), mean.data(), rstd.data(), N, C);
      ck::layernorm_backward(stream(), static_cast<T*>(nullptr), d_dweight.data(), d_dbias.data(), ddout.data(),
                             dx.data(), static_cast<const T*>(nullptr), dmean.data(), drstd.data(), N, C);
      CHECK_CLOSE(dweight, down(d_dweight), tol);
      CHECK_CLOSE(dbias, down(d_dbias), tol);
      // dinp alone (no weight gradients: the split backward's input half), added again.
      hk::layernorm_backward(dinp.data(), static_cast<T*>(nullptr), static_cast<T*>(nullptr), dout.data(), x.data(),
                             w.data(), mean.data(), rstd.data(), N, C);
      ck::layernorm_backward(stream(), d_dinp.data(), static_cast<T*>(nullptr), static_cast<T*>(nullptr), ddout.data(),
                             dx.data(), dw.data(), dmean.data(), drstd.data(), N, C);
      CHECK_CLOSE(dinp, down(d_dinp), tol);
      CHECK_CLOSE(dweight, down(d_dweight), tol);  // untouched
    }
    {  // rmsnorm
      std::vector<T> out(n);
      std::vector<float> rstd(N);
      hk::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C);
      Buffer<T, Cuda> dout_(n);
      Buffer<float, Cuda> drstd(N);
      ck::rmsnorm_forward(stream(), dout_.data(), drstd.data(), dx.data(), dw.data(), N, C);
      CHECK_CLOSE(out, down(dout_), bound<T>(fp32_elem));
      CHECK_CLOSE(rstd, down(drstd), fp32_elem);
      auto dinp = rnd<T>(n, 15), dweight = rnd<T>(C, 16);
      auto d_dinp = up(dinp), d_dweight = up(dweight);
      hk::rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
      ck::rmsnorm_backward(stream(), d_dinp.data(), d_dweight.data(), ddout.data(), dx.data(), dw.data(), drstd.data(),
                           N, C);
      CHECK_CLOSE(dinp, down(d_dinp), tol);
      CHECK_CLOSE(dweight, down(d_dweight), tol);
    }
  }
}

// The residual add fused into the norm after it: the same bits as residual_forward then the
// norm (the sum rounded to T once, the norm reading the rounded sum), in place (res = a) too.
TEST_CASE_TEMPLATE("residual add fused into layernorm and rmsnorm forward", T, ELEMENT_TYPES) {
  for (const auto& [N, C] : {std::pair{19, 100}, std::pair{4099, 768}, std::pair{37, 1500}}) {
    CAPTURE(N);
    CAPTURE(C);
    const std::size_t n = static_cast<std::size_t>(N) * C;
    const auto a = rnd<T>(n, 40, -2.0f, 2.0f), b = rnd<T>(n, 41, -2.0f, 2.0f), w = rnd<T>(C, 42), bias = rnd<T>(C, 43);
    const auto da = up(a), db = up(b), dw = up(w), dbias = up(bias);
    Buffer<T, Cuda> res(n), out(n), res2(n), out2(n);
    Buffer<float, Cuda> mean(N), rstd(N), mean2(N), rstd2(N);
    {  // layernorm
      std::vector<T> hres(n), hout(n);
      std::vector<float> hmean(N), hrstd(N);
      hk::residual_layernorm_forward(hres.data(), hout.data(), hmean.data(), hrstd.data(), a.data(), b.data(), w.data(),
                                     bias.data(), N, C);
      ck::residual_layernorm_forward(stream(), res.data(), out.data(), mean.data(), rstd.data(), da.data(), db.data(),
                                     dw.data(), dbias.data(), N, C);
      CHECK_CLOSE(hres, down(res), bound<T>(fp32_elem));
      CHECK_CLOSE(hout, down(out), bound<T>(fp32_elem));
      CHECK_CLOSE(hmean, down(mean), fp32_elem);
      ck::residual_forward(stream(), res2.data(), da.data(), db.data(), n);
      ck::layernorm_forward(stream(), out2.data(), mean2.data(), rstd2.data(), res2.data(), dw.data(), dbias.data(), N, C);
      CHECK(down(res) == down(res2));
      CHECK(down(out) == down(out2));
      CHECK(down(mean) == down(mean2));
      CHECK(down(rstd) == down(rstd2));
      auto inplace = up(a);  // res = a
      ck::residual_layernorm_forward(stream(), inplace.data(), out2.data(), mean2.data(), rstd2.data(), inplace.data(),
                                     db.data(), dw.data(), dbias.data(), N, C);
      CHECK(down(inplace) == down(res));
      CHECK(down(out2) == down(out));
    }
    {  // rmsnorm
      std::vector<T> hres(n), hout(n);
      std::vector<float> hrstd(N);
      hk::residual_rmsnorm_forward(hres.data(), hout.data(), hrstd.data(), a.data(), b.data(), w.data(), N, C);
      ck::residual_rmsnorm_forward(stream(), res.data(), out.data(), rstd.data(), da.data(), db.data(), dw.data(), N, C);
      CHECK_CLOSE(hres, down(res), bound<T>(fp32_elem));
      CHECK_CLOSE(hout, down(out), bound<T>(fp32_elem));
      CHECK_CLOSE(hrstd, down(rstd), fp32_elem);
      ck::residual_forward(stream(), res2.data(), da.data(), db.data(), n);
      ck::rmsnorm_forward(stream(), out2.data(), rstd2.data(), res2.data(), dw.data(), N, C);
      CHECK(down(res) == down(res2));
      CHECK(down(out) == down(out2));
      CHECK(down(rstd) == down(rstd2));
      auto inplace = up(b);  // res = b
      ck::residual_rmsnorm_forward(stream(), inplace.data(), out2.data(), rstd2.data(), da.data(), inplace.data(),
                                   dw.data(), N, C);
      CHECK(down(inplace) == down(res));
      CHECK(down(out2) == down(out));
    }
  }
}

TEST_CASE_TEMPLATE("swiglu and rotary positions with grouped query heads, forward and backward", T, ELEMENT_TYPES) {
  {  // swiglu
    const int N = 17, F = 40;
    const std::size_t n = static_cast<std::size_t>(N) * F;
    const auto gu = rnd<T>(2 * n, 30, -3.0f, 3.0f), dh = rnd<T>(n, 31);
    std::vector<T> h(n), dgu(2 * n);
    hk::swiglu_forward(h.data(), gu.data(), N, F);
    hk::swiglu_backward(dgu.data(), dh.data(), gu.data(), N, F);
    auto d_gu = up(gu), d_dh = up(dh);
    Buffer<T, Cuda> d_h(n), d_dgu(2 * n);
    ck::swiglu_forward(stream(), d_h.data(), d_gu.data(), N, F);
    ck::swiglu_backward(stream(), d_dgu.data(), d_dh.data(), d_gu.data(), N, F);
    CHECK_CLOSE(h, down(d_h), bound<T>(fp32_elem));
    CHECK_CLOSE(dgu, down(d_dgu), bound<T>(fp32_elem));
  }
  {  // rotary, in place: two zig-zag chunks of 3 sequences of 5 rows, 6 query heads over 2 key/value heads
    const int N = 30, H = 6, KV = 2, hd = 8;
    const fived::RowPositions pos{15, 5, {5, 20}};
    const std::size_t qkv_n = static_cast<std::size_t>(N) * (H + 2 * KV) * hd;
    auto qkv = rnd<T>(qkv_n, 32), dqkv = rnd<T>(qkv_n, 33);
    const std::vector<float> inv_freq{1.0f, 0.1f, 0.01f, 0.001f};
    auto d_qkv = up(qkv), d_dqkv = up(dqkv);
    auto d_freq = up(inv_freq);
    hk::rotary_forward(qkv.data(), inv_freq.data(), N, H, KV, hd, pos);
    hk::rotary_backward(dqkv.data(), inv_freq.data(), N, H, KV, hd, pos);
    ck::rotary_forward(stream(), d_qkv.data(), d_freq.data(), N, H, KV, hd, pos);
    ck::rotary_backward(stream(), d_dqkv.data(), d_freq.data(), N, H, KV, hd, pos);
    CHECK_CLOSE(qkv, down(d_qkv), bound<T>(fp32_elem));
    CHECK_CLOSE(dqkv, down(d_dqkv), bound<T>(fp32_elem));
  }
}

TEST_CASE_TEMPLATE("gelu and residual", T, ELEMENT_TYPES) {
  const std::size_t n = 1003;
  const auto y = rnd<T>(n, 18), dout = rnd<T>(n, 19);
  auto dy = up(y);
  std::vector<T> out(n), dinp(n);
  Buffer<T, Cuda> d_out(n);
  // |x| up to 40 as well: the kernels' exponential overflows (and is clamped) past about -11
  for (const float range : {4.0f, 40.0f}) {
    CAPTURE(range);
    const auto x = rnd<T>(n, 17, -range, range);
    auto dx = up(x), ddout = up(dout);
    hk::gelu_forward(out.data(), x.data(), n);
    ck::gelu_forward(stream(), d_out.data(), dx.data(), n);
    CHECK_CLOSE(out, down(d_out), bound<T>(fp32_elem));
    hk::gelu_backward(dinp.data(), x.data(), dout.data(), n);
    ck::gelu_backward(stream(), ddout.data(), dx.data(), ddout.data(), n);  // dinp aliases dout
    CHECK_CLOSE(dinp, down(ddout), bound<T>(fp32_elem));
  }
  const auto x = rnd<T>(n, 17, -4.0f, 4.0f);
  auto dx = up(x);
  hk::residual_forward(out.data(), x.data(), y.data(), n);
  ck::residual_forward(stream(), d_out.data(), dx.data(), dy.data(), n);
  CHECK_CLOSE(out, down(d_out), bound<T>(fp32_elem));

  // the accumulators' add and scale (float on both sides: the same bits)
  const auto a = rnd<float>(n, 20), b = rnd<float>(n, 21);
  std::vector<float> sum = a, scaled(n);
  hk::add_acc(sum.data(), b.data(), n);
  auto d_sum = up(a), d_b = up(b);
  Buffer<float, Cuda> d_scaled(n);
  ck::add_acc(stream(), d_sum.data(), d_b.data(), n);
  ck::scale_acc(stream(), d_scaled.data(), d_sum.data(), n, 0.37);
  CHECK(down(d_sum) == sum);
  hk::scale_acc(scaled.data(), sum.data(), n, 0.37);
  CHECK(down(d_scaled) == scaled);
}

TEST_CASE_TEMPLATE("regroup: split and join move the same elements as the host's", T, ELEMENT_TYPES) {
  struct Shape {
    long long outer;
    int n;
    long long block;
  };
  // A pure copy, so the results are equal, not close. Blocks of one element, pieces
  // of one block, a single row, and sizes that do not fill the last thread block.
  for (const Shape s : {Shape{6, 4, 33}, Shape{1, 4, 33}, Shape{7, 1, 5}, Shape{300, 3, 1}, Shape{5, 8, 257}}) {
    CAPTURE(s.outer);
    CAPTURE(s.n);
    CAPTURE(s.block);
    const std::size_t size = static_cast<std::size_t>(s.outer * s.n * s.block);
    const auto x = rnd<T>(size, 21);
    std::vector<T> split(size), joined(size);
    hk::regroup(split.data(), x.data(), s.outer, s.n, s.block, hk::Blocks::split);
    hk::regroup(joined.data(), x.data(), s.outer, s.n, s.block, hk::Blocks::join);
    auto d_x = up(x);
    Buffer<T, Cuda> d_split(size), d_joined(size), d_back(size);
    ck::regroup(stream(), d_split.data(), d_x.data(), s.outer, s.n, s.block, ck::Blocks::split);
    ck::regroup(stream(), d_joined.data(), d_x.data(), s.outer, s.n, s.block, ck::Blocks::join);
    ck::regroup(stream(), d_back.data(), d_split.data(), s.outer, s.n, s.block, ck::Blocks::join);
    CHECK(down(d_split) == split);
    CHECK(down(d_joined) == joined);
    CHECK(down(d_back) == x);
  }
  Buffer<T, Cuda> b(8);
  CHECK_THROWS_AS(ck::regroup(stream(), b.data(), b.data(), 2, 0, 4, ck::Blocks::split), std::invalid_argument);
}

TEST_CASE_TEMPLATE("embedding forward and backward (repeated tokens)", T, ELEMENT_TYPES) {
  const int B = 3, Tn = 7, V = 11;
  // 40: 16-byte accesses (both types); 38: one element a thread; 520: three 16-byte pieces a
  // lane of bf16 (the last held by one lane), of float in two chunks of three
  for (const int C : {40, 38, 520}) {
    CAPTURE(C);
    std::vector<int> tokens(B * Tn);
    for (int i = 0; i < B * Tn; ++i) tokens[i] = (i * 7 + 3) % V % 5 + (i % 3 == 0 ? 6 : 0);  // repeats, ids < V
    const auto wte = rnd<T>(static_cast<std::size_t>(V) * C, 20), wpe = rnd<T>(static_cast<std::size_t>(Tn) * C, 21);
    const auto dout = rnd<T>(static_cast<std::size_t>(B) * Tn * C, 22);
    auto dtok = up(tokens);
    auto dwte_in = up(wte), dwpe_in = up(wpe), ddout = up(dout);
    std::vector<T> out(dout.size());
    Buffer<T, Cuda> d_out(dout.size());
    hk::embedding_forward(out.data(), tokens.data(), wte.data(), 0, V, wpe.data(), B, Tn, C);
    ck::embedding_forward(stream(), d_out.data(), dtok.data(), dwte_in.data(), 0, V, dwpe_in.data(), B, Tn, C);
    CHECK_CLOSE(out, down(d_out), bound<T>(fp32_elem));
    auto dwte = rnd<T>(wte.size(), 23), dwpe = rnd<T>(wpe.size(), 24);
    auto d_dwte = up(dwte), d_dwpe = up(dwpe);
    hk::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, Tn, C, 0, V);
    ck::embedding_backward(stream(), d_dwte.data(), d_dwpe.data(), ddout.data(), dtok.data(), B, Tn, C, 0, V);
    CHECK_CLOSE(dwte, down(d_dwte), bound<T>(fp32_elem));
    CHECK_CLOSE(dwpe, down(d_dwpe), bound<T>(fp32_elem));

    // A vocabulary shard, rows [3, V) of the table, without positions (vocab-parallel
    // embedding on a rank that does not add them): out-of-range ids give 0 rows in the
    // forward and add nothing to the shard's gradient.
    const int vb = 3, vr = V - vb;
    const std::vector<T> shard(wte.begin() + static_cast<std::ptrdiff_t>(vb) * C, wte.end());
    auto dshard_in = up(shard);
    hk::embedding_forward(out.data(), tokens.data(), shard.data(), vb, vr, static_cast<const T*>(nullptr), B, Tn, C);
    ck::embedding_forward(stream(), d_out.data(), dtok.data(), dshard_in.data(), vb, vr, static_cast<const T*>(nullptr),
                          B, Tn, C);
    CHECK(down(d_out) == out);  // copies and zeros only: exact
    auto dshard = rnd<T>(shard.size(), 26);
    auto d_dshard = up(dshard);
    hk::embedding_backward(dshard.data(), static_cast<T*>(nullptr), dout.data(), tokens.data(), B, Tn, C, vb, vr);
    ck::embedding_backward(stream(), d_dshard.data(), static_cast<T*>(nullptr), ddout.data(), dtok.data(), B, Tn, C, vb,
                           vr);
    CHECK_CLOSE(dshard, down(d_dshard), bound<T>(fp32_elem));
  }
}

// Real text repeats a few tokens hundreds of times in a batch. A row's positions up to
// embedding_short_run are summed by one warp; a longer run by a block, in parts. Two batches:
// - text-like: runs of 1, 2, 8 (the longest a warp takes), 9 (the shortest a block takes), 32,
//   33, 520 and ~1,640 (more than the block's 512 threads look at in one go, and parts longer
//   than a warp's 32 positions), and distinct ids;
// - many runs: 340 ids of 9 positions each, more long runs than the blocks launched for them
//   (two an SM: a block takes several in turn), and the highest id's run of 12 last among the
//   sorted rows.
// Each against the host, row by row (a normwise error would let a short row's slip hide under
// the long rows' large sums in bf16), and twice from the same start to the same bits. Then a
// vocabulary shard that leaves out id 0, and a batch too small for any long run.
TEST_CASE_TEMPLATE("embedding backward: runs of a frequent token, a block each", T, ELEMENT_TYPES) {
  const int B = 6, Tn = 512, n = B * Tn, V = 1200;
  std::vector<int> text(n), others;
  for (int i = 0; i < n; ++i)  // id 0 at 8 positions in 15
    if (i % 15 < 8)
      text[i] = 0;
    else
      others.push_back(i);
  std::vector<int> ids;  // what the other positions get: runs of given lengths, then distinct ids
  const int runs[][2] = {{1, 520}, {2, 9}, {3, 33}, {4, 32}, {5, 8}, {6, 1}, {7, 2}};
  for (const auto& r : runs) ids.insert(ids.end(), static_cast<std::size_t>(r[1]), r[0]);
  for (int id = 8; ids.size() < others.size(); ++id) ids.push_back(id);
  REQUIRE(ids.back() < V);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
  for (std::size_t k = 0; k < others.size(); ++k) text[others[k]] = ids[k];
  CHECK(std::count(text.begin(), text.end(), 0) > 1536);
  std::vector<int> many;
  for (int id = 1; id <= 340; ++id) many.insert(many.end(), 9, id);
  many.insert(many.end(), static_cast<std::size_t>(n) - many.size(), V - 1);
  REQUIRE(many.size() == static_cast<std::size_t>(n));
  std::shuffle(many.begin(), many.end(), std::mt19937(8));

  // The worst relative error of a row of the table (each row's own scale).
  auto row_error = [](const std::vector<T>& ref, const std::vector<T>& got, int C) {
    double worst = 0;
    const std::size_t w = static_cast<std::size_t>(C);
    for (std::size_t at = 0; at < ref.size(); at += w)
      worst = std::max(worst, fived::test::max_rel_error(got, ref, at, w));
    return worst;
  };
  for (const std::vector<int>* tokens : {&text, &many}) {
    CAPTURE(tokens == &text ? "text-like" : "many runs");
    auto dtok = up(*tokens);
    for (const int C : {40, 38, 520}) {
      CAPTURE(C);
      const auto dout = rnd<T>(static_cast<std::size_t>(n) * C, 30);
      const auto dwte = rnd<T>(static_cast<std::size_t>(V) * C, 31);
      const auto dwpe = rnd<T>(static_cast<std::size_t>(Tn) * C, 32);
      auto ddout = up(dout);
      auto backward = [&](int vb) {
        CAPTURE(vb);
        std::vector<T> ref(dwte.begin() + static_cast<std::ptrdiff_t>(vb) * C, dwte.end()), ref_pe = dwpe;
        hk::embedding_backward(ref.data(), ref_pe.data(), dout.data(), tokens->data(), B, Tn, C, vb, V - vb);
        const std::vector<T> start(dwte.begin() + static_cast<std::ptrdiff_t>(vb) * C, dwte.end());
        auto d1 = up(start), d2 = up(start), d_pe = up(dwpe);
        ck::embedding_backward(stream(), d1.data(), d_pe.data(), ddout.data(), dtok.data(), B, Tn, C, vb, V - vb);
        ck::embedding_backward(stream(), d2.data(), static_cast<T*>(nullptr), ddout.data(), dtok.data(), B, Tn, C, vb,
                               V - vb);
        const std::vector<T> got = down(d1);
        const double e = row_error(ref, got, C);
        INFO("worst row's relative error " << e);
        CHECK(e <= bound<T>(fp32_sum));
        CHECK_CLOSE(ref_pe, down(d_pe), bound<T>(fp32_sum));
        CHECK(std::memcmp(got.data(), down(d2).data(), got.size() * sizeof(T)) == 0);
      };
      backward(0);
      backward(1);  // rows [1, V): id 0 is another rank's
    }
  }
  // Five positions, one id: a run a warp takes, where the batch is too small for a long one.
  const std::vector<int> same(5, 3);
  const auto dout = rnd<T>(5 * 16, 33), table = rnd<T>(static_cast<std::size_t>(V) * 16, 34);
  std::vector<T> ref = table;
  hk::embedding_backward(ref.data(), static_cast<T*>(nullptr), dout.data(), same.data(), 1, 5, 16, 0, V);
  auto d_same = up(same);
  auto d_dout = up(dout), d_table = up(table);
  ck::embedding_backward(stream(), d_table.data(), static_cast<T*>(nullptr), d_dout.data(), d_same.data(), 1, 5, 16, 0,
                         V);
  CHECK_CLOSE(ref, down(d_table), bound<T>(fp32_elem));
}

TEST_CASE_TEMPLATE("cross-entropy: vocab shards with padding, and the fused convenience", T, ELEMENT_TYPES) {
  const int N = 5, Vp = 68, V = 60, shards = 2, Vs = Vp / shards;  // shard 1 holds the padding columns
  const float dloss = 1.0f / N;
  const auto logits = rnd<T>(static_cast<std::size_t>(N) * Vp, 25, -4.0f, 4.0f);
  const std::vector<int> targets = {0, 59, 33, 34, 17};
  auto dtargets = up(targets);
  const double tol = bound<T>(fp32_elem);

  // Each shard's columns as its own [N, Vs] array; the "all-reduces" are done on the host.
  std::vector<std::vector<T>> part(shards, std::vector<T>(static_cast<std::size_t>(N) * Vs));
  for (int s = 0; s < shards; ++s)
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < Vs; ++j) part[s][i * Vs + j] = logits[i * Vp + s * Vs + j];
  std::vector<float> gmax(N, -INFINITY), gsum(N, 0.0f), gtl(N, 0.0f);
  std::vector<std::vector<float>> hmax(shards, std::vector<float>(N));
  for (int s = 0; s < shards; ++s) {
    auto dl = up(part[s]);
    Buffer<float, Cuda> dmax(N);
    hk::logits_max(hmax[s].data(), part[s].data(), N, Vs, s * Vs, V);
    ck::logits_max(stream(), dmax.data(), dl.data(), N, Vs, s * Vs, V);
    CHECK(down(dmax) == hmax[s]);  // a max is exact
    for (int i = 0; i < N; ++i) gmax[i] = std::max(gmax[i], hmax[s][i]);
  }
  auto dgmax = up(gmax);
  for (int s = 0; s < shards; ++s) {
    auto dl = up(part[s]);
    std::vector<float> se(N), tl(N);
    Buffer<float, Cuda> dse(N), dtl(N);
    hk::crossentropy_partials(se.data(), tl.data(), part[s].data(), targets.data(), gmax.data(), N, Vs, s * Vs, V);
    ck::crossentropy_partials(stream(), dse.data(), dtl.data(), dl.data(), dtargets.data(), dgmax.data(), N, Vs, s * Vs,
                              V);
    CHECK_CLOSE(se, down(dse), fp32_elem);
    CHECK(down(dtl) == tl);
    for (int i = 0; i < N; ++i) {
      gsum[i] += se[i];
      gtl[i] += tl[i];
    }
  }
  auto dgsum = up(gsum), dgtl = up(gtl);
  for (int s = 0; s < shards; ++s) {
    auto dl = up(part[s]);
    std::vector<float> loss(N);
    std::vector<T> dlog(part[s].size());
    Buffer<float, Cuda> dloss_(N);
    hk::crossentropy_backward(loss.data(), dlog.data(), part[s].data(), targets.data(), gmax.data(), gsum.data(),
                              gtl.data(), N, Vs, s * Vs, V, dloss);
    ck::crossentropy_backward(stream(), dloss_.data(), dl.data(), dl.data(), dtargets.data(), dgmax.data(),
                              dgsum.data(), dgtl.data(), N, Vs, s * Vs, V, dloss);  // in place
    CHECK_CLOSE(loss, down(dloss_), fp32_elem);
    CHECK_CLOSE(dlog, down(dl), tol);
  }
  {  // single shard, fused
    std::vector<float> loss(N);
    std::vector<T> dlog(logits.size());
    auto dl = up(logits);
    Buffer<float, Cuda> dloss_(N);
    hk::crossentropy_forward_backward(loss.data(), dlog.data(), logits.data(), targets.data(), N, Vp, V, dloss);
    ck::crossentropy_forward_backward(stream(), dloss_.data(), dl.data(), dl.data(), dtargets.data(), N, Vp, V, dloss);
    CHECK_CLOSE(loss, down(dloss_), fp32_elem);
    CHECK_CLOSE(dlog, down(dl), tol);
  }
}

// The one-kernel loss of an unsplit vocabulary: its statistics (max exact, the target's logit
// exact, sum of exp), losses and in-place gradient against the host's three steps; rows of
// 16-byte multiples and not (the three kernels: Vp 1004 in bf16, 1001 in both). Of the 16-byte
// rows, those that leave room for two blocks an SM are staged in shared memory (1040, and GPT-2's
// 50,304 in bf16: a thread's pieces in two cp.async groups), wider ones (131,072; 50,304 in
// float) read twice. Then each output alone: the loss (an evaluation), the gradient.
TEST_CASE_TEMPLATE("cross-entropy fused with its statistics", T, ELEMENT_TYPES) {
  for (const int Vp : {1040, 1004, 1001, 50304, 131072}) {
    CAPTURE(Vp);
    const int N = 7, V = Vp == 1004 ? 1000 : Vp - 40;
    if (Vp % 8 == 0 && ck::detail::device_is_sm80_or_later()) {
      const bool staged = ck::detail::staged_row_bytes<ck::device_t<T>>(Vp) > 0;
      MESSAGE("Vp " << Vp << (staged ? ": the row staged in shared memory" : ": the row read twice"));
      if (Vp == 1040 || (Vp == 50304 && sizeof(T) == 2)) CHECK(staged);
      if (Vp == 131072) CHECK_FALSE(staged);
    }
    const auto logits = rnd<T>(static_cast<std::size_t>(N) * Vp, 36, -6.0f, 6.0f);
    const std::vector<int> targets = {0, V - 1, V / 2, 7, 8, V * 5 / 8, 100};
    std::vector<float> loss(N), mx(N), se(N), tl(N);
    std::vector<T> dlog(logits.size());
    hk::crossentropy_fused(loss.data(), dlog.data(), mx.data(), se.data(), tl.data(), logits.data(), targets.data(), N,
                           Vp, V, 1.0 / N);
    auto dl = up(logits);
    auto dtargets = up(targets);
    Buffer<float, Cuda> dloss(N), dmx(N), dse(N), dtl(N);
    ck::crossentropy_fused(stream(), dloss.data(), dl.data(), dmx.data(), dse.data(), dtl.data(), dl.data(),
                           dtargets.data(), N, Vp, V, 1.0 / N);  // in place
    CHECK(down(dmx) == mx);
    CHECK(down(dtl) == tl);
    // The sum of exp and the loss against the exact values (double), not the host's: the host
    // adds up to 131,032 exps one after another in float, and once the sum nears 10^4 the
    // smallest terms round away (2e-4 low at that width; the device's tree of sums is close).
    std::vector<double> se_exact(N), loss_exact(N);
    for (int r = 0; r < N; ++r) {
      double sum = 0;
      for (int j = 0; j < V; ++j) sum += std::exp(double(float(logits[static_cast<std::size_t>(r) * Vp + j])) - mx[r]);
      se_exact[r] = sum, loss_exact[r] = std::log(sum) + mx[r] - tl[r];
    }
    CHECK_CLOSE(se_exact, down(dse), fp32_elem);
    CHECK_CLOSE(loss_exact, down(dloss), fp32_elem);
    CHECK_CLOSE(loss_exact, loss, fp32_sum);  // the host's, for comparison
    CHECK_CLOSE(dlog, down(dl), bound<T>(fp32_elem));

    auto dl_kept = up(logits);
    Buffer<float, Cuda> loss_only(N);
    ck::crossentropy_fused(stream(), loss_only.data(), static_cast<T*>(nullptr), static_cast<float*>(nullptr),
                           static_cast<float*>(nullptr), static_cast<float*>(nullptr), dl_kept.data(), dtargets.data(),
                           N, Vp, V, 1.0 / N);
    CHECK(down(loss_only) == down(dloss));
    CHECK(down(dl_kept) == logits);  // read only
    auto dl_grad_only = up(logits);
    ck::crossentropy_fused(stream(), static_cast<float*>(nullptr), dl_grad_only.data(), static_cast<float*>(nullptr),
                           static_cast<float*>(nullptr), static_cast<float*>(nullptr), dl_grad_only.data(),
                           dtargets.data(), N, Vp, V, 1.0 / N);
    CHECK(down(dl_grad_only) == down(dl));
  }
}

// One AdamW state of n elements from seed: fp32 masters and moments, T gradients, T(master)
// parameters, the initial values kept, a host copy to update and a device one.
template <class T>
struct AdamWCase {
  std::size_t n;
  std::vector<float> master0, m0, v0;
  std::vector<T> grad, param0;
  std::vector<float> master = master0, m = m0, v = v0;  // the host's, updated by the test
  std::vector<T> param = param0;
  Buffer<T, Cuda> dparam = up(param0), dgrad = up(grad);
  Buffer<float, Cuda> dmaster = up(master0), dm = up(m0), dv = up(v0);

  AdamWCase(std::size_t n_, unsigned seed)
      : n(n_), master0(rnd<float>(n, seed)), m0(rnd<float>(n, seed + 1, -0.1f, 0.1f)),
        v0(rnd<float>(n, seed + 2, 0.01f, 0.2f)), grad(rnd<T>(n, seed + 3)), param0(parameters(master0)) {}
  static std::vector<T> parameters(const std::vector<float>& master) {
    std::vector<T> p(master.size());
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = T(master[i]);
    return p;
  }
  // The device's state against the host's.
  void check() const {
    CHECK_CLOSE(master, down(dmaster), fp32_elem);
    CHECK_CLOSE(m, down(dm), fp32_elem);
    CHECK_CLOSE(v, down(dv), fp32_elem);
    CHECK_CLOSE(param, down(dparam), bound<T>(fp32_elem));
  }
};

TEST_CASE_TEMPLATE("AdamW with fp32 master weights", T, ELEMENT_TYPES) {
  AdamWCase<T> c(2049, 26);
  const std::size_t n = c.n;
  hk::adamw_update(c.param.data(), c.master.data(), c.grad.data(), c.m.data(), c.v.data(), n, 1e-3f, 0.9f, 0.95f,
                   1e-8f, 0.1f, 3);
  ck::adamw_update(stream(), c.dparam.data(), c.dmaster.data(), c.dgrad.data(), c.dm.data(), c.dv.data(), n, 1e-3f,
                   0.9f, 0.95f, 1e-8f, 0.1f, 3);
  c.check();
  if constexpr (std::is_same_v<T, float>) {  // no master: the update on param itself
    auto p2 = c.master0, m2 = c.m0, v2 = c.v0;
    auto dp2 = up(p2), dm2 = up(m2), dv2 = up(v2);
    hk::adamw_update(p2.data(), nullptr, c.grad.data(), m2.data(), v2.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1);
    ck::adamw_update(stream(), dp2.data(), nullptr, c.dgrad.data(), dm2.data(), dv2.data(), n, 1e-3f, 0.9f, 0.95f,
                     1e-8f, 0.1f, 1);
    CHECK_CLOSE(p2, down(dp2), fp32_elem);
  } else {
    CHECK_THROWS_AS(ck::adamw_update(stream(), c.dparam.data(), nullptr, c.dgrad.data(), c.dm.data(), c.dv.data(), n,
                                     1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1),
                    std::invalid_argument);
  }
}

TEST_CASE_TEMPLATE("AdamW over chunks: a block per chunk, each with its decay, the gradients scaled as read", T,
                   ELEMENT_TYPES) {
  // Three tensors (decay on the middle one), the long one cut into two chunks and a piece.
  struct Tensor {
    std::size_t offset, size;
    bool decay;
    std::size_t end() const { return offset + size; }
    bool decays() const { return decay; }
  };
  constexpr std::size_t M = fived::AdamWChunk::max_elements;
  const std::vector<Tensor> tensors = {{0, 300, false}, {300, 2 * M + 77, true}, {2 * M + 377, 5, false}};
  AdamWCase<T> c(2 * M + 382, 32);
  const auto chunks = fived::adamw_chunks(tensors, fived::FlatRange{0, c.n});
  REQUIRE(chunks.size() == 5);
  auto dchunks = up(chunks);
  // The clip factor, computed by the kernel from the squared norm in device memory.
  const double total = 7.3, max_norm = 1.0;
  const double f = hk::clip_factor(total, max_norm);
  REQUIRE(f < 0.5);
  auto dtotal = up(std::vector<double>{total});
  // Step 4's learning rate and bias corrections, in device memory for the device's kernel.
  const fived::AdamWStep at = fived::AdamWStep::at(4, 1e-3, 0.9, 0.95);
  auto dat = up(std::vector<fived::AdamWStep>{at});
  hk::adamw_update_chunks(c.param.data(), c.master.data(), c.grad.data(), c.m.data(), c.v.data(), chunks.data(),
                          chunks.size(), &at, 0.9, 0.95, 1e-8, 0.1, fived::GradClip{&total, max_norm});
  ck::adamw_update_chunks(stream(), c.dparam.data(), c.dmaster.data(), c.dgrad.data(), c.dm.data(), c.dv.data(),
                          dchunks.data(), chunks.size(), dat.data(), 0.9, 0.95, 1e-8, 0.1,
                          fived::GradClip{dtotal.data(), max_norm});
  c.check();
  // The decay reached the middle tensor only: without it the first tensor's masters are the same.
  auto m_no = c.m0, v_no = c.v0, master_no = c.master0;
  auto p_no = c.param0;
  hk::adamw_update(p_no.data(), master_no.data(), c.grad.data(), m_no.data(), v_no.data(), 300, 1e-3, 0.9, 0.95, 1e-8,
                   0.0, 4, f);
  for (std::size_t i = 0; i < 300; ++i) CHECK(master_no[i] == c.master[i]);
  if constexpr (std::is_same_v<T, float>) {  // no masters: the update on the parameters themselves
    auto p2 = c.master0, m2 = c.m0, v2 = c.v0;
    auto dp2 = up(p2), dm2 = up(m2), dv2 = up(v2);
    hk::adamw_update_chunks(p2.data(), static_cast<float*>(nullptr), c.grad.data(), m2.data(), v2.data(),
                            chunks.data(), chunks.size(), &at, 0.9, 0.95, 1e-8, 0.1,
                            fived::GradClip{&total, max_norm});
    ck::adamw_update_chunks(stream(), dp2.data(), static_cast<float*>(nullptr), c.dgrad.data(), dm2.data(),
                            dv2.data(), dchunks.data(), chunks.size(), dat.data(), 0.9, 0.95, 1e-8, 0.1,
                            fived::GradClip{dtotal.data(), max_norm});
    CHECK_CLOSE(p2, down(dp2), fp32_elem);
    CHECK_CLOSE(m2, down(dm2), fp32_elem);
    CHECK_CLOSE(v2, down(dv2), fp32_elem);
  }
  // skip_non_finite: a squared norm that is not finite leaves parameters, masters and moments
  // as they were (every block reads it and leaves).
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    const auto param = down(c.dparam);
    const auto master = down(c.dmaster), m = down(c.dm), v = down(c.dv);
    auto dbad = up(std::vector<double>{bad});
    ck::adamw_update_chunks(stream(), c.dparam.data(), c.dmaster.data(), c.dgrad.data(), c.dm.data(), c.dv.data(),
                            dchunks.data(), chunks.size(), dat.data(), 0.9, 0.95, 1e-8, 0.1,
                            fived::GradClip{dbad.data(), max_norm, true});
    CHECK(down(c.dparam) == param);
    CHECK(down(c.dmaster) == master);
    CHECK(down(c.dm) == m);
    CHECK(down(c.dv) == v);
  }
}

TEST_CASE_TEMPLATE("AdamW over chunks whose parameters and gradients lie elsewhere (a ZeRO rank's packed pieces)", T,
                   ELEMENT_TYPES) {
  // The state (masters, moments) at the chunks' offsets; the parameters P and the gradients G
  // elements further on in their arrays, padding before them: the host's and the device's
  // updates agree, and the padding stays.
  AdamWCase<T> c(3000, 41);
  constexpr std::ptrdiff_t P = 37, G = 5;
  std::vector<T> param(c.n + P, T(0.75f)), grad(c.n + G, T(0.0f));  // padding inside the parameters' range
  std::copy(c.param0.begin(), c.param0.end(), param.begin() + P);
  std::copy(c.grad.begin(), c.grad.end(), grad.begin() + G);
  const std::vector<fived::AdamWChunk> chunks = {{0, 1000, true, P, G}, {1000, 2048, false, P, G}, {2048, 3000, true, P, G}};
  auto dparam = up(param), dgrad = up(grad);
  auto dchunks = up(chunks);
  const fived::AdamWStep at = fived::AdamWStep::at(2, 1e-3, 0.9, 0.95);
  auto dat = up(std::vector<fived::AdamWStep>{at});
  hk::adamw_update_chunks(param.data(), c.master.data(), grad.data(), c.m.data(), c.v.data(), chunks.data(),
                          chunks.size(), &at, 0.9, 0.95, 1e-8, 0.1, fived::GradClip{});
  ck::adamw_update_chunks(stream(), dparam.data(), c.dmaster.data(), dgrad.data(), c.dm.data(), c.dv.data(),
                          dchunks.data(), chunks.size(), dat.data(), 0.9, 0.95, 1e-8, 0.1, fived::GradClip{});
  CHECK_CLOSE(c.master, down(c.dmaster), fp32_elem);
  CHECK_CLOSE(c.m, down(c.dm), fp32_elem);
  CHECK_CLOSE(c.v, down(c.dv), fp32_elem);
  const std::vector<T> got = down(dparam);
  CHECK_CLOSE(param, got, bound<T>(fp32_elem));
  for (std::ptrdiff_t i = 0; i < P; ++i) CHECK(float(got[static_cast<std::size_t>(i)]) == 0.75f);
  // The step moved the parameters (one step of lr 1e-3 moves a bf16 one only where its master
  // crosses a rounding midpoint: about a fifth of them here).
  CHECK(std::vector<T>(param.begin() + P, param.end()) != c.param0);
}

TEST_CASE_TEMPLATE("gradient norm of one array, accumulated; scale", T, ELEMENT_TYPES) {
  const std::size_t n = 300001;
  const auto g1 = rnd<T>(n, 30), g2 = rnd<T>(777, 31);
  auto d1 = up(g1), d2 = up(g2);
  Buffer<float, Cuda> total(1);
  ck::sum_of_squares(stream(), total.data(), d1.data(), n);
  ck::sum_of_squares(stream(), total.data(), d2.data(), g2.size());  // accumulates
  const double ref = hk::sum_of_squares(g1.data(), n) + hk::sum_of_squares(g2.data(), g2.size());
  const float got = down(total)[0];
  CHECK(std::fabs(got - ref) / ref <= 1e-5);
  const double f = hk::clip_factor(ref, 1.0);
  auto h1 = g1;
  hk::scale(h1.data(), n, f);
  ck::scale(stream(), d1.data(), n, f);
  CHECK_CLOSE(h1, down(d1), bound<T>(fp32_elem));
}

TEST_CASE_TEMPLATE("gradient norm over chunks: a block per chunk, the sum in order, written to a double", T,
                   ELEMENT_TYPES) {
  // Chunks as a trainer cuts them: whole ones of max_elements, pieces that start unaligned
  // (16-byte loads only where a chunk starts aligned), one element, out of order.
  constexpr std::size_t M = fived::SquaresChunk::max_elements;
  const std::size_t n = 3 * M + 1001;
  const auto g = rnd<T>(n, 33);
  auto dg = up(g);
  const std::vector<fived::SquaresChunk> chunks = {{0, M}, {M, 2 * M}, {2 * M + 3, 3 * M}, {3 * M + 1, 3 * M + 2},
                                                   {3 * M + 5, n}, {2 * M, 2 * M + 3}};
  auto dchunks = up(chunks);
  Buffer<double, Cuda> partials(chunks.size());
  auto out = up(std::vector<double>{1e9});  // written, not added to
  ck::sum_of_squares_chunks(stream(), out.data(), partials.data(), dg.data(), dchunks.data(), chunks.size());
  std::vector<double> want(chunks.size());
  double ref = 0;
  for (std::size_t i = 0; i < chunks.size(); ++i)
    ref += want[i] = hk::sum_of_squares(g.data() + chunks[i].begin, chunks[i].end - chunks[i].begin);
  const std::vector<double> got = down(partials);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    CAPTURE(i);
    CHECK(std::fabs(got[i] - want[i]) <= 1e-5 * want[i] + 1e-30);  // a block's float sum
  }
  const double total = down(out)[0];
  CHECK(std::fabs(total - ref) <= 1e-5 * ref);
  // The same chunks give the same bits (a fixed order, no atomics).
  ck::sum_of_squares_chunks(stream(), out.data(), partials.data(), dg.data(), dchunks.data(), chunks.size());
  CHECK(down(out)[0] == total);
  // add_scalar: one double into another, on the stream.
  auto into = up(std::vector<double>{0.5});
  ck::add_scalar(stream(), into.data(), out.data());
  CHECK(down(into)[0] == 0.5 + total);
  // No chunks: zero.
  ck::sum_of_squares_chunks(stream(), out.data(), partials.data(), dg.data(), dchunks.data(), 0);
  CHECK(down(out)[0] == 0.0);
}

namespace {
// Packed documents (context/documents.hpp) for B rows of n queries at positions p0..: row b's
// documents begin at 0 and at each of `begins` shifted by 7b, and first[b n + i] is the last
// begin at or before position p0 + i.
std::vector<int> doc_first_of(int B, int n, int p0, const std::vector<int>& begins) {
  std::vector<int> first(static_cast<std::size_t>(B) * n);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < n; ++i) {
      int f = 0;
      for (const int x : begins)
        if (x + 7 * b <= p0 + i) f = std::max(f, x + 7 * b);
      first[static_cast<std::size_t>(b) * n + i] = f;
    }
  return first;
}
}  // namespace

TEST_CASE_TEMPLATE("attention forward and backward (flash-style) against the reference", T, ELEMENT_TYPES) {
  struct Shape {
    int B, L, C, NH, NKV;  // L: sequence length; NKV key/value heads
  };
  // hs = 32, 64 and 80 (padded to 128); T not a multiple of the 32-row tile; grouped-query
  // (6 query heads over 2 key/value heads) and multi-query (over 1). bf16 at hs 32, 64 and 128
  // runs the tensor-core kernels: over several 64-row tiles (T = 150, 130), grouped (4 over 2),
  // multi-query at hs 128 (its 32-row steps), and a sequence inside one tile.
  // Packed: documents of 1 to 64 tokens, some starting on a 64-row tile's edge, some inside.
  for (const bool packed : {false, true})
  for (const Shape s : {Shape{2, 70, 96, 3, 3}, Shape{1, 33, 128, 2, 2}, Shape{2, 45, 160, 2, 2}, Shape{2, 50, 192, 6, 2},
                        Shape{1, 40, 128, 4, 1}, Shape{2, 150, 256, 4, 2}, Shape{1, 130, 256, 2, 1},
                        Shape{1, 7, 64, 2, 2}}) {
    CAPTURE(packed);
    CAPTURE(s.L);
    CAPTURE(s.C);
    CAPTURE(s.NH);
    CAPTURE(s.NKV);
    const std::size_t width = static_cast<std::size_t>(s.C + 2 * s.C / s.NH * s.NKV);
    const std::size_t nqkv = static_cast<std::size_t>(s.B) * s.L * width, nout = static_cast<std::size_t>(s.B) * s.L * s.C;
    const std::size_t nlse = static_cast<std::size_t>(s.B) * s.NH * s.L;
    const auto qkv = rnd<T>(nqkv, 32, -1.5f, 1.5f), dout = rnd<T>(nout, 33);
    std::vector<T> out(nout), dqkv(nqkv);
    std::vector<float> lse(nlse);
    const std::vector<int> first = doc_first_of(s.B, s.L, 0, {3, 4, 20, 63, 64, 100, 129});
    const auto d_first_buf = up(first);
    const int* h_first = packed ? first.data() : nullptr;
    const int* d_first = packed ? d_first_buf.data() : nullptr;
    hk::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.L, s.C, s.NH, s.NKV, h_first);
    hk::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.L, s.C, s.NH, s.NKV,
                           h_first);
    auto d_qkv = up(qkv), d_dout = up(dout);
    Buffer<T, Cuda> d_out(nout), d_dqkv(nqkv);
    Buffer<float, Cuda> d_lse(nlse);
    const int hs = s.C / s.NH;
    const bool sm80 = [] {
      int device = 0, major = 0;
      return cudaGetDevice(&device) == cudaSuccess &&
             cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 8;
    }();
    CHECK(ck::attention_on_tensor_cores<T>(s.C, s.NH, s.NKV) ==
          (std::is_same_v<T, bf16> && (hs == 32 || hs == 64 || hs == 128) && sm80));
    ck::attention_forward(stream(), d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.L, s.C, s.NH, s.NKV, d_first);
    CHECK_CLOSE(out, down(d_out), bound<T>(fp32_sum));
    CHECK_CLOSE(lse, down(d_lse), fp32_sum);
    // The backward from the reference's out and lse, so only the backward is compared.
    auto d_out_ref = up(out);
    auto d_lse_ref = up(lse);
    ck::attention_backward(stream(), d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out_ref.data(), d_lse_ref.data(),
                           s.B, s.L, s.C, s.NH, s.NKV, d_first);
    CHECK_CLOSE(dqkv, down(d_dqkv), bound<T>(fp32_sum));
  }
  Buffer<T, Cuda> x(1024);
  Buffer<float, Cuda> l(8);
  CHECK_THROWS_AS(ck::attention_forward(stream(), x.data(), l.data(), x.data(), 1, 1, 100, 3, 3), std::invalid_argument);
  CHECK_THROWS_AS(ck::attention_forward(stream(), x.data(), l.data(), x.data(), 1, 1, 256, 1, 1), std::invalid_argument);
  CHECK_THROWS_AS(ck::attention_forward(stream(), x.data(), l.data(), x.data(), 1, 1, 96, 3, 2), std::invalid_argument);
}

// Ring attention's blocks (context parallelism) against the host's: q from a q|k|v buffer, k
// and v from a packed [k | v] one (the ring's), a causal diagonal block first, then a full
// block merged into o and lse; the backward adds to dq, dk and dv. bf16 at head sizes 32, 64
// and 128 runs the tensor-core kernels (rows past one 64-row tile, grouped and multi-query
// heads), fp32 the scalar ones. Packed: the queries are a chunk at positions n.., the
// diagonal's keys there too and kv1's at 0..n; some rows' documents begin in kv1's chunk, the
// later rows' see none of it (o = 0, lse = -inf from that block; at n = 128 a whole 64-row
// query tile, which skips every key tile); and the blocks also in the ring's order at its
// first step, kv1's first (rows with no key start at lse = -inf), then the diagonal merged.
TEST_CASE_TEMPLATE("attention blocks (ring attention) against the reference", T, ELEMENT_TYPES) {
  struct Shape {
    int B, n, C, NH, NKV;
  };
  for (const int packed : {0, 1, 2})  // 2: packed, kv1's block first
  for (const Shape s : {Shape{2, 100, 256, 4, 2}, Shape{1, 70, 256, 2, 1}, Shape{2, 45, 96, 3, 3},
                        Shape{1, 128, 256, 4, 2}}) {
    CAPTURE(packed);
    CAPTURE(s.n);
    CAPTURE(s.C);
    CAPTURE(s.NH);
    CAPTURE(s.NKV);
    const int hs = s.C / s.NH, Ckv = hs * s.NKV, ldq = s.C + 2 * Ckv, ldkv = 2 * Ckv;
    const std::size_t rows = static_cast<std::size_t>(s.B) * s.n, nlse = static_cast<std::size_t>(s.B) * s.NH * s.n;
    const auto qkv = rnd<T>(rows * ldq, 40, -1.5f, 1.5f), kv1 = rnd<T>(rows * ldkv, 41, -1.5f, 1.5f);
    const auto dout = rnd<T>(rows * s.C, 42);
    const auto dq0 = rnd<float>(rows * s.C, 43), dkv0 = rnd<float>(rows * ldkv, 44);
    const std::vector<int> first = doc_first_of(s.B, s.n, s.n, {64, s.n - 10, s.n + 5, s.n + 30});
    const auto d_first_buf = up(first);
    auto mask = [&](bool device, bool diagonal) {
      if (!packed) return fived::DocumentMask{};
      return fived::DocumentMask{device ? d_first_buf.data() : first.data(), diagonal ? s.n : 0};
    };
    // host: the diagonal block from qkv's own k, v, then kv1's block merged (or the other way)
    std::vector<float> o(rows * s.C), lse(nlse), Dd(nlse);
    const T* k0 = qkv.data() + s.C;
    for (const bool diagonal : packed == 2 ? std::vector<bool>{false, true} : std::vector<bool>{true, false})
      hk::attention_block_forward(o.data(), lse.data(), qkv.data(), diagonal ? k0 : kv1.data(),
                                  (diagonal ? k0 : kv1.data()) + Ckv, ldq, diagonal ? ldq : ldkv, s.B, s.n, s.C, s.NH,
                                  s.NKV, diagonal, mask(false, diagonal), diagonal == (packed != 2));
    std::vector<T> out(o.size());
    for (std::size_t i = 0; i < o.size(); ++i) out[i] = T(o[i]);
    hk::attention_row_dot(Dd.data(), dout.data(), out.data(), s.B, s.n, s.C, s.NH);
    auto dq = dq0, dkv = dkv0;
    for (const bool causal : {true, false})
      hk::attention_block_backward(dq.data(), dkv.data(), dkv.data() + Ckv, ldkv, dout.data(), Dd.data(), lse.data(),
                                   qkv.data(), causal ? k0 : kv1.data(), (causal ? k0 : kv1.data()) + Ckv, ldq,
                                   causal ? ldq : ldkv, s.B, s.n, s.C, s.NH, s.NKV, causal, mask(false, causal));
    // device
    auto d_qkv = up(qkv), d_kv1 = up(kv1), d_dout = up(dout), d_out = up(out);
    Buffer<float, Cuda> d_o(o.size()), d_lse(nlse), d_Dd(nlse);
    const T* dk0 = d_qkv.data() + s.C;
    for (const bool diagonal : packed == 2 ? std::vector<bool>{false, true} : std::vector<bool>{true, false})
      ck::attention_block_forward(stream(), d_o.data(), d_lse.data(), d_qkv.data(), diagonal ? dk0 : d_kv1.data(),
                                  (diagonal ? dk0 : d_kv1.data()) + Ckv, ldq, diagonal ? ldq : ldkv, s.B, s.n, s.C,
                                  s.NH, s.NKV, diagonal, mask(true, diagonal), diagonal == (packed != 2));
    CHECK_CLOSE(o, down(d_o), bound<T>(fp32_sum));
    CHECK_CLOSE(lse, down(d_lse), 1e-4);
    ck::attention_row_dot(stream(), d_Dd.data(), d_dout.data(), d_out.data(), s.B, s.n, s.C, s.NH);
    CHECK_CLOSE(Dd, down(d_Dd), bound<T>(fp32_sum));
    auto d_dq = up(dq0), d_dkv = up(dkv0), d_lse_ref = up(lse), d_Dd_ref = up(Dd);
    for (const bool causal : {true, false}) {
      const T* kk = causal ? dk0 : d_kv1.data();
      ck::attention_block_backward(stream(), d_dq.data(), d_dkv.data(), d_dkv.data() + Ckv, ldkv, d_dout.data(),
                                   d_Dd_ref.data(), d_lse_ref.data(), d_qkv.data(), kk, kk + Ckv, ldq,
                                   causal ? ldq : ldkv, s.B, s.n, s.C, s.NH, s.NKV, causal, mask(true, causal));
    }
    // the random starting values dominate dq0 + gradient: compare the gradients themselves
    auto minus = [](std::vector<float> a, const std::vector<float>& b) {
      for (std::size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
      return a;
    };
    CHECK_CLOSE(minus(dq, dq0), minus(down(d_dq), dq0), bound<T>(fp32_sum));
    CHECK_CLOSE(minus(dkv, dkv0), minus(down(d_dkv), dkv0), bound<T>(fp32_sum));
  }
}

#if defined(FIVED_WITH_CUDNN)
// cuDNN's fused attention (bf16), as Ops<bf16, Cuda> runs it, against the host reference:
// out, the log-sum-exp statistics fived's backward and context-parallel merges read, and
// dq|dk|dv written in place into the q|k|v layout; grouped and multi-query heads; the
// backward repeats bit for bit (cuDNN's deterministic algorithm).
TEST_CASE("attention through cuDNN against the reference") {
  struct Shape {
    int B, L, C, NH, NKV;
  };
  for (const Shape s : {Shape{2, 70, 96, 3, 3}, Shape{1, 33, 128, 2, 2}, Shape{2, 50, 192, 6, 2}, Shape{1, 40, 128, 4, 1},
                        Shape{2, 300, 512, 8, 2}, Shape{1, 64, 512, 4, 4}}) {
    CAPTURE(s.L);
    CAPTURE(s.C);
    CAPTURE(s.NH);
    CAPTURE(s.NKV);
    REQUIRE(ck::CudnnAttention::shape_supported(s.C, s.NH, s.NKV));
    const std::size_t width = static_cast<std::size_t>(s.C + 2 * s.C / s.NH * s.NKV);
    const std::size_t nqkv = static_cast<std::size_t>(s.B) * s.L * width, nout = static_cast<std::size_t>(s.B) * s.L * s.C;
    const std::size_t nlse = static_cast<std::size_t>(s.B) * s.NH * s.L;
    const auto qkv = rnd<bf16>(nqkv, 34, -1.5f, 1.5f), dout = rnd<bf16>(nout, 35);
    std::vector<bf16> out(nout), dqkv(nqkv);
    std::vector<float> lse(nlse);
    hk::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.L, s.C, s.NH, s.NKV);
    hk::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.L, s.C, s.NH, s.NKV);

    fived::Ops<bf16, Cuda> ops;
    REQUIRE(ops.attention_through_cudnn(s.C, s.NH, s.NKV));
    auto d_qkv = up(qkv), d_dout = up(dout);
    Buffer<bf16, Cuda> d_out(nout), d_dqkv(nqkv);
    Buffer<float, Cuda> d_lse(nlse);
    ops.attention_forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.L, s.C, s.NH, s.NKV);
    ops.synchronize();
    CHECK_CLOSE(out, down(d_out), bound<bf16>(fp32_sum));
    CHECK_CLOSE(lse, down(d_lse), 1e-3);  // from bf16 q and k, in fp32
    ops.attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.L, s.C, s.NH,
                           s.NKV);
    ops.synchronize();
    const auto first = down(d_dqkv);
    CHECK_CLOSE(dqkv, first, bound<bf16>(fp32_sum));
    ops.attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.L, s.C, s.NH,
                           s.NKV);
    ops.synchronize();
    const auto second = down(d_dqkv);
    CHECK(std::memcmp(first.data(), second.data(), first.size() * sizeof(bf16)) == 0);
  }
  // fp32 and head sizes cuDNN does not take stay on fived's own kernel.
  CHECK_FALSE(fived::Ops<float, Cuda>{}.attention_through_cudnn(128, 2, 2));
  CHECK_FALSE(fived::Ops<bf16, Cuda>{}.attention_through_cudnn(24, 2, 2));   // head size 12
  CHECK_FALSE(fived::Ops<bf16, Cuda>{}.attention_through_cudnn(512, 2, 2));  // head size 256
}
#endif

// Mixture of experts. Each kernel gets the host's outputs of the step before it on both
// sides (scores -> top-k -> plan -> rows), so the integer results (expert, pos, token_of,
// the kept counts) must be equal, not close. Cases: k = 1 and 2, E = 4 and 8, softmax and
// sigmoid, capacities that drop assignments (0: all of them), an expert no token picks (a
// bias of -10 on it: the bias only selects), C above one block (300), and N = 0.
TEST_CASE_TEMPLATE("mixture of experts: router, dispatch plan, gather, combine and their backwards", T,
                   ELEMENT_TYPES) {
  struct Case {
    int N, E, k, capacity, C;
    bool sigmoid, renormalize, bias, idle_expert, drops;
  };
  ck::DispatchScratch scratch;  // shared by the cases: it grows and is reused
  for (const Case m : {Case{37, 4, 1, -1, 40, false, false, false, false, false},
                       Case{37, 8, 2, -1, 40, true, true, true, false, false},
                       Case{37, 8, 2, 6, 300, false, true, true, true, true},
                       Case{37, 4, 2, 10, 40, true, false, true, true, true},
                       Case{64, 4, 1, 9, 33, false, false, false, false, true},
                       Case{20, 4, 2, 0, 40, false, true, false, false, true},
                       Case{0, 4, 2, 3, 40, false, true, true, false, false}}) {
    const int N = m.N, E = m.E, k = m.k, C = m.C;
    CAPTURE(N);
    CAPTURE(E);
    CAPTURE(k);
    CAPTURE(m.capacity);
    CAPTURE(m.sigmoid);
    CAPTURE(m.renormalize);
    const std::size_t NE = static_cast<std::size_t>(N) * E, NK = static_cast<std::size_t>(N) * k;
    const std::size_t NC = static_cast<std::size_t>(N) * C;

    // router_scores
    const auto logits = rnd<T>(NE, 40, -3.0f, 3.0f);
    std::vector<float> scores(NE);
    hk::router_scores(scores.data(), logits.data(), N, E, m.sigmoid);
    auto d_logits = up(logits);
    Buffer<float, Cuda> d_scores(NE);
    ck::router_scores(stream(), d_scores.data(), d_logits.data(), N, E, m.sigmoid);
    CHECK_CLOSE(scores, down(d_scores), fp32_elem);

    // router_topk, from the host's scores
    std::vector<float> bias;
    if (m.bias) {
      bias = rnd<float>(static_cast<std::size_t>(E), 41, -0.1f, 0.1f);
      if (m.idle_expert) bias[static_cast<std::size_t>(E) - 1] = -10.0f;
    }
    auto d_hscores = up(scores);
    auto d_bias = up(bias);
    std::vector<int> expert(NK);
    std::vector<float> gate(NK);
    hk::router_topk(expert.data(), gate.data(), scores.data(), m.bias ? bias.data() : nullptr, N, E, k,
                    m.renormalize);
    Buffer<int, Cuda> d_expert(NK);
    Buffer<float, Cuda> d_gate(NK);
    ck::router_topk(stream(), d_expert.data(), d_gate.data(), d_hscores.data(), m.bias ? d_bias.data() : nullptr, N,
                    E, k, m.renormalize);
    CHECK(down(d_expert) == expert);
    CHECK_CLOSE(gate, down(d_gate), fp32_elem);

    // dispatch_plan, from the host's experts; unwritten entries stay -7 on both sides
    auto d_hexpert = up(expert);
    auto d_hgate = up(gate);
    std::vector<int> token_of(NK, -7), pos(NK, -7), counts(static_cast<std::size_t>(E), -7);
    std::vector<float> loads(static_cast<std::size_t>(E), -7.0f);
    hk::dispatch_plan(token_of.data(), pos.data(), loads.data(), counts.data(), expert.data(), N, k, E, m.capacity,
                      false);
    auto d_token_of = up(std::vector<int>(NK, -7)), d_pos = up(std::vector<int>(NK, -7));
    std::vector<int> got_counts(static_cast<std::size_t>(E), -7);
    Buffer<float, Cuda> d_loads(static_cast<std::size_t>(E));
    ck::dispatch_plan(stream(), scratch, d_token_of.data(), d_pos.data(), d_loads.data(), got_counts.data(),
                      d_hexpert.data(), N, k, E, m.capacity, false);
    CHECK(got_counts == counts);
    CHECK(down(d_loads) == loads);
    CHECK(down(d_pos) == pos);
    CHECK(down(d_token_of) == token_of);
    if (m.idle_expert) CHECK(counts[static_cast<std::size_t>(E) - 1] == 0);  // the case tests what it says
    if (m.drops) CHECK(std::count(pos.begin(), pos.end(), -1) > 0);
    int rows = 0;
    for (const int c : counts) rows += c;
    const std::size_t RC = static_cast<std::size_t>(rows) * C;

    // gather_rows (the dispatch): a copy, exact
    const auto x = rnd<T>(NC, 42);
    std::vector<T> xp(RC);
    hk::gather_rows(xp.data(), x.data(), token_of.data(), rows, C);
    auto d_x = up(x);
    Buffer<T, Cuda> d_xp(RC);
    ck::gather_rows(stream(), d_xp.data(), d_x.data(), d_token_of.data(), rows, C);
    CHECK(down(d_xp) == xp);

    if (m.capacity >= 0) {  // padded: expert e's rows at e·capacity, empty slots -1 (zero rows), no wait
      const std::size_t R = static_cast<std::size_t>(E) * static_cast<std::size_t>(m.capacity);
      std::vector<int> ptok(R, -7), ppos(NK, -7);
      std::vector<float> ploads(static_cast<std::size_t>(E));
      hk::dispatch_plan(ptok.data(), ppos.data(), ploads.data(), static_cast<int*>(nullptr), expert.data(), N, k, E,
                        m.capacity, true);
      auto d_ptok = up(std::vector<int>(R, -7)), d_ppos = up(std::vector<int>(NK, -7));
      Buffer<float, Cuda> d_ploads(static_cast<std::size_t>(E));
      ck::dispatch_plan(stream(), scratch, d_ptok.data(), d_ppos.data(), d_ploads.data(), static_cast<int*>(nullptr),
                        d_hexpert.data(), N, k, E, m.capacity, true);
      CHECK(down(d_ptok) == ptok);
      CHECK(down(d_ppos) == ppos);
      CHECK(down(d_ploads) == loads);
      std::vector<T> pxp(R * static_cast<std::size_t>(C));
      hk::gather_rows(pxp.data(), x.data(), ptok.data(), static_cast<int>(R), C);
      Buffer<T, Cuda> d_pxp(R * static_cast<std::size_t>(C));
      ck::gather_rows(stream(), d_pxp.data(), d_x.data(), d_ptok.data(), static_cast<int>(R), C);
      CHECK(down(d_pxp) == pxp);
    }

    // moe_combine
    const auto y = rnd<T>(RC, 43);
    auto d_y = up(y);
    std::vector<T> out(NC);
    hk::moe_combine(out.data(), y.data(), pos.data(), gate.data(), N, k, C);
    Buffer<T, Cuda> d_out(NC);
    ck::moe_combine(stream(), d_out.data(), d_y.data(), d_pos.data(), d_hgate.data(), N, k, C);
    CHECK_CLOSE(out, down(d_out), bound<T>(fp32_elem));

    // moe_combine_backward: dgate starts at 7 (a dropped assignment must get 0)
    const auto dout = rnd<T>(NC, 44);
    auto d_dout = up(dout);
    auto dy = rnd<T>(RC, 45);
    auto d_dy = up(dy);
    std::vector<float> dgate(NK, 7.0f);
    auto d_dgate = up(dgate);
    hk::moe_combine_backward(dy.data(), dgate.data(), dout.data(), y.data(), pos.data(), gate.data(), N, k, C);
    ck::moe_combine_backward(stream(), d_dy.data(), d_dgate.data(), d_dout.data(), d_y.data(), d_pos.data(),
                             d_hgate.data(), N, k, C);
    CHECK_CLOSE(dy, down(d_dy), bound<T>(fp32_elem));
    CHECK_CLOSE(dgate, down(d_dgate), fp32_sum);  // a dot product over C, summed in another order

    // moe_dispatch_backward ("+=")
    const auto dxp = rnd<T>(RC, 46);
    auto d_dxp = up(dxp);
    auto dx = rnd<T>(NC, 47);
    auto d_dx = up(dx);
    hk::moe_dispatch_backward(dx.data(), dxp.data(), pos.data(), N, k, C);
    ck::moe_dispatch_backward(stream(), d_dx.data(), d_dxp.data(), d_pos.data(), N, k, C);
    CHECK_CLOSE(dx, down(d_dx), bound<T>(fp32_elem));

    // router_backward, with and without the load-balancing term
    const auto dg = rnd<float>(NK, 48), daux = rnd<float>(static_cast<std::size_t>(E), 49, -0.1f, 0.1f);
    auto d_dg = up(dg), d_daux = up(daux);
    for (const bool with_aux : {false, true}) {
      CAPTURE(with_aux);
      std::vector<T> dlogits(NE);
      hk::router_backward(dlogits.data(), dg.data(), scores.data(), expert.data(), gate.data(),
                          with_aux ? daux.data() : nullptr, N, E, k, m.renormalize, m.sigmoid);
      Buffer<T, Cuda> d_dlogits(NE);
      ck::router_backward(stream(), d_dlogits.data(), d_dg.data(), d_hscores.data(), d_hexpert.data(), d_hgate.data(),
                          with_aux ? d_daux.data() : nullptr, N, E, k, m.renormalize, m.sigmoid);
      CHECK_CLOSE(dlogits, down(d_dlogits), bound<T>(fp32_elem * 10));
    }

    // router_score_sums ("=": starts at 7)
    std::vector<float> sums(static_cast<std::size_t>(E), 7.0f);
    auto d_sums = up(sums);
    hk::router_score_sums(sums.data(), scores.data(), N, E);
    ck::router_score_sums(stream(), d_sums.data(), d_hscores.data(), N, E);
    CHECK_CLOSE(sums, down(d_sums), fp32_sum);
  }

  {  // ties go to the lower expert (strictly greater replaces), with and without renormalising
    const int N = 3, E = 4, k = 2;
    const std::vector<float> tied = {0.25f, 0.25f, 0.25f, 0.25f, 0.1f, 0.3f, 0.3f, 0.3f, 0.5f, 0.5f, 0.0f, 0.0f};
    auto d_tied = up(tied);
    for (const bool renormalize : {false, true}) {
      std::vector<int> expert(N * k);
      std::vector<float> gate(N * k);
      hk::router_topk(expert.data(), gate.data(), tied.data(), nullptr, N, E, k, renormalize);
      CHECK(expert == std::vector<int>{0, 1, 1, 2, 0, 1});
      Buffer<int, Cuda> d_expert(N * k);
      Buffer<float, Cuda> d_gate(N * k);
      ck::router_topk(stream(), d_expert.data(), d_gate.data(), d_tied.data(), nullptr, N, E, k, renormalize);
      CHECK(down(d_expert) == expert);
      CHECK(down(d_gate) == gate);
    }
  }

  {  // expert_bias_step: three blocks of 5 experts' loads (whole rows), a tie with the mean in
     // the second and equal loads in the third; the same bits as the host's
    const int blocks = 3, E = 5;
    const std::vector<float> loads = {9, 0, 3, 1, 12, 4, 4, 2, 6, 4, 7, 7, 7, 7, 7};
    std::vector<float> bias = {0.5f, -0.25f, 0, 1, 2, 0, 0, 0, 0, 0, -1, 0.125f, 3, 0, 0};
    auto d_loads = up(loads), d_bias = up(bias);
    hk::expert_bias_step(bias.data(), loads.data(), blocks, E, 0.02);
    ck::expert_bias_step(stream(), d_bias.data(), d_loads.data(), blocks, E, 0.02);
    CHECK(down(d_bias) == bias);
    CHECK(bias[5] == 0.0f);   // load 4 = the mean: no move
    CHECK(bias[7] == 0.02f);  // below the mean: up
    CHECK(bias[10] == -1.0f);  // all equal: no move
    // A step the optimizer skipped (its squared norm, in device memory, not finite) moves none.
    auto d_nan = up(std::vector<double>{std::numeric_limits<double>::quiet_NaN()});
    ck::expert_bias_step(stream(), d_bias.data(), d_loads.data(), blocks, E, 0.02, d_nan.data());
    CHECK(down(d_bias) == bias);
  }

  {  // misuse: k > E, and expert ids outside [0, E) (found on the device, thrown after the sync)
    Buffer<int, Cuda> e(8), t(8), p(8);
    Buffer<float, Cuda> g(8), s(16);
    CHECK_THROWS_AS(ck::router_topk(stream(), e.data(), g.data(), s.data(), nullptr, 2, 4, 5, false),
                    std::invalid_argument);
    std::vector<int> c(4);
    for (const int wrong : {4, -1}) {
      auto bad = up(std::vector<int>{0, 1, wrong, 2});
      CHECK_THROWS_AS(
          ck::dispatch_plan(stream(), scratch, t.data(), p.data(), g.data(), c.data(), bad.data(), 2, 2, 4, -1, false),
          std::invalid_argument);
    }
    // Padded rows wait for nothing: a bad id is dropped, and only it. N 3, k 2, E 4, capacity 2:
    // expert 3 keeps assignments 0 and 2 (4 is over capacity), expert 0 keeps 5; -1 and 7 are
    // dropped. Sorted by the low 2 bits alone, both bad ids fell among expert 3's and took
    // assignment 2's place.
    auto ids = up(std::vector<int>{3, -1, 3, 7, 3, 0});
    auto d_tok = up(std::vector<int>(8, -7)), d_pos = up(std::vector<int>(6, -7));
    Buffer<float, Cuda> d_loads(4);
    ck::dispatch_plan(stream(), scratch, d_tok.data(), d_pos.data(), d_loads.data(), static_cast<int*>(nullptr),
                      ids.data(), 3, 2, 4, 2, true);
    CHECK(down(d_pos) == std::vector<int>{6, -1, 7, -1, -1, 0});
    CHECK(down(d_tok) == std::vector<int>{2, -1, -1, -1, -1, -1, 0, 1});
    CHECK(down(d_loads) == std::vector<float>{1, 0, 0, 2});
  }

  {  // Ops<T, Cuda>: upload, and dispatch_plan on its own buffers, allocated once
    fived::Ops<T, Cuda> ops;
    const int N = 29, k = 2, E = 8, capacity = 5;
    std::vector<int> expert(static_cast<std::size_t>(N) * k);
    for (std::size_t i = 0; i < expert.size(); ++i) expert[i] = static_cast<int>((i * 5 + i / 3) % E);
    Buffer<int, Cuda> d_expert(expert.size()), d_token_of(expert.size()), d_pos(expert.size());
    ops.upload(d_expert.data(), expert.data(), expert.size());
    std::vector<int> token_of(expert.size(), 0), pos(expert.size()), counts(E), got(E);
    std::vector<float> loads(E);
    Buffer<float, Cuda> d_loads(E);
    hk::dispatch_plan(token_of.data(), pos.data(), loads.data(), counts.data(), expert.data(), N, k, E, capacity, false);
    ops.dispatch_plan(d_token_of.data(), d_pos.data(), d_loads.data(), got.data(), d_expert.data(), N, k, E, capacity,
                      false);
    CHECK(got == counts);
    const std::size_t allocations = fived::buffer_allocations<Cuda>().load();
    ops.dispatch_plan(d_token_of.data(), d_pos.data(), d_loads.data(), got.data(), d_expert.data(), 10, k, E, capacity,
                      false);
    ops.dispatch_plan(d_token_of.data(), d_pos.data(), d_loads.data(), got.data(), d_expert.data(), N, k, E, capacity,
                      false);
    CHECK(fived::buffer_allocations<Cuda>().load() == allocations);  // same or smaller sizes: none
    CHECK(got == counts);
    CHECK(down(d_pos) == pos);
    CHECK(down(d_token_of) == token_of);
  }
}

TEST_CASE_TEMPLATE("redistribute on device memory: Ops<T, Cuda>, a workspace and NCCL (a world of one)", T,
                   ELEMENT_TYPES) {
  // One rank cuts nothing (the regrouping is the test above): this runs the device path of
  // place/redistribute.hpp end to end, Sharded<T, L, Cuda> and its views, the ops' copies
  // and kernels on their stream, and NCCL over device spans ordered after that stream.
  using fived::Axis;
  using M = fived::Mesh<fived::TP<1>>;
  using L = fived::ShardLayout<M, 2, fived::Placements<fived::On<Axis::tp, fived::Shard<1>>>>;
  using Full = fived::redistributed_layout_t<L, Axis::tp, fived::Replicate>;
  using Rows = fived::redistributed_layout_t<L, Axis::tp, fived::Shard<0>>;
  ncclUniqueId id{};
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  auto tp = fived::nccl::Comm::init(1, 0, id, "tp");
  fived::Ops<T, Cuda> ops;
  tp.set_compute_stream(ops.stream());

  const auto h = rnd<T>(6 * 8, 22);
  const fived::Sharded<T, L, Cuda> x(L({6, 8}, fived::Coord{}), up(h));
  fived::Sharded<T, Full, Cuda> full{Full({6, 8}, fived::Coord{})};
  fived::Sharded<T, Rows, Cuda> rows{Rows({6, 8}, fived::Coord{})};
  Buffer<T, Cuda> workspace(std::max(fived::redistribute_workspace<Axis::tp, fived::Replicate>(x.layout()),
                                     fived::redistribute_workspace<Axis::tp, fived::Shard<0>>(x.layout())));
  fived::redistribute<Axis::tp, fived::Replicate>(x.view(), full.view(), workspace.span(), tp, ops);  // all-gather
  fived::redistribute<Axis::tp, fived::Shard<0>>(x.view(), rows.view(), workspace.span(), tp, ops);   // all-to-all
  ops.synchronize();
  CHECK(down(full.buffer()) == h);
  CHECK(down(rows.buffer()) == h);
  const auto padded = fived::redistribute<Axis::tp, fived::Partial>(x, tp, ops);  // allocating; waits for ops
  CHECK(down(padded.buffer()) == h);
}

int main(int argc, char** argv) {
  if (fived::test::gpu_count() == 0) {
    std::puts("test_kernels_cuda: no CUDA device, skipping");
    return fived::test::skip_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
