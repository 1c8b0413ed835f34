#pragma once
// Mixture of experts: the router, contract of fived/kernels/host/moe.hpp with a leading
// stream (scores, gates and their gradients float; the permutations: kernels/cuda/moe.hpp):
//   router_scores(s, scores, logits, N, E, sigmoid)            one warp per row (softmax: max,
//                                                              exp-sum, divide; or sigmoid)
//   router_topk(s, expert, gate, scores, bias, N, E, k, renorm) one thread per row, the host's
//                                                              selection loop (ties to the lower expert)
//   router_backward(s, dlogits, dgate, scores, expert, gate, daux, N, E, k, renorm, sigmoid)
//                                                              one thread per row, the host's math
//   router_score_sums(s, sums, scores, N, E)                   column_reduce (fixed order)
//   expert_bias_step(s, bias, loads, blocks, E, rate[, skip])  one thread per (block, expert), each
//                                                              summing its block's loads in order;
//                                                              none moves where *skip is not finite
//
// Deterministic: every output element is written by one thread (or one block) that sums its
// terms in a fixed order (block reductions are fixed trees, never float atomics).

#include <cstddef>
#include <string>

#include <fived/device/cuda.hpp>
#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

inline constexpr int moe_rows_per_block = 8;  // router_scores: one warp per row, 256 threads

template <class T>
__global__ void router_scores_kernel(float* scores, const T* logits, int N, int E, bool sigmoid) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int row = static_cast<int>(blockIdx.x) * moe_rows_per_block + static_cast<int>(threadIdx.x) / 32;
  if (row >= N) return;
  const T* l = logits + static_cast<std::size_t>(row) * E;
  float* s = scores + static_cast<std::size_t>(row) * E;
  if (sigmoid) {
    // expf and an exact division, not sigmoid_f: the scores choose the experts, and a near tie
    // must fall the same way as on the host (the kernel is small; speed is not at stake)
    for (int e = lane; e < E; e += 32) s[e] = 1.0f / (1.0f + expf(-to_float(l[e])));
    return;
  }
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, to_float(l[e]));
  m = warp_max(m);
  float sum = 0.0f;
  for (int e = lane; e < E; e += 32) {
    const float v = expf(to_float(l[e]) - m);
    s[e] = v;
    sum += v;
  }
  sum = warp_sum(sum);
  for (int e = lane; e < E; e += 32) s[e] = s[e] / sum;  // this lane wrote s[e]: no barrier needed
}

// The host's selection sort of k, on the row's own outputs (this thread wrote ex[0, j)).
// (Templates, the kernels below as every kernel in these headers: one definition however
// many TUs include them. Here S = float.)
template <class S>
__global__ void router_topk_kernel(int* expert, S* gate, const S* scores, const float* bias, int N, int E, int k,
                                   bool renormalize) {
  const int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (t >= N) return;
  const S* s = scores + static_cast<std::size_t>(t) * E;
  int* ex = expert + static_cast<std::size_t>(t) * k;
  S* g = gate + static_cast<std::size_t>(t) * k;
  S sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    S best_v = 0.0f;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken = taken || ex[i] == e;
      const S v = s[e] + (bias != nullptr ? static_cast<S>(bias[e]) : S(0));
      if (!taken && (best < 0 || v > best_v)) best = e, best_v = v;  // strictly greater: ties to the lower expert
    }
    ex[j] = best;
    const S gj = s[best];
    g[j] = gj;
    sum += gj;
  }
  if (renormalize)
    for (int j = 0; j < k; ++j) g[j] = g[j] / sum;
}

// ds[e] of one row, as the host accumulates it: daux[e], then (dg[j] - dot) / S for every j
// that chose e, in j order. Recomputed where needed instead of held in an [E] array.
__device__ __forceinline__ float router_ds(int e, const float* daux, const float* dg, const int* ex, int k, float dot,
                                           float S) {
  float ds = daux != nullptr ? daux[e] : 0.0f;
  for (int j = 0; j < k; ++j)
    if (ex[j] == e) ds += (dg[j] - dot) / S;
  return ds;
}

template <class T>
__global__ void router_backward_kernel(T* dlogits, const float* dgate, const float* scores, const int* expert,
                                       const float* gate, const float* daux, int N, int E, int k, bool renormalize,
                                       bool sigmoid) {
  const int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (t >= N) return;
  const float* s = scores + static_cast<std::size_t>(t) * E;
  const float* dg = dgate + static_cast<std::size_t>(t) * k;
  const float* g = gate + static_cast<std::size_t>(t) * k;
  const int* ex = expert + static_cast<std::size_t>(t) * k;
  T* dl = dlogits + static_cast<std::size_t>(t) * E;
  // gate_j = s_j / S, S the sum of the chosen scores: ds_i = (dg_i - sum_j dg_j gate_j) / S
  float dot = 0.0f, S = 1.0f;
  if (renormalize) {
    S = 0.0f;
    for (int j = 0; j < k; ++j) {
      dot += dg[j] * g[j];
      S += s[ex[j]];
    }
  }
  if (sigmoid) {
    for (int e = 0; e < E; ++e) dl[e] = from_float<T>(router_ds(e, daux, dg, ex, k, dot, S) * s[e] * (1.0f - s[e]));
    return;
  }
  float sd = 0.0f;
  for (int e = 0; e < E; ++e) sd += router_ds(e, daux, dg, ex, k, dot, S) * s[e];
  for (int e = 0; e < E; ++e) dl[e] = from_float<T>(s[e] * (router_ds(e, daux, dg, ex, k, dot, S) - sd));
}

// router_score_sums through column_reduce: (scores[t, e], unused) at (t, e); sums[e] = total.
struct ScoreColumn {
  const float* scores;
  int E;
  __device__ float2 operator()(int r, int c) const {
    return make_float2(scores[static_cast<std::size_t>(r) * E + c], 0.0f);
  }
};
struct StoreScoreSum {
  float* sums;
  __device__ void operator()(int c, float2 s) const { sums[c] = s.x; }
};

// (A template, as every kernel defined in a header: a plain __global__ would be defined again
// in every unit that includes it.) The sums in double: exact for any step's whole rows.
template <class S>
__global__ void expert_bias_step_kernel(float* bias, const S* loads, int blocks, int E, double rate,
                                        const double* skip_if_non_finite) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= blocks * E) return;
  if (skip_if_non_finite != nullptr && !isfinite(*skip_if_non_finite)) return;
  const S* load = loads + i / E * E;
  double total = 0;
  for (int e = 0; e < E; ++e) total += static_cast<double>(load[e]);
  const double d = total - static_cast<double>(E) * static_cast<double>(loads[i]);
  bias[i] += static_cast<float>(rate) * static_cast<float>((d > 0) - (d < 0));  // as the host's
}

inline void check_router_sizes(const char* kernel, int N, int E) {
  require_non_negative(kernel, "N", N);
  require_positive(kernel, "E", E);
  require(static_cast<long long>(N) * E <= 0x7fffffffLL, kernel, "N*E must fit in an int");
}

}  // namespace detail

template <class T>
void router_scores(cudaStream_t stream, float* scores, const T* logits, int N, int E, bool sigmoid) {
  static_assert(is_element_v<T>, "router_scores: element type must be float or fived::bf16");
  detail::check_router_sizes("router_scores", N, E);
  if (N == 0) return;
  const unsigned blocks = static_cast<unsigned>((N + detail::moe_rows_per_block - 1) / detail::moe_rows_per_block);
  detail::router_scores_kernel<<<blocks, 32 * detail::moe_rows_per_block, 0, stream>>>(scores, dev(logits), N, E,
                                                                                       sigmoid);
  FIVED_CUDA_CHECK_LAUNCH("router_scores_kernel");
}

inline void router_topk(cudaStream_t stream, int* expert, float* gate, const float* scores, const float* bias, int N,
                        int E, int k, bool renormalize) {
  detail::check_router_sizes("router_topk", N, E);
  detail::require(k >= 1 && k <= E, "router_topk",
                  "needs 1 <= k <= E (k=" + std::to_string(k) + ", E=" + std::to_string(E) + ")");
  if (N == 0) return;
  detail::router_topk_kernel<<<(static_cast<unsigned>(N) + 127u) / 128u, 128, 0, stream>>>(expert, gate, scores, bias,
                                                                                           N, E, k, renormalize);
  FIVED_CUDA_CHECK_LAUNCH("router_topk_kernel");
}

template <class T>
void router_backward(cudaStream_t stream, T* dlogits, const float* dgate, const float* scores, const int* expert,
                     const float* gate, const float* daux, int N, int E, int k, bool renormalize, bool sigmoid) {
  static_assert(is_element_v<T>, "router_backward: element type must be float or fived::bf16");
  detail::check_router_sizes("router_backward", N, E);
  detail::require(k >= 1 && k <= E, "router_backward",
                  "needs 1 <= k <= E (k=" + std::to_string(k) + ", E=" + std::to_string(E) + ")");
  if (N == 0) return;
  detail::router_backward_kernel<<<(static_cast<unsigned>(N) + 127u) / 128u, 128, 0, stream>>>(
      dev(dlogits), dgate, scores, expert, gate, daux, N, E, k, renormalize, sigmoid);
  FIVED_CUDA_CHECK_LAUNCH("router_backward_kernel");
}

// sums[e] = sum over t of scores[t, e] ("="; zeros when N = 0, as the host).
inline void router_score_sums(cudaStream_t stream, float* sums, const float* scores, int N, int E) {
  detail::check_router_sizes("router_score_sums", N, E);
  if (N == 0) {
    FIVED_CUDA_CHECK(cudaMemsetAsync(sums, 0, static_cast<std::size_t>(E) * sizeof(float), stream));
    return;
  }
  column_reduce(stream, detail::ScoreColumn{scores, E}, detail::StoreScoreSum{sums}, N, E);
}

inline void expert_bias_step(cudaStream_t stream, float* bias, const float* loads, int blocks, int E, double rate,
                             const double* skip_if_non_finite = nullptr) {
  detail::require_non_negative("expert_bias_step", "blocks", blocks);
  detail::require_positive("expert_bias_step", "E", E);
  if (blocks == 0) return;
  constexpr int threads = 128;
  detail::expert_bias_step_kernel<float><<<(blocks * E + threads - 1) / threads, threads, 0, stream>>>(
      bias, loads, blocks, E, rate, skip_if_non_finite);
  FIVED_CUDA_CHECK_LAUNCH("expert_bias_step_kernel");
}

}  // namespace fived::kernels::cuda
