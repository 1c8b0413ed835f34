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
// tiny GPT on a CPU, so the loop is blocked. For each tile of rows (MC) and
// columns (NC) an accumulator tile in acc_t<T> lives in L1/L2; the k axis is
// walked in KC slices, each slice of op(b) is packed (converted to acc_t, made
// contiguous over columns whatever trans_b is) and the rows of the tile are
// updated in i-k-j order, four rows at a time so every packed row of b is read
// once per four output rows. The inner loop is a contiguous axpy the compiler
// vectorises at -O2 and above. Accumulation is always in acc_t<T> (float for
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

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/kernels/host/gelu.hpp"

namespace fived::kernels::host {

enum class Epilogue { none, gelu };

namespace detail_gemm {

inline constexpr int MC = 64;   // rows of the accumulator tile
inline constexpr int NC = 256;  // columns of the accumulator tile
inline constexpr int KC = 128;  // depth of one packed slice of op(b)

// r_q[j] += a_q * b[j] for four output rows q and j < n. Separate, restrict-qualified
// rows let the compiler vectorise this at -O2 without alias checks.
template <class A>
inline void axpy4(A* __restrict r0, A* __restrict r1, A* __restrict r2, A* __restrict r3, const A* __restrict b,
                  A a0, A a1, A a2, A a3, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) {
    const A bv = b[j];
    r0[j] += a0 * bv;
    r1[j] += a1 * bv;
    r2[j] += a2 * bv;
    r3[j] += a3 * bv;
  }
}

template <class A>
inline void axpy1(A* __restrict r, const A* __restrict b, A a, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) r[j] += a * b[j];
}

}  // namespace detail_gemm

template <class T>
void matmul(T* out, const T* a, const T* b, const std::type_identity_t<T>* bias, int M, int N, int K, bool trans_a,
            bool trans_b, bool accumulate = false, Epilogue ep = Epilogue::none,
            std::type_identity_t<T>* pre_act = nullptr) {
  using A = acc_t<T>;
  using namespace detail_gemm;
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
  // op(a)(i,k) and op(b)(k,j) as loads in acc_t.
  auto A_at = [&](std::size_t i, std::size_t k) -> A {
    return static_cast<A>(trans_a ? a[k * sM + i] : a[i * sK + k]);
  };
  auto B_at = [&](std::size_t k, std::size_t j) -> A {
    return static_cast<A>(trans_b ? b[j * sK + k] : b[k * sN + j]);
  };

  std::vector<A> acc(static_cast<std::size_t>(MC) * NC);
  std::vector<A> bp(static_cast<std::size_t>(KC) * NC);

  for (std::size_t i0 = 0; i0 < sM; i0 += MC) {
    const std::size_t mc = std::min<std::size_t>(MC, sM - i0);
    for (std::size_t j0 = 0; j0 < sN; j0 += NC) {
      const std::size_t nc = std::min<std::size_t>(NC, sN - j0);
      std::fill(acc.begin(), acc.begin() + static_cast<std::ptrdiff_t>(mc * nc), A(0));
      for (std::size_t k0 = 0; k0 < sK; k0 += KC) {
        const std::size_t kc = std::min<std::size_t>(KC, sK - k0);
        // Pack op(b)[k0:k0+kc, j0:j0+nc] as kc contiguous rows of nc.
        if (trans_b) {
          for (std::size_t j = 0; j < nc; ++j)
            for (std::size_t k = 0; k < kc; ++k) bp[k * nc + j] = B_at(k0 + k, j0 + j);
        } else {
          for (std::size_t k = 0; k < kc; ++k)
            for (std::size_t j = 0; j < nc; ++j) bp[k * nc + j] = B_at(k0 + k, j0 + j);
        }
        std::size_t i = 0;
        for (; i + 4 <= mc; i += 4) {  // four rows share each packed row of b
          A* r0 = acc.data() + (i + 0) * nc;
          A* r1 = acc.data() + (i + 1) * nc;
          A* r2 = acc.data() + (i + 2) * nc;
          A* r3 = acc.data() + (i + 3) * nc;
          for (std::size_t k = 0; k < kc; ++k) {
            const A a0 = A_at(i0 + i + 0, k0 + k), a1 = A_at(i0 + i + 1, k0 + k);
            const A a2 = A_at(i0 + i + 2, k0 + k), a3 = A_at(i0 + i + 3, k0 + k);
            axpy4(r0, r1, r2, r3, bp.data() + k * nc, a0, a1, a2, a3, nc);
          }
        }
        for (; i < mc; ++i) {
          A* r = acc.data() + i * nc;
          for (std::size_t k = 0; k < kc; ++k) {
            axpy1(r, bp.data() + k * nc, A_at(i0 + i, k0 + k), nc);
          }
        }
      }
      // Epilogue for this tile: bias, (gelu | accumulate), round to T once.
      for (std::size_t i = 0; i < mc; ++i) {
        const A* r = acc.data() + i * nc;
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

template <class T>
void matmul_dgelu(T* out, const T* a, const T* b, const std::type_identity_t<T>* pre_act, int M, int N, int K,
                  bool trans_a, bool trans_b) {
  if (pre_act == nullptr && M > 0 && N > 0)
    throw std::invalid_argument("fived::kernels::host::matmul_dgelu: needs pre_act[M,N], the GELU's input");
  matmul(out, a, b, static_cast<const T*>(nullptr), M, N, K, trans_a, trans_b);
  gelu_backward(out, pre_act, out, static_cast<std::size_t>(M) * static_cast<std::size_t>(N));
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
void matmul_weight_grad(T* dw, T* db, const T* dy, const T* x, int rows, int in, int out, bool transposed) {
  const T* none = nullptr;
  if (transposed) matmul(dw, dy, x, none, out, in, rows, true, false, true);
  else matmul(dw, x, dy, none, in, out, rows, true, false, true);
  if (db != nullptr) bias_backward(db, dy, rows, out);
}

}  // namespace fived::kernels::host
