#pragma once
// Host kernels of a mixture-of-experts layer: the router (scores, top-k, its backward) and
// the permutations that carry tokens to their experts and back. Shared contract with
// kernels/cuda/moe.hpp.
//
// N tokens, E experts, k experts per token. An assignment is a = t*k + j: token t's j-th
// choice. The dispatch order sorts the assignments by expert (stable, so by token within
// an expert); `pos[a]` is the assignment's row in that order (-1 when a capacity dropped
// it) and `token_of[p]` the token of row p. Everything after routing is a gather in one of
// the two directions, so every output element is written by one thread of work: no atomics
// and the same bits on every run.
//
//   router_scores      scores[N, E] = softmax(logits) per row, or sigmoid(logits)
//   router_topk        expert[a], gate[a]: the k largest (score + bias) per row, ties to the
//                      lower expert; the gate is the score itself (the bias only selects),
//                      divided by the sum of the chosen k when `renormalize`
//   dispatch_plan      loads[E] (and counts[E] in host memory, when asked for), token_of,
//                      pos from expert[a] (capacity < 0: no limit). padded: expert e's rows
//                      are [e·capacity, (e+1)·capacity) whatever it took, the slots it
//                      left empty have token_of -1: every size after routing is static
//   gather_rows        out[p] = x[index[p]], a row of zeros where index[p] < 0
//   moe_combine        out[t] = sum_j gate[a] * y[pos[a]]         ("=", dropped rows add 0)
//   moe_combine_backward   dy[pos[a]] = gate[a] * dout[t];  dgate[a] = <dout[t], y[pos[a]]>
//   moe_dispatch_backward  dx[t] += sum_j dxp[pos[a]]
//   router_backward    dlogits[N, E] ("=") from dgate through the renormalisation and the
//                      score function, plus daux[e] (may be null) on every score: the
//                      load-balancing loss's gradient, which is the same for every token
//   router_score_sums  sums[e] = sum_t scores[t, e]  (the load-balancing loss's P_e * N)
//   expert_bias_step   bias[m, e] += rate * sign(mean_e' loads[m, e'] - loads[m, e]) for each of
//                      `blocks` MoE blocks: the selection bias of auxiliary-loss-free
//                      balancing (DeepSeek-V3) moved towards equal loads. Loads are whole rows,
//                      compared as sum - E * load in double (exact). With a skip value (device
//                      memory) that is not finite, nothing moves (a skipped optimizer step)
//
// Scores, gates and their gradients are acc_t<T> (fp32 for bf16); rows are T.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

namespace detail_moe {
inline std::size_t at(int row, int width) { return static_cast<std::size_t>(row) * static_cast<std::size_t>(width); }
inline void check(const char* what, bool ok, const std::string& why) {
  if (!ok) throw std::invalid_argument(std::string("fived::kernels::host::") + what + ": " + why);
}
}  // namespace detail_moe

template <class T>
void router_scores(acc_t<T>* scores, const T* logits, int N, int E, bool sigmoid) {
  using A = acc_t<T>;
  using detail_moe::at;
  for (int t = 0; t < N; ++t) {
    const T* l = logits + at(t, E);
    A* s = scores + at(t, E);
    if (sigmoid) {
      for (int e = 0; e < E; ++e) s[e] = A(1) / (A(1) + std::exp(-static_cast<A>(l[e])));
      continue;
    }
    A m = static_cast<A>(l[0]);
    for (int e = 1; e < E; ++e) m = std::max(m, static_cast<A>(l[e]));
    A sum = 0;
    for (int e = 0; e < E; ++e) sum += s[e] = std::exp(static_cast<A>(l[e]) - m);
    for (int e = 0; e < E; ++e) s[e] /= sum;
  }
}

template <class A>
void router_topk(int* expert, A* gate, const A* scores, const float* bias, int N, int E, int k, bool renormalize) {
  using detail_moe::at;
  detail_moe::check("router_topk", k >= 1 && k <= E, "needs 1 <= k <= E (k=" + std::to_string(k) + ", E=" +
                                                           std::to_string(E) + ")");
  for (int t = 0; t < N; ++t) {
    const A* s = scores + at(t, E);
    int* ex = expert + at(t, k);
    A* g = gate + at(t, k);
    A sum = 0;
    for (int j = 0; j < k; ++j) {  // selection sort of k: E is small
      int best = -1;
      A best_v = 0;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken = taken || ex[i] == e;
        const A v = s[e] + (bias ? static_cast<A>(bias[e]) : A(0));
        if (!taken && (best < 0 || v > best_v)) best = e, best_v = v;
      }
      ex[j] = best;
      sum += g[j] = s[best];
    }
    if (renormalize)
      for (int j = 0; j < k; ++j) g[j] /= sum;
  }
}

template <class A>
void dispatch_plan(int* token_of, int* pos, A* loads, int* host_counts, const int* expert, int N, int k, int E,
                   int capacity, bool padded) {
  detail_moe::check("dispatch_plan", !padded || capacity >= 0, "padded rows need a capacity (capacity_factor > 0)");
  const int n = N * k;
  std::vector<int> counts(static_cast<std::size_t>(E), 0), offset(static_cast<std::size_t>(E) + 1, 0);
  for (int a = 0; a < n; ++a) {
    detail_moe::check("dispatch_plan", expert[a] >= 0 && expert[a] < E,
                      "expert[" + std::to_string(a) + "] = " + std::to_string(expert[a]) + " is not in [0, E)");
    int& c = counts[static_cast<std::size_t>(expert[a])];
    if (capacity < 0 || c < capacity) ++c;
  }
  for (int e = 0; e < E; ++e) {
    const auto i = static_cast<std::size_t>(e);
    offset[i + 1] = padded ? (e + 1) * capacity : offset[i] + counts[i];
    loads[e] = static_cast<A>(counts[i]);
    if (host_counts != nullptr) host_counts[e] = counts[i];
  }
  if (padded) std::fill_n(token_of, static_cast<std::size_t>(E) * static_cast<std::size_t>(capacity), -1);
  std::vector<int> filled(static_cast<std::size_t>(E), 0);
  for (int a = 0; a < n; ++a) {
    const auto e = static_cast<std::size_t>(expert[a]);
    if (filled[e] == counts[e]) {
      pos[a] = -1;  // over capacity: dropped
      continue;
    }
    const int p = offset[e] + filled[e]++;
    pos[a] = p;
    token_of[p] = a / k;
  }
}

template <class T>
void gather_rows(T* out, const T* x, const int* index, int rows, int C) {
  using detail_moe::at;
  for (int p = 0; p < rows; ++p)
    for (int c = 0; c < C; ++c)
      out[at(p, C) + static_cast<std::size_t>(c)] = index[p] < 0 ? T(0) : x[at(index[p], C) + static_cast<std::size_t>(c)];
}

template <class T, class A>
void moe_combine(T* out, const T* y, const int* pos, const A* gate, int N, int k, int C) {
  using detail_moe::at;
  std::vector<A> acc(static_cast<std::size_t>(C));
  for (int t = 0; t < N; ++t) {
    std::fill(acc.begin(), acc.end(), A(0));
    for (int j = 0; j < k; ++j) {
      const int p = pos[at(t, k) + static_cast<std::size_t>(j)];
      if (p < 0) continue;
      const A g = gate[at(t, k) + static_cast<std::size_t>(j)];
      for (int c = 0; c < C; ++c) acc[static_cast<std::size_t>(c)] += g * static_cast<A>(y[at(p, C) + static_cast<std::size_t>(c)]);
    }
    for (int c = 0; c < C; ++c) out[at(t, C) + static_cast<std::size_t>(c)] = static_cast<T>(acc[static_cast<std::size_t>(c)]);
  }
}

template <class T, class A>
void moe_combine_backward(T* dy, A* dgate, const T* dout, const T* y, const int* pos, const A* gate, int N, int k,
                          int C) {
  using detail_moe::at;
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      const std::size_t a = at(t, k) + static_cast<std::size_t>(j);
      const int p = pos[a];
      A d = 0;
      if (p >= 0)
        for (int c = 0; c < C; ++c) {
          const A g = static_cast<A>(dout[at(t, C) + static_cast<std::size_t>(c)]);
          d += g * static_cast<A>(y[at(p, C) + static_cast<std::size_t>(c)]);
          dy[at(p, C) + static_cast<std::size_t>(c)] = static_cast<T>(gate[a] * g);
        }
      dgate[a] = d;
    }
}

template <class T>
void moe_dispatch_backward(T* dx, const T* dxp, const int* pos, int N, int k, int C) {
  using detail_moe::at;
  using A = acc_t<T>;
  for (int t = 0; t < N; ++t)
    for (int c = 0; c < C; ++c) {
      A s = static_cast<A>(dx[at(t, C) + static_cast<std::size_t>(c)]);
      for (int j = 0; j < k; ++j) {
        const int p = pos[at(t, k) + static_cast<std::size_t>(j)];
        if (p >= 0) s += static_cast<A>(dxp[at(p, C) + static_cast<std::size_t>(c)]);
      }
      dx[at(t, C) + static_cast<std::size_t>(c)] = static_cast<T>(s);
    }
}

template <class T, class A>
void router_backward(T* dlogits, const A* dgate, const A* scores, const int* expert, const A* gate,
                     const A* daux, int N, int E, int k, bool renormalize, bool sigmoid) {
  using detail_moe::at;
  std::vector<A> ds(static_cast<std::size_t>(E));
  for (int t = 0; t < N; ++t) {
    const A* s = scores + at(t, E);
    const A* dg = dgate + at(t, k);
    const A* g = gate + at(t, k);
    const int* ex = expert + at(t, k);
    for (int e = 0; e < E; ++e) ds[static_cast<std::size_t>(e)] = daux ? daux[e] : A(0);
    // gate_j = s_j / S, S the sum of the chosen scores: ds_i = (dg_i - sum_j dg_j gate_j) / S
    A dot = 0, S = 1;
    if (renormalize) {
      S = 0;
      for (int j = 0; j < k; ++j) dot += dg[j] * g[j], S += s[ex[j]];
    }
    for (int j = 0; j < k; ++j) ds[static_cast<std::size_t>(ex[j])] += (dg[j] - dot) / S;
    T* dl = dlogits + at(t, E);
    if (sigmoid) {
      for (int e = 0; e < E; ++e) dl[e] = static_cast<T>(ds[static_cast<std::size_t>(e)] * s[e] * (A(1) - s[e]));
    } else {
      A sd = 0;
      for (int e = 0; e < E; ++e) sd += ds[static_cast<std::size_t>(e)] * s[e];
      for (int e = 0; e < E; ++e) dl[e] = static_cast<T>(s[e] * (ds[static_cast<std::size_t>(e)] - sd));
    }
  }
}

template <class A>
void router_score_sums(A* sums, const A* scores, int N, int E) {
  for (int e = 0; e < E; ++e) sums[e] = 0;
  for (int t = 0; t < N; ++t)
    for (int e = 0; e < E; ++e) sums[e] += scores[detail_moe::at(t, E) + static_cast<std::size_t>(e)];
}

// skip_if_non_finite: null, or a value in device memory (a step's squared gradient norm):
// when it is not finite, the bias stays (a step AdamWConfig::skip_non_finite skipped).
template <class A>
void expert_bias_step(float* bias, const A* loads, int blocks, int E, double rate,
                      const double* skip_if_non_finite = nullptr) {
  if (skip_if_non_finite != nullptr && !std::isfinite(*skip_if_non_finite)) return;
  for (int m = 0; m < blocks; ++m) {
    const A* load = loads + detail_moe::at(m, E);
    double total = 0;  // (exact for any step's whole rows, as the CUDA kernel's)
    for (int e = 0; e < E; ++e) total += static_cast<double>(load[e]);
    for (int e = 0; e < E; ++e) {
      const double d = total - static_cast<double>(E) * static_cast<double>(load[e]);
      const float sign = static_cast<float>((d > 0) - (d < 0));
      bias[detail_moe::at(m, E) + static_cast<std::size_t>(e)] += static_cast<float>(rate) * sign;
    }
  }
}

}  // namespace fived::kernels::host
