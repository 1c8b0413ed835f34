#pragma once
// Host causal multi-head self-attention, forward and backward (reference).
//
// qkv is [B,T,3C] = [q | k | v] on the last axis; head h uses columns
// [h*hs, (h+1)*hs) of each part, hs = C/NH. For every (b, h, t):
//   s_tj = q_t . k_j / sqrt(hs)  for j <= t      (causal)
//   lse_t = m + log(sum_{j<=t} exp(s_tj - m)),  m = max_j s_tj   (natural log)
//   out_t = sum_{j<=t} exp(s_tj - lse_t) v_j      -> out[b,t,h*hs:(h+1)*hs]
// out is [B,T,C] (heads concatenated), lse is [B,NH,T] in acc_t<T>. The lse is
// what ring attention (context parallelism) needs to merge partial results.
//
// The forward is the straightforward reference: one row buffer of T scores. The
// backward is flash-style, so neither pass stores the T x T matrix:
//   p_tj = exp(s_tj - lse_t),  D_t = dout_t . out_t,  dp_tj = dout_t . v_j,
//   ds_tj = p_tj (dp_tj - D_t),
//   dq_t += ds_tj k_j / sqrt(hs),  dk_j += ds_tj q_t / sqrt(hs),  dv_j += p_tj dout_t.
// dqkv [B,T,3C] is overwritten. The gradients of one (b, h) are summed in an
// acc_t<T> buffer of [T, 3 hs] (O(T hs), not O(T^2)) and rounded to T once, so
// bf16 keys and values are not accumulated in bf16 over t.

#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

namespace detail_attention {
inline void check_sizes(const char* what, int B, int T, int C, int NH) {
  if (B < 0 || T < 0 || C <= 0 || NH <= 0)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what +
                                ": needs B >= 0, T >= 0, C >= 1 and NH >= 1 (got B=" + std::to_string(B) +
                                ", T=" + std::to_string(T) + ", C=" + std::to_string(C) +
                                ", NH=" + std::to_string(NH) + ")");
  if (C % NH != 0)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what + ": the channel count C=" +
                                std::to_string(C) + " is not divisible by the head count NH=" + std::to_string(NH));
}
}  // namespace detail_attention

template <class T>
void attention_forward(T* out, acc_t<T>* lse, const T* qkv, int B, int T_, int C, int NH) {
  using A = acc_t<T>;
  detail_attention::check_sizes("attention_forward", B, T_, C, NH);
  const std::size_t sT = static_cast<std::size_t>(T_), sC = static_cast<std::size_t>(C);
  const std::size_t hs = sC / static_cast<std::size_t>(NH), C3 = 3 * sC;
  const A scale = static_cast<A>(1) / std::sqrt(static_cast<A>(hs));
  std::vector<A> s(sT), acc(hs);
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
    for (std::size_t h = 0; h < static_cast<std::size_t>(NH); ++h)
      for (std::size_t t = 0; t < sT; ++t) {
        const T* q = qkv + (b * sT + t) * C3 + h * hs;
        A m = -std::numeric_limits<A>::infinity();
        for (std::size_t j = 0; j <= t; ++j) {
          const T* k = qkv + (b * sT + j) * C3 + sC + h * hs;
          A dot = 0;
          for (std::size_t d = 0; d < hs; ++d) dot += static_cast<A>(q[d]) * static_cast<A>(k[d]);
          s[j] = dot * scale;
          if (s[j] > m) m = s[j];
        }
        A sum = 0;
        for (std::size_t j = 0; j <= t; ++j) {
          s[j] = std::exp(s[j] - m);
          sum += s[j];
        }
        for (std::size_t d = 0; d < hs; ++d) acc[d] = 0;
        for (std::size_t j = 0; j <= t; ++j) {
          const T* v = qkv + (b * sT + j) * C3 + 2 * sC + h * hs;
          const A p = s[j] / sum;
          for (std::size_t d = 0; d < hs; ++d) acc[d] += p * static_cast<A>(v[d]);
        }
        T* o = out + (b * sT + t) * sC + h * hs;
        for (std::size_t d = 0; d < hs; ++d) o[d] = static_cast<T>(acc[d]);
        lse[(b * static_cast<std::size_t>(NH) + h) * sT + t] = m + std::log(sum);
      }
}

template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const acc_t<T>* lse, int B, int T_, int C,
                        int NH) {
  using A = acc_t<T>;
  detail_attention::check_sizes("attention_backward", B, T_, C, NH);
  const std::size_t sT = static_cast<std::size_t>(T_), sC = static_cast<std::size_t>(C);
  const std::size_t hs = sC / static_cast<std::size_t>(NH), C3 = 3 * sC;
  const A scale = static_cast<A>(1) / std::sqrt(static_cast<A>(hs));
  std::vector<A> g(sT * 3 * hs);  // [T, dq | dk | dv] of one (b, h)
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
    for (std::size_t h = 0; h < static_cast<std::size_t>(NH); ++h) {
      for (auto& x : g) x = 0;
      for (std::size_t t = 0; t < sT; ++t) {
        const T* q = qkv + (b * sT + t) * C3 + h * hs;
        const T* go = dout + (b * sT + t) * sC + h * hs;
        const T* o = out + (b * sT + t) * sC + h * hs;
        const A l = lse[(b * static_cast<std::size_t>(NH) + h) * sT + t];
        A D = 0;
        for (std::size_t d = 0; d < hs; ++d) D += static_cast<A>(go[d]) * static_cast<A>(o[d]);
        A* dq = g.data() + t * 3 * hs;
        for (std::size_t j = 0; j <= t; ++j) {
          const T* k = qkv + (b * sT + j) * C3 + sC + h * hs;
          const T* v = qkv + (b * sT + j) * C3 + 2 * sC + h * hs;
          A dot = 0, dp = 0;
          for (std::size_t d = 0; d < hs; ++d) {
            dot += static_cast<A>(q[d]) * static_cast<A>(k[d]);
            dp += static_cast<A>(go[d]) * static_cast<A>(v[d]);
          }
          const A p = std::exp(dot * scale - l);
          const A ds = p * (dp - D) * scale;
          A* dk = g.data() + j * 3 * hs + hs;
          A* dv = dk + hs;
          for (std::size_t d = 0; d < hs; ++d) {
            dq[d] += ds * static_cast<A>(k[d]);
            dk[d] += ds * static_cast<A>(q[d]);
            dv[d] += p * static_cast<A>(go[d]);
          }
        }
      }
      for (std::size_t t = 0; t < sT; ++t) {
        T* row = dqkv + (b * sT + t) * C3 + h * hs;
        const A* gt = g.data() + t * 3 * hs;
        for (std::size_t part = 0; part < 3; ++part)
          for (std::size_t d = 0; d < hs; ++d) row[part * sC + d] = static_cast<T>(gt[part * hs + d]);
      }
    }
}

}  // namespace fived::kernels::host
