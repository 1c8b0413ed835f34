#pragma once
// Host LayerNorm and RMSNorm over the last axis of inp[N,C], forward and backward.
//
//   layernorm: out = (x - mean) * rstd * weight + bias,   rstd = 1/sqrt(var + eps)
//   rmsnorm:   out = x * rstd * weight,                   rstd = 1/sqrt(mean(x^2) + eps)
//
// alone or fused with the residual add before it (residual_layernorm_forward,
// residual_rmsnorm_forward: res = a + b, then the norm of res), with eps = 1e-5 and the
// biased variance (as GPT-2 / PyTorch). The forward saves the per-row statistics (mean,
// rstd; acc_t<T>, [N]) so the backward does not recompute them. The backward is the
// standard closed form (llm.c):
//   dnorm = dout * weight,  xhat = (x - mean) * rstd
//   dinp += rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat))
//   dweight += sum_rows dout * xhat,  dbias += sum_rows dout
// (rmsnorm: no mean(dnorm) term, xhat = x * rstd). All gradients are "+=":
// dinp is on the residual path and the parameter gradients accumulate over
// micro-batches. Statistics and sums are in acc_t<T>; the parameter gradients are
// summed over rows in acc_t and added to the T output once. A null dinp skips the input's
// gradient, null dweight and dbias the parameters' (the two halves of a split backward,
// nn/weight_grads.hpp, each the same arithmetic as the whole).

#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/kernels/host/residual.hpp"

namespace fived::kernels::host {

namespace detail_norm {
inline void check_sizes(const char* what, int N, int C) {
  if (N < 0 || C <= 0)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what +
                                ": needs N >= 0 rows and C >= 1 channels (got N=" + std::to_string(N) +
                                ", C=" + std::to_string(C) + ")");
}
}  // namespace detail_norm

template <class T>
void layernorm_forward(T* out, acc_t<T>* mean, acc_t<T>* rstd, const T* inp, const T* weight, const T* bias, int N,
                       int C) {
  using A = acc_t<T>;
  detail_norm::check_sizes("layernorm_forward", N, C);
  const std::size_t sC = static_cast<std::size_t>(C);
  const A eps = static_cast<A>(1e-5);
  for (std::size_t i = 0; i < static_cast<std::size_t>(N); ++i) {
    const T* x = inp + i * sC;
    A m = 0;
    for (std::size_t c = 0; c < sC; ++c) m += static_cast<A>(x[c]);
    m /= static_cast<A>(C);
    A v = 0;
    for (std::size_t c = 0; c < sC; ++c) {
      const A d = static_cast<A>(x[c]) - m;
      v += d * d;
    }
    v /= static_cast<A>(C);
    const A r = static_cast<A>(1) / std::sqrt(v + eps);
    T* o = out + i * sC;
    for (std::size_t c = 0; c < sC; ++c)
      o[c] = static_cast<T>((static_cast<A>(x[c]) - m) * r * static_cast<A>(weight[c]) + static_cast<A>(bias[c]));
    mean[i] = m;
    rstd[i] = r;
  }
}

// The residual add before a norm, fused into it (one pass on a GPU): res = a + b, rounded
// to T as residual_forward rounds it, then the norm of res. res may alias a or b.
template <class T>
void residual_layernorm_forward(T* res, T* out, acc_t<T>* mean, acc_t<T>* rstd, const T* a, const T* b,
                                const T* weight, const T* bias, int N, int C) {
  detail_norm::check_sizes("residual_layernorm_forward", N, C);
  residual_forward(res, a, b, static_cast<std::size_t>(N) * static_cast<std::size_t>(C));
  layernorm_forward(out, mean, rstd, res, weight, bias, N, C);
}

template <class T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const acc_t<T>* mean, const acc_t<T>* rstd, int N, int C) {
  using A = acc_t<T>;
  detail_norm::check_sizes("layernorm_backward", N, C);
  const std::size_t sC = static_cast<std::size_t>(C);
  const bool params = dweight != nullptr || dbias != nullptr;
  std::vector<A> dw(params ? sC : 0, A(0)), db(params ? sC : 0, A(0));
  for (std::size_t i = 0; i < static_cast<std::size_t>(N); ++i) {
    const T* x = inp + i * sC;
    const T* g = dout + i * sC;
    const A m = mean[i], r = rstd[i];
    if (params)
      for (std::size_t c = 0; c < sC; ++c) {
        const A go = static_cast<A>(g[c]);
        db[c] += go;
        dw[c] += (static_cast<A>(x[c]) - m) * r * go;
      }
    if (dinp == nullptr) continue;
    A dnorm_mean = 0, dnorm_xhat_mean = 0;
    for (std::size_t c = 0; c < sC; ++c) {
      const A xhat = (static_cast<A>(x[c]) - m) * r;
      const A dnorm = static_cast<A>(weight[c]) * static_cast<A>(g[c]);
      dnorm_mean += dnorm;
      dnorm_xhat_mean += dnorm * xhat;
    }
    dnorm_mean /= static_cast<A>(C);
    dnorm_xhat_mean /= static_cast<A>(C);
    T* dx = dinp + i * sC;
    for (std::size_t c = 0; c < sC; ++c) {
      const A xhat = (static_cast<A>(x[c]) - m) * r;
      const A dnorm = static_cast<A>(weight[c]) * static_cast<A>(g[c]);
      dx[c] = static_cast<T>(static_cast<A>(dx[c]) + r * (dnorm - dnorm_mean - xhat * dnorm_xhat_mean));
    }
  }
  for (std::size_t c = 0; c < (params ? sC : 0); ++c) {
    if (dweight != nullptr) dweight[c] = static_cast<T>(static_cast<A>(dweight[c]) + dw[c]);
    if (dbias != nullptr) dbias[c] = static_cast<T>(static_cast<A>(dbias[c]) + db[c]);
  }
}

template <class T>
void rmsnorm_forward(T* out, acc_t<T>* rstd, const T* inp, const T* weight, int N, int C) {
  using A = acc_t<T>;
  detail_norm::check_sizes("rmsnorm_forward", N, C);
  const std::size_t sC = static_cast<std::size_t>(C);
  const A eps = static_cast<A>(1e-5);
  for (std::size_t i = 0; i < static_cast<std::size_t>(N); ++i) {
    const T* x = inp + i * sC;
    A ms = 0;
    for (std::size_t c = 0; c < sC; ++c) ms += static_cast<A>(x[c]) * static_cast<A>(x[c]);
    ms /= static_cast<A>(C);
    const A r = static_cast<A>(1) / std::sqrt(ms + eps);
    T* o = out + i * sC;
    for (std::size_t c = 0; c < sC; ++c) o[c] = static_cast<T>(static_cast<A>(x[c]) * r * static_cast<A>(weight[c]));
    rstd[i] = r;
  }
}

template <class T>
void residual_rmsnorm_forward(T* res, T* out, acc_t<T>* rstd, const T* a, const T* b, const T* weight, int N, int C) {
  detail_norm::check_sizes("residual_rmsnorm_forward", N, C);
  residual_forward(res, a, b, static_cast<std::size_t>(N) * static_cast<std::size_t>(C));
  rmsnorm_forward(out, rstd, res, weight, N, C);
}

template <class T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, const acc_t<T>* rstd, int N,
                      int C) {
  using A = acc_t<T>;
  detail_norm::check_sizes("rmsnorm_backward", N, C);
  const std::size_t sC = static_cast<std::size_t>(C);
  std::vector<A> dw(dweight != nullptr ? sC : 0, A(0));
  for (std::size_t i = 0; i < static_cast<std::size_t>(N); ++i) {
    const T* x = inp + i * sC;
    const T* g = dout + i * sC;
    const A r = rstd[i];
    if (dweight != nullptr)
      for (std::size_t c = 0; c < sC; ++c) dw[c] += static_cast<A>(x[c]) * r * static_cast<A>(g[c]);
    if (dinp == nullptr) continue;
    A dnorm_xhat_mean = 0;
    for (std::size_t c = 0; c < sC; ++c)
      dnorm_xhat_mean += static_cast<A>(weight[c]) * static_cast<A>(g[c]) * static_cast<A>(x[c]) * r;
    dnorm_xhat_mean /= static_cast<A>(C);
    T* dx = dinp + i * sC;
    for (std::size_t c = 0; c < sC; ++c) {
      const A xhat = static_cast<A>(x[c]) * r;
      dx[c] = static_cast<T>(static_cast<A>(dx[c]) +
                             r * (static_cast<A>(weight[c]) * static_cast<A>(g[c]) - xhat * dnorm_xhat_mean));
    }
  }
  if (dweight != nullptr)
    for (std::size_t c = 0; c < sC; ++c) dweight[c] = static_cast<T>(static_cast<A>(dweight[c]) + dw[c]);
}

}  // namespace fived::kernels::host
