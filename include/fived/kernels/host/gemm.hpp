#pragma once
// Host GEMM: out[M,N] (= or +=) op(a)[M,K] * op(b)[K,N] (+ bias[N] on every row),
// optionally followed by a GELU epilogue, and the bias gradient (column sums).
//
// Shapes follow the kernel contract (docs/architecture.md, "Device and kernels"): row-major,
// op(a) is a [M,K] or, when trans_a, a stored [K,M]; op(b) is b [K,N] or, when
// trans_b, b stored [N,K]. The four transpose combinations are exactly what a
// linear layer needs forward (inp * W^T) and backward (dinp = dout * W,
// dW = dout^T * inp), so the model never materialises a transposed copy.
//
// Why it is shaped this way: a plain triple loop is far too slow to train even a
// tiny GPT on a CPU, so the loop is blocked, after GotoBLAS. For each tile of rows (MC) and
// columns (NC) an accumulator tile in acc_t<T> lives in L1/L2; the k axis is walked in KC
// slices, and each slice of op(a) and op(b) is packed (converted to acc_t, laid out for the
// inner loop whatever trans_a and trans_b are, padded with zeros to whole register tiles).
// The inner loop keeps a register tile of MR x NR sums in vector registers for the whole
// slice (GCC/Clang vector types, so at -O1 too, as the tests build), reading one packed row of
// op(b) per four rows. On an x86-64 CPU with AVX (picked at run time, whatever the build's flags)
// the tile is two strips wide in 32-byte vectors, about twice as fast, with the same bits. Every
// sum is still added k by k in order, as a plain loop would, so the result does not depend on
// the blocking or on the CPU. Accumulation is always in acc_t<T> (float for
// float/bf16, double for double); the result is rounded to T once, at the end.
//
// Epilogue::gelu (tanh approximation, as gelu.hpp): x = product + bias is stored
// (rounded to T) in pre_act[M,N] and out = gelu(x), computed from x before
// rounding. It is not combined with accumulate (std::invalid_argument).
//
// bias and pre_act are std::type_identity_t<T> (not deduced, same type), so a plain
// `nullptr` can be passed for them: T is deduced from out, a and b.
//
//   matmul_dgelu(out, a, b, pre_act, M, N, K, trans_a, trans_b)
//     out[M,N] = gelu'(pre_act) * op(a) op(b): the product that is the gradient at a GELU's
//     output, carried through the GELU to its input. Here the product rounded to T, then
//     gelu_backward, as the two calls it stands for; a device fuses the GELU's backward into
//     the GEMM (kernels/cuda/gemm.hpp).
//
//   matmul_weight_grad(dw, db, dy, x, rows, in, out, transposed)
//     A linear layer's weight half over `rows` rows of y = x W + b, all "+=": dW += x^T dy
//     into W [in, out] (transposed: dW += dy^T x into W [out, in], torch.nn.Linear's), and
//     db += the sum of dy's rows (a null db: no bias). Here the GEMM, then bias_backward; a
//     device sums dy for the bias inside the GEMM that reads it anyway (kernels/cuda/gemm.hpp).
//
// Each of the three takes a strided batch last (Batch, WeightGradBatch): `count` products of
// one shape, the i-th with every operand i strides (elements) after the first's, as a mixture
// of experts padded to capacity has, one per expert (nn/moe.hpp). Here they run one after
// another, each exactly as the plain call; a device runs them as one GEMM (cuBLASLt's strided
// batch). The default is one product.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/kernels/host/gelu.hpp"

namespace fived::kernels::host {

enum class Epilogue { none, gelu };

// A strided batch for matmul and matmul_dgelu: product i reads a + i·a, b + i·b, bias + i·bias
// and writes out + i·out (and pre_act + i·pre_act), in elements. All int64: no padding, so a
// call's bytes hash alike (util/call_hash.hpp).
struct Batch {
  std::int64_t count = 1;
  std::int64_t out = 0, a = 0, b = 0, bias = 0, pre_act = 0;
};
// ... and for matmul_weight_grad: product i adds into dw + i·dw and db + i·db from dy + i·dy
// and x + i·x.
struct WeightGradBatch {
  std::int64_t count = 1;
  std::int64_t dw = 0, db = 0, dy = 0, x = 0;
};

namespace detail_gemm {
// Product i's operand: p advanced by i strides, a null pointer left null (no bias).
template <class P>
P* nth(P* p, std::int64_t stride, std::int64_t i) {
  return p == nullptr ? p : p + stride * i;
}
inline void require_batch(const char* fn, std::int64_t count) {
  if (count < 1)
    throw std::invalid_argument(std::string("fived::kernels::host::") + fn +
                                ": a batch holds at least one product (count=" + std::to_string(count) + ")");
}
}  // namespace detail_gemm

namespace detail_gemm {

inline constexpr int MC = 64;   // rows of the accumulator tile
inline constexpr int NC = 256;  // columns of the accumulator tile
inline constexpr int KC = 128;  // depth of one packed slice of op(a) and op(b)
inline constexpr int MR = 4;    // rows of a register tile

// Half a row of a register tile: 16 bytes of acc_t (4 floats, 2 doubles), one SSE or NEON
// register; a register tile is MR rows of two. A GCC/Clang vector (see the top of this file);
// elementwise, so the sums are the scalar ones bit for bit.
template <class A>
inline constexpr std::size_t VL = 16 / sizeof(A);  // lanes of a vector
template <class A>
inline constexpr std::size_t NR = 2 * VL<A>;  // columns of a register tile
#if defined(__GNUC__)
template <class A>
struct vector_of {
  typedef A type __attribute__((vector_size(16)));
};
#else
template <class A>
struct vector_of {
  struct type {
    A v[VL<A>];
    type& operator+=(const type& o) {
      for (std::size_t j = 0; j < VL<A>; ++j) v[j] += o.v[j];
      return *this;
    }
    friend type operator*(A a, const type& b) {
      type r;
      for (std::size_t j = 0; j < VL<A>; ++j) r.v[j] = a * b.v[j];
      return r;
    }
  };
};
#endif
template <class A>
using vec = typename vector_of<A>::type;

// acc[MR, 2 w] (row stride ldc) += ap * [b0 | b1] over one slice of depth kc, in vectors V of w
// lanes: ap is the slice of op(a) for these rows (ap[k * MR + r]); the tile's left and right
// halves are the columns of op(b) at b0[k * NR + l] and b1[k * NR + l], l < w. The sum runs k
// by k onto what acc holds, as a plain i-k-j loop adds: the tiling does not change a result.
// Always inlined, so that it is compiled for the instruction set of its caller.
template <class V, class A>
[[gnu::always_inline]] inline void tile_sums(A* acc, std::size_t ldc, const A* __restrict ap, const A* __restrict b0,
                                             const A* __restrict b1, std::size_t kc) {
  static_assert(MR == 4, "tile_sums names its rows: c0x .. c3x");
  constexpr std::size_t w = sizeof(V) / sizeof(A);
  auto load = [](V& v, const A* p) { std::memcpy(&v, p, sizeof v); };
  auto store = [](A* p, const V& v) { std::memcpy(p, &v, sizeof v); };
  V c00, c01, c10, c11, c20, c21, c30, c31, v0, v1;
  load(c00, acc), load(c01, acc + w), load(c10, acc + ldc), load(c11, acc + ldc + w);
  load(c20, acc + 2 * ldc), load(c21, acc + 2 * ldc + w), load(c30, acc + 3 * ldc), load(c31, acc + 3 * ldc + w);
  for (std::size_t k = 0; k < kc; ++k, ap += MR, b0 += NR<A>, b1 += NR<A>) {
    load(v0, b0), load(v1, b1);
    c00 += ap[0] * v0, c01 += ap[0] * v1;
    c10 += ap[1] * v0, c11 += ap[1] * v1;
    c20 += ap[2] * v0, c21 += ap[2] * v1;
    c30 += ap[3] * v0, c31 += ap[3] * v1;
  }
  store(acc, c00), store(acc + w, c01), store(acc + ldc, c10), store(acc + ldc + w, c11);
  store(acc + 2 * ldc, c20), store(acc + 2 * ldc + w, c21), store(acc + 3 * ldc, c30), store(acc + 3 * ldc + w, c31);
}

// One strip of op(b) (bp[k * NR + j]) against MR rows: the strip's row is two 16-byte vectors.
template <class A>
inline void register_tile(A* acc, std::size_t ldc, const A* __restrict ap, const A* __restrict bp, std::size_t kc) {
  tile_sums<vec<A>>(acc, ldc, ap, bp, bp + VL<A>, kc);
}

// The same register tile two strips wide, in 32-byte AVX vectors: a strip's row of NR lanes is
// one vector, so two neighbouring strips (bp, and bp + kc * NR) make a tile of MR x 2 NR. Each
// lane gets the same products, added in the same order, as register_tile gives it, so the
// result is the same to the bit; only the instructions are twice as wide. AVX without FMA: a
// fused multiply-add would round once where the plain loop rounds twice. Compiled for AVX
// whatever the build's flags (target attribute), run only where the CPU has it (has_avx).
// x86-64 only: a 32-bit build may compute the 16-byte tile's and the plain loop's sums on x87,
// in more precision than the AVX tile's, and the bits would then depend on the CPU.
#if defined(__GNUC__) && defined(__x86_64__)
#define FIVED_HOST_GEMM_AVX 1
inline bool has_avx() {
  // __builtin_cpu_init first: a GEMM called from a static initializer may run before the
  // CPU model is read, and would otherwise take the narrow tile for the whole run.
  static const bool avx = (__builtin_cpu_init(), __builtin_cpu_supports("avx"));
  return avx;
}
template <class A>
struct wide_vector_of {
  typedef A type __attribute__((vector_size(32)));
};
template <class A>
__attribute__((target("avx"))) inline void register_tile_wide(A* acc, std::size_t ldc, const A* __restrict ap,
                                                              const A* __restrict bp, std::size_t kc) {
  using W = typename wide_vector_of<A>::type;
  static_assert(sizeof(W) == NR<A> * sizeof(A), "register_tile_wide: a vector is one strip's row");
  tile_sums<W>(acc, ldc, ap, bp, bp + kc * NR<A>, kc);
  // Clears the vectors' upper halves for the SSE code that follows, which would otherwise be
  // slowed (GCC adds this itself at -O2, not at the tests' -O1).
  __builtin_ia32_vzeroupper();
}
#endif

constexpr std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

// One slice of an operand, packed into panels W wide (MR rows of op(a), NR columns of op(b)):
// dst[x / W * kc * W + k * W + x % W] = src(k, x) in acc_t for k < kc, x < n, and zeros for
// n <= x < xp (xp: n rounded up to W). src(k, x) = src[k * ks + x * xs]: the copy walks x
// innermost where xs is 1 and k innermost otherwise, as the operand is stored, so that the
// reads are contiguous.
template <std::size_t W, class A, class T>
void pack_panels(A* __restrict dst, const T* __restrict src, std::size_t ks, std::size_t xs, std::size_t kc,
                 std::size_t n, std::size_t xp) {
  if (xs == 1) {
    for (std::size_t k = 0; k < kc; ++k) {
      const T* row = src + k * ks;
      for (std::size_t x0 = 0; x0 < xp; x0 += W) {
        A* d = dst + x0 * kc + k * W;
        if (x0 + W <= n)
          for (std::size_t l = 0; l < W; ++l) d[l] = static_cast<A>(row[x0 + l]);
        else
          for (std::size_t l = 0; l < W; ++l) d[l] = x0 + l < n ? static_cast<A>(row[x0 + l]) : A(0);
      }
    }
  } else {
    for (std::size_t x = 0; x < xp; ++x) {
      A* d = dst + x / W * kc * W + x % W;
      if (x < n)
        for (std::size_t k = 0; k < kc; ++k) d[k * W] = static_cast<A>(src[x * xs + k * ks]);
      else
        for (std::size_t k = 0; k < kc; ++k) d[k * W] = A(0);
    }
  }
}

}  // namespace detail_gemm

namespace detail_gemm {
template <class T>
void product(T* out, const T* a, const T* b, const std::type_identity_t<T>* bias, int M, int N, int K, bool trans_a,
             bool trans_b, bool accumulate, Epilogue ep, std::type_identity_t<T>* pre_act) {
  using A = acc_t<T>;
  using namespace detail_gemm;
  constexpr std::size_t nr = NR<A>;
  if (M < 0 || N < 0 || K < 0)
    throw std::invalid_argument("fived::kernels::host::matmul: sizes must not be negative (M=" + std::to_string(M) +
                                ", N=" + std::to_string(N) + ", K=" + std::to_string(K) + ")");
  if (ep == Epilogue::gelu && accumulate)
    throw std::invalid_argument(
        "fived::kernels::host::matmul: the GELU epilogue cannot be combined with accumulate (+=)");
  if (ep == Epilogue::gelu && pre_act == nullptr && M > 0 && N > 0)
    throw std::invalid_argument(
        "fived::kernels::host::matmul: the GELU epilogue needs pre_act[M,N] to store the pre-activation");
  if (M == 0 || N == 0) return;

  const std::size_t sM = static_cast<std::size_t>(M), sN = static_cast<std::size_t>(N),
                    sK = static_cast<std::size_t>(K);

  // The tile is padded to whole register tiles (MR rows, NR columns; the padding of op(a) and
  // op(b) is zeros, its sums are not read), so one register tile computes it all. Scratch sized
  // to this product, not to a full tile: a small GEMM, as an expert's or a test's, is called
  // often. Left uninitialised: each element is written before it is read.
  const std::size_t mt = round_up(std::min<std::size_t>(MC, sM), MR), nt = round_up(std::min<std::size_t>(NC, sN), nr),
                    kt = std::min<std::size_t>(KC, sK);
  const std::unique_ptr<A[]> scratch(new A[mt * nt + mt * kt + kt * nt]);
  A* const acc = scratch.get();  // [mc, nc] as mc rows of ldc
  A* const ap = acc + mt * nt;    // op(a)'s slice: panels of MR rows, k-major
  A* const bp = ap + mt * kt;     // op(b)'s slice: strips of NR columns, k-major

  for (std::size_t i0 = 0; i0 < sM; i0 += MC) {
    const std::size_t mc = std::min<std::size_t>(MC, sM - i0), mp = round_up(mc, MR);
    for (std::size_t j0 = 0; j0 < sN; j0 += NC) {
      const std::size_t nc = std::min<std::size_t>(NC, sN - j0), ldc = round_up(nc, nr);
      std::fill(acc, acc + mp * ldc, A(0));
      for (std::size_t k0 = 0; k0 < sK; k0 += KC) {
        const std::size_t kc = std::min<std::size_t>(KC, sK - k0);
        // op(b)(k, j) is b[k * N + j], or b[j * K + k] when trans_b; op(a)(i, k) likewise.
        if (trans_b) pack_panels<nr>(bp, b + j0 * sK + k0, 1, sK, kc, nc, ldc);
        else pack_panels<nr>(bp, b + k0 * sN + j0, sN, 1, kc, nc, ldc);
        if (trans_a) pack_panels<MR>(ap, a + k0 * sM + i0, sM, 1, kc, mc, mp);
        else pack_panels<MR>(ap, a + i0 * sK + k0, 1, sK, kc, mc, mp);
        // Strip by strip, so that a strip of op(b) (kc x NR) stays in L1 while every panel of
        // op(a) passes it.
        std::size_t j = 0;
#ifdef FIVED_HOST_GEMM_AVX
        if (has_avx())
          for (; j + 2 * nr <= ldc; j += 2 * nr)
            for (std::size_t i = 0; i < mp; i += MR)
              register_tile_wide(acc + i * ldc + j, ldc, ap + i * kc, bp + j * kc, kc);
#endif
        for (; j < ldc; j += nr)
          for (std::size_t i = 0; i < mp; i += MR) register_tile(acc + i * ldc + j, ldc, ap + i * kc, bp + j * kc, kc);
      }
      // Epilogue for this tile: bias, (gelu | accumulate), round to T once.
      for (std::size_t i = 0; i < mc; ++i) {
        const A* r = acc + i * ldc;
        T* o = out + (i0 + i) * sN + j0;
        for (std::size_t j = 0; j < nc; ++j) {
          A x = r[j];
          if (bias != nullptr) x += static_cast<A>(bias[j0 + j]);
          if (ep == Epilogue::gelu) {
            pre_act[(i0 + i) * sN + j0 + j] = static_cast<T>(x);
            o[j] = static_cast<T>(detail_gelu::gelu(x));
          } else if (accumulate) {
            o[j] = static_cast<T>(static_cast<A>(o[j]) + x);
          } else {
            o[j] = static_cast<T>(x);
          }
        }
      }
    }
  }
}

}  // namespace detail_gemm

template <class T>
void matmul(T* out, const T* a, const T* b, const std::type_identity_t<T>* bias, int M, int N, int K, bool trans_a,
            bool trans_b, bool accumulate = false, Epilogue ep = Epilogue::none,
            std::type_identity_t<T>* pre_act = nullptr, Batch batch = {}) {
  using detail_gemm::nth;
  detail_gemm::require_batch("matmul", batch.count);
  for (std::int64_t i = 0; i < batch.count; ++i)
    detail_gemm::product(nth(out, batch.out, i), nth(a, batch.a, i), nth(b, batch.b, i), nth(bias, batch.bias, i), M,
                         N, K, trans_a, trans_b, accumulate, ep, nth(pre_act, batch.pre_act, i));
}

template <class T>
void matmul_dgelu(T* out, const T* a, const T* b, const std::type_identity_t<T>* pre_act, int M, int N, int K,
                  bool trans_a, bool trans_b, Batch batch = {}) {
  using detail_gemm::nth;
  if (pre_act == nullptr && M > 0 && N > 0)
    throw std::invalid_argument("fived::kernels::host::matmul_dgelu: needs pre_act[M,N], the GELU's input");
  detail_gemm::require_batch("matmul_dgelu", batch.count);
  for (std::int64_t i = 0; i < batch.count; ++i) {
    T* o = nth(out, batch.out, i);
    matmul(o, nth(a, batch.a, i), nth(b, batch.b, i), static_cast<const T*>(nullptr), M, N, K, trans_a, trans_b);
    gelu_backward(o, nth(pre_act, batch.pre_act, i), o, static_cast<std::size_t>(M) * static_cast<std::size_t>(N));
  }
}

// dbias[N] += column sums of dout[M,N] (accumulated in acc_t<T>, rounded once).
template <class T>
void bias_backward(T* dbias, const T* dout, int M, int N) {
  using A = acc_t<T>;
  if (M < 0 || N < 0)
    throw std::invalid_argument("fived::kernels::host::bias_backward: sizes must not be negative (M=" +
                                std::to_string(M) + ", N=" + std::to_string(N) + ")");
  const std::size_t sN = static_cast<std::size_t>(N);
  std::vector<A> sum(sN, A(0));
  for (std::size_t i = 0; i < static_cast<std::size_t>(M); ++i) {
    const T* row = dout + i * sN;
    for (std::size_t j = 0; j < sN; ++j) sum[j] += static_cast<A>(row[j]);
  }
  for (std::size_t j = 0; j < sN; ++j) dbias[j] = static_cast<T>(static_cast<A>(dbias[j]) + sum[j]);
}

template <class T>
void matmul_weight_grad(T* dw, T* db, const T* dy, const T* x, int rows, int in, int out, bool transposed,
                        WeightGradBatch batch = {}) {
  using detail_gemm::nth;
  const T* none = nullptr;
  detail_gemm::require_batch("matmul_weight_grad", batch.count);
  for (std::int64_t i = 0; i < batch.count; ++i) {
    T *dwi = nth(dw, batch.dw, i), *dbi = nth(db, batch.db, i);
    const T *dyi = nth(dy, batch.dy, i), *xi = nth(x, batch.x, i);
    if (transposed) matmul(dwi, dyi, xi, none, out, in, rows, true, false, true);
    else matmul(dwi, xi, dyi, none, in, out, rows, true, false, true);
    if (dbi != nullptr) bias_backward(dbi, dyi, rows, out);
  }
}

}  // namespace fived::kernels::host
