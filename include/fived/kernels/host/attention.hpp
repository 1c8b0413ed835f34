#pragma once
// Host causal multi-head self-attention with grouped key/value heads, forward and backward
// (reference).
//
// NH query heads share NKV key/value heads (NKV divides NH; NKV = NH is plain multi-head
// attention): query head h reads key/value head h / (NH / NKV), as Hugging Face's repeat_kv
// but without the copies. qkv is [B,T,C + 2Ckv] = [q | k | v] on the last axis, C = NH*hs
// and Ckv = NKV*hs; query head h uses columns [h*hs, (h+1)*hs) of q, key/value head j
// columns [j*hs, (j+1)*hs) of k and of v. For every (b, h, t), with j = h's key/value head:
//   s_tu = q_t . k_u / sqrt(hs)  for u <= t      (causal)
//   lse_t = m + log(sum_{u<=t} exp(s_tu - m)),  m = max_u s_tu   (natural log)
//   out_t = sum_{u<=t} exp(s_tu - lse_t) v_u      -> out[b,t,h*hs:(h+1)*hs]
// out is [B,T,C] (heads concatenated), lse is [B,NH,T] in acc_t<T>. The lse is
// what ring attention (context parallelism) needs to merge partial results. With documents
// packed into the rows (context/documents.hpp: first [B,T], each token's document start),
// the sums run over first_t <= u <= t only.
//
// Both are written as one case of the block kernels below (ring attention's pieces): the
// forward is the straightforward reference, one row buffer of T scores; the backward is
// flash-style, so neither pass stores the T x T matrix:
//   p_tj = exp(s_tj - lse_t),  D_t = dout_t . out_t,  dp_tj = dout_t . v_j,
//   ds_tj = p_tj (dp_tj - D_t),
//   dq_t += ds_tj k_j / sqrt(hs),  dk_j += ds_tj q_t / sqrt(hs),  dv_j += p_tj dout_t,
// a key/value head's gradients summed over the query heads that read it.
// dqkv [B,T,C + 2Ckv] is overwritten.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/context/documents.hpp"
#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

namespace detail_attention {
inline void check_sizes(const char* what, int B, int T, int C, int NH, int NKV) {
  if (B < 0 || T < 0 || C <= 0 || NH <= 0 || NKV <= 0)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what +
                                ": needs B >= 0, T >= 0, C >= 1, NH >= 1 and NKV >= 1 (got B=" + std::to_string(B) +
                                ", T=" + std::to_string(T) + ", C=" + std::to_string(C) +
                                ", NH=" + std::to_string(NH) + ", NKV=" + std::to_string(NKV) + ")");
  if (C % NH != 0)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what + ": the channel count C=" +
                                std::to_string(C) + " is not divisible by the head count NH=" + std::to_string(NH));
  if (NH % NKV != 0)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what + ": the key/value heads NKV=" +
                                std::to_string(NKV) + " do not divide the query heads NH=" + std::to_string(NH));
}
}  // namespace detail_attention

// ---- blocks (ring attention) -----------------------------------------------------------
// One block: the queries of q against the keys and values of k and v, B sequences of n
// rows each; q's row i of sequence b is q + (b*n + i)*ldq, likewise k, v with ldkv (a qkv
// buffer has ld = C + 2Ckv and k = qkv + C, v = qkv + C + Ckv; a packed [k | v] buffer
// ld = 2Ckv). Query head h reads key/value head h / (NH / NKV).
// causal: key j is seen by query i only when j <= i (the diagonal block of a causal
// sequence); otherwise every key is seen. docs: besides, only the keys of the query's
// document (context/documents.hpp; none without its `first`). The results are in acc_t<T>:
//   o [B, n, C] (row stride C) and lse [B, NH, n]: with `first` they are this block's
//   attention and log-sum-exp; without, this block is merged into them (the rows' softmax
//   over the union of the keys, in the stable form
//   l = max(l1, l2) + log(exp(l1 - max) + exp(l2 - max)),  o = o1 exp(l1 - l) + o2 exp(l2 - l)).
// A row that sees no key of the block (documents) gets o = 0 and lse = -inf from it, which
// the merge leaves out; every row sees itself on its diagonal, so its final l is finite.
template <class T>
void attention_block_forward(acc_t<T>* o, acc_t<T>* lse, const T* q, const T* k, const T* v, int ldq, int ldkv, int B,
                             int n, int C, int NH, int NKV, bool causal, DocumentMask docs, bool first) {
  using A = acc_t<T>;
  detail_attention::check_sizes("attention_block_forward", B, n, C, NH, NKV);
  const std::size_t sn = static_cast<std::size_t>(n), sC = static_cast<std::size_t>(C);
  const std::size_t hs = sC / static_cast<std::size_t>(NH), lq = static_cast<std::size_t>(ldq),
                    lkv = static_cast<std::size_t>(ldkv);
  const std::size_t group = static_cast<std::size_t>(NH / NKV);
  const A scale = static_cast<A>(1) / std::sqrt(static_cast<A>(hs));
  std::vector<A> s(sn), acc(hs);
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
    for (std::size_t h = 0; h < static_cast<std::size_t>(NH); ++h)
      for (std::size_t t = 0; t < sn; ++t) {
        const T* qt = q + (b * sn + t) * lq + h * hs;
        const std::size_t keys = causal ? t + 1 : sn, kvh = h / group * hs;
        const std::size_t from = static_cast<std::size_t>(docs.first_key(b * sn + t, static_cast<int>(keys)));
        A m = -std::numeric_limits<A>::infinity();
        for (std::size_t j = from; j < keys; ++j) {
          const T* kj = k + (b * sn + j) * lkv + kvh;
          A dot = 0;
          for (std::size_t d = 0; d < hs; ++d) dot += static_cast<A>(qt[d]) * static_cast<A>(kj[d]);
          s[j] = dot * scale;
          if (s[j] > m) m = s[j];
        }
        A sum = 0;
        for (std::size_t j = from; j < keys; ++j) sum += s[j] = std::exp(s[j] - m);
        for (std::size_t d = 0; d < hs; ++d) acc[d] = 0;
        for (std::size_t j = from; j < keys; ++j) {  // the block's own output, normalised
          const T* vj = v + (b * sn + j) * lkv + kvh;
          const A p = s[j] / sum;
          for (std::size_t d = 0; d < hs; ++d) acc[d] += p * static_cast<A>(vj[d]);
        }
        const A l_new = from < keys ? m + std::log(sum) : -std::numeric_limits<A>::infinity();
        A& l = lse[(b * static_cast<std::size_t>(NH) + h) * sn + t];
        A* ot = o + (b * sn + t) * sC + h * hs;
        if (first) {
          for (std::size_t d = 0; d < hs; ++d) ot[d] = acc[d];
          l = l_new;
        } else if (from < keys) {  // else nothing of this block to merge
          const A top = std::max(l, l_new), merged = top + std::log(std::exp(l - top) + std::exp(l_new - top));
          const A keep = std::exp(l - merged), add = std::exp(l_new - merged);
          for (std::size_t d = 0; d < hs; ++d) ot[d] = ot[d] * keep + acc[d] * add;
          l = merged;
        }
      }
}

// Dd[b, h, i] = dout[b, i, h, :] . out[b, i, h, :] (rows of C, [B, n, C]): the backward's D.
template <class T>
void attention_row_dot(acc_t<T>* Dd, const T* dout, const T* out, int B, int n, int C, int NH) {
  using A = acc_t<T>;
  detail_attention::check_sizes("attention_row_dot", B, n, C, NH, 1);
  const std::size_t sn = static_cast<std::size_t>(n), sC = static_cast<std::size_t>(C);
  const std::size_t hs = sC / static_cast<std::size_t>(NH);
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
    for (std::size_t h = 0; h < static_cast<std::size_t>(NH); ++h)
      for (std::size_t t = 0; t < sn; ++t) {
        A D = 0;
        for (std::size_t d = 0; d < hs; ++d)
          D += static_cast<A>(dout[(b * sn + t) * sC + h * hs + d]) * static_cast<A>(out[(b * sn + t) * sC + h * hs + d]);
        Dd[(b * static_cast<std::size_t>(NH) + h) * sn + t] = D;
      }
}

// The gradients of one block, given the rows' final lse (over every key of the sequence)
// and Dd: p = exp(s - lse) is then the block's share of the softmax, and
//   dq += ds k / sqrt(hs),  dk += ds q / sqrt(hs),  dv += p dout,  ds = p (dout . v - D).
// dq [B, n, C] (row stride C), dk and dv (row stride lddkv, key/value heads) are acc_t<T>
// and "+=".
template <class T>
void attention_block_backward(acc_t<T>* dq, acc_t<T>* dk, acc_t<T>* dv, int lddkv, const T* dout, const acc_t<T>* Dd,
                              const acc_t<T>* lse, const T* q, const T* k, const T* v, int ldq, int ldkv, int B, int n,
                              int C, int NH, int NKV, bool causal, DocumentMask docs) {
  using A = acc_t<T>;
  detail_attention::check_sizes("attention_block_backward", B, n, C, NH, NKV);
  const std::size_t sn = static_cast<std::size_t>(n), sC = static_cast<std::size_t>(C);
  const std::size_t hs = sC / static_cast<std::size_t>(NH), lq = static_cast<std::size_t>(ldq),
                    lkv = static_cast<std::size_t>(ldkv), ld = static_cast<std::size_t>(lddkv);
  const std::size_t group = static_cast<std::size_t>(NH / NKV);
  const A scale = static_cast<A>(1) / std::sqrt(static_cast<A>(hs));
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
    for (std::size_t h = 0; h < static_cast<std::size_t>(NH); ++h)
      for (std::size_t t = 0; t < sn; ++t) {
        const T* qt = q + (b * sn + t) * lq + h * hs;
        const std::size_t kvh = h / group * hs;
        const T* go = dout + (b * sn + t) * sC + h * hs;
        const std::size_t row = (b * static_cast<std::size_t>(NH) + h) * sn + t;
        const A l = lse[row], D = Dd[row];
        A* dqt = dq + (b * sn + t) * sC + h * hs;
        const std::size_t keys = causal ? t + 1 : sn;
        for (std::size_t j = static_cast<std::size_t>(docs.first_key(b * sn + t, static_cast<int>(keys))); j < keys;
             ++j) {
          const T* kj = k + (b * sn + j) * lkv + kvh;
          const T* vj = v + (b * sn + j) * lkv + kvh;
          A dot = 0, dp = 0;
          for (std::size_t d = 0; d < hs; ++d) {
            dot += static_cast<A>(qt[d]) * static_cast<A>(kj[d]);
            dp += static_cast<A>(go[d]) * static_cast<A>(vj[d]);
          }
          const A p = std::exp(dot * scale - l);
          const A ds = p * (dp - D) * scale;
          A* dkj = dk + (b * sn + j) * ld + kvh;
          A* dvj = dv + (b * sn + j) * ld + kvh;
          for (std::size_t d = 0; d < hs; ++d) {
            dqt[d] += ds * static_cast<A>(kj[d]);
            dkj[d] += ds * static_cast<A>(qt[d]);
            dvj[d] += p * static_cast<A>(go[d]);
          }
        }
      }
}

// ---- whole causal sequences: one block ----------------------------------------------------

// doc_first [B,T]: each token's document start (context/documents.hpp), or null (one
// sequence a row).
template <class T>
void attention_forward(T* out, acc_t<T>* lse, const T* qkv, int B, int T_, int C, int NH, int NKV,
                       const int* doc_first = nullptr) {
  detail_attention::check_sizes("attention_forward", B, T_, C, NH, NKV);
  const int Ckv = C / NH * NKV, ld = C + 2 * Ckv;
  std::vector<acc_t<T>> o(static_cast<std::size_t>(B) * static_cast<std::size_t>(T_) * static_cast<std::size_t>(C));
  attention_block_forward(o.data(), lse, qkv, qkv + C, qkv + C + Ckv, ld, ld, B, T_, C, NH, NKV, true,
                          DocumentMask{doc_first, 0}, true);
  for (std::size_t i = 0; i < o.size(); ++i) out[i] = static_cast<T>(o[i]);
}

// dqkv [B,T,C + 2Ckv] is overwritten; each (b, h)'s gradients are summed in acc_t<T> and
// rounded to T once, so bf16 keys and values are not accumulated in bf16 over t.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const acc_t<T>* lse, int B, int T_, int C,
                        int NH, int NKV, const int* doc_first = nullptr) {
  using A = acc_t<T>;
  detail_attention::check_sizes("attention_backward", B, T_, C, NH, NKV);
  const int Ckv = C / NH * NKV, ld = C + 2 * Ckv;
  const std::size_t N = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_), sld = static_cast<std::size_t>(ld);
  const std::size_t sC = static_cast<std::size_t>(C);
  std::vector<A> dq(N * sC, A(0)), g(N * sld, A(0)), Dd(N * static_cast<std::size_t>(NH));  // g: d[. | k | v]
  attention_row_dot(Dd.data(), dout, out, B, T_, C, NH);
  attention_block_backward(dq.data(), g.data() + C, g.data() + C + Ckv, ld, dout, Dd.data(), lse, qkv, qkv + C,
                           qkv + C + Ckv, ld, ld, B, T_, C, NH, NKV, true, DocumentMask{doc_first, 0});
  for (std::size_t r = 0; r < N; ++r)
    for (std::size_t c = 0; c < sld; ++c) dqkv[r * sld + c] = static_cast<T>(c < sC ? dq[r * sC + c] : g[r * sld + c]);
}

}  // namespace fived::kernels::host
