#pragma once
// Mixture of experts: the router and the permutations around the experts, contract of
// fived/kernels/host/moe.hpp with a leading stream (scores, gates and their gradients float):
//   router_scores(s, scores, logits, N, E, sigmoid)            one warp per row (softmax: max,
//                                                              exp-sum, divide; or sigmoid)
//   router_topk(s, expert, gate, scores, bias, N, E, k, renorm) one thread per row, the host's
//                                                              selection loop (ties to the lower expert)
//   dispatch_plan(s, scratch, token_of, pos, host_counts, expert, N, k, E, capacity)
//       CUB's stable radix sort of the assignments by expert (so by assignment within an
//       expert, the host's order), per-expert counts, then every sorted assignment writes its
//       own pos / token_of. The kept counts go to host memory: waits for the stream.
//   gather_rows(s, out, x, index, rows, C)                     one thread per output element
//   moe_combine(s, out, y, pos, gate, N, k, C)                 one thread per (t, c), j in order
//   moe_combine_backward(s, dy, dgate, dout, y, pos, gate, N, k, C)   one block per assignment
//   moe_dispatch_backward(s, dx, dxp, pos, N, k, C)            one thread per (t, c): dx + rows, j in order
//   router_backward(s, dlogits, dgate, scores, expert, gate, daux, N, E, k, renorm, sigmoid)
//                                                              one thread per row, the host's math
//   router_score_sums(s, sums, scores, N, E)                   column_reduce (fixed order)
//
// Deterministic: every output element is written by one thread (or one block) that sums its
// terms in a fixed order (block reductions are fixed trees, never float atomics). The only
// atomics are the integer per-expert counts of dispatch_plan, whose result does not depend on
// their order. N = 0 (or rows = 0) launches nothing.

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>

#include <fived/device/buffer.hpp>
#include <fived/device/cuda.hpp>
#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

// Device memory dispatch_plan works in, kept between calls (one per caller, e.g. per
// Ops<T, Cuda>): it grows when a larger N*k or E arrives and is reused as it is otherwise, so
// a steady-state step allocates nothing. dispatch_plan waits for the stream before it returns,
// so the previous call's work on these buffers is complete whenever they are replaced.
struct DispatchScratch {
  Buffer<int, Cuda> keys_sorted;     // [N*k] expert ids, sorted
  Buffer<int, Cuda> values;          // [N*k] 0, 1, ..., N*k-1: the assignments
  Buffer<int, Cuda> values_sorted;   // [N*k] the assignments in dispatch order
  Buffer<unsigned char, Cuda> temp;  // CUB's temporary storage
  Buffer<int, Cuda> meta;            // [4E+1]: counts, bad ids, kept counts, offsets of both

  void reserve(std::size_t n, int E) {
    if (keys_sorted.size() < n) {
      keys_sorted = Buffer<int, Cuda>(n);
      values = Buffer<int, Cuda>(n);
      values_sorted = Buffer<int, Cuda>(n);
    }
    const std::size_t m = 4 * static_cast<std::size_t>(E) + 1;
    if (meta.size() < m) meta = Buffer<int, Cuda>(m);
  }
  void reserve_temp(std::size_t bytes) {
    if (temp.size() < bytes) temp = Buffer<unsigned char, Cuda>(bytes);
  }
};

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

template <class I>
__global__ void moe_iota_kernel(I* p, I n) {
  for (I i = static_cast<I>(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += static_cast<I>(gridDim.x * blockDim.x))
    p[i] = i;
}

// counts[e] += assignments to expert e, counts[E] += ids outside [0, E) (reported after the
// sync). A block histogram in shared memory when E is small, else straight to global memory.
// Integer atomics: the counts do not depend on their order. (I = int.)
template <class I>
__global__ void moe_histogram_kernel(I* counts, const I* expert, I n, I E, bool in_shared) {
  extern __shared__ int moe_hist[];
  I* h = in_shared ? reinterpret_cast<I*>(moe_hist) : counts;
  if (in_shared) {
    for (int e = static_cast<int>(threadIdx.x); e <= E; e += static_cast<int>(blockDim.x)) h[e] = 0;
    __syncthreads();
  }
  for (int a = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); a < n;
       a += static_cast<int>(gridDim.x * blockDim.x)) {
    const I e = expert[a];
    atomicAdd(&h[e >= 0 && e < E ? e : E], I(1));
  }
  if (in_shared) {
    __syncthreads();
    for (int e = static_cast<int>(threadIdx.x); e <= E; e += static_cast<int>(blockDim.x))
      if (h[e] != 0) atomicAdd(&counts[e], h[e]);
  }
}

// The capacity and the exclusive offsets, E values in order on one thread (E is small).
// meta = [counts (E) | bad (1) | kept (E) | offset (E) | kept_offset (E)]. (I = int.)
template <class I>
__global__ void moe_offsets_kernel(I* meta, I E, I capacity) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const int* counts = meta;
  int* kept = meta + E + 1;
  int* offset = kept + E;
  int* kept_offset = offset + E;
  int o = 0, ko = 0;
  for (int e = 0; e < E; ++e) {
    const int c = counts[e];
    const int kc = capacity < 0 ? c : min(c, capacity);
    offset[e] = o;
    kept_offset[e] = ko;
    kept[e] = kc;
    o += c;
    ko += kc;
  }
}

// Sorted assignment i: its rank within its expert decides whether the capacity keeps it and
// which row it gets. Ids outside [0, E) are skipped here (dispatch_plan throws after the
// sync); every write stays inside pos[0, n) and token_of[0, sum of kept) regardless. (I = int.)
template <class I>
__global__ void moe_positions_kernel(I* token_of, I* pos, const I* keys_sorted, const I* values_sorted, const I* meta,
                                     I n, I k, I E) {
  const int* kept = meta + E + 1;
  const int* offset = kept + E;
  const int* kept_offset = offset + E;
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * blockDim.x)) {
    const int e = keys_sorted[i];
    if (e < 0 || e >= E) continue;
    const int a = values_sorted[i];
    const int r = i - offset[e];
    if (r < 0 || r >= kept[e]) {
      pos[a] = -1;  // over capacity: dropped
      continue;
    }
    const int p = kept_offset[e] + r;
    pos[a] = p;
    token_of[p] = a / k;
  }
}

template <class T>
__global__ void gather_rows_kernel(T* out, const T* x, const int* index, int rows, int C) {
  const std::size_t n = static_cast<std::size_t>(rows) * C;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t p = i / C, c = i % C;
    out[i] = x[static_cast<std::size_t>(index[p]) * C + c];
  }
}

template <class T>
__global__ void moe_combine_kernel(T* out, const T* y, const int* pos, const float* gate, int N, int k, int C) {
  const std::size_t n = static_cast<std::size_t>(N) * C;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t t = i / C, c = i % C;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const std::size_t a = t * k + j;
      const int p = pos[a];
      if (p < 0) continue;
      acc += gate[a] * to_float(y[static_cast<std::size_t>(p) * C + c]);
    }
    out[i] = from_float<T>(acc);
  }
}

// One block per assignment a: dy's row pos[a] and the dot product dgate[a] (each thread sums
// its columns in order, then block_sum's fixed tree).
template <class T>
__global__ void moe_combine_backward_kernel(T* dy, float* dgate, const T* dout, const T* y, const int* pos,
                                            const float* gate, int k, int C) {
  __shared__ float scratch[32];
  const std::size_t a = blockIdx.x;
  const int p = pos[a];
  if (p < 0) {  // the whole block leaves together: no block_sum below
    if (threadIdx.x == 0) dgate[a] = 0.0f;
    return;
  }
  const std::size_t t = a / static_cast<std::size_t>(k);
  const T* d = dout + t * C;
  const T* yr = y + static_cast<std::size_t>(p) * C;
  T* dyr = dy + static_cast<std::size_t>(p) * C;
  const float g = gate[a];
  float acc = 0.0f;
  for (int c = static_cast<int>(threadIdx.x); c < C; c += static_cast<int>(blockDim.x)) {
    const float dc = to_float(d[c]);
    acc += dc * to_float(yr[c]);
    dyr[c] = from_float<T>(g * dc);
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) dgate[a] = acc;
}

template <class T>
__global__ void moe_dispatch_backward_kernel(T* dx, const T* dxp, const int* pos, int N, int k, int C) {
  const std::size_t n = static_cast<std::size_t>(N) * C;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t t = i / C, c = i % C;
    float s = to_float(dx[i]);
    for (int j = 0; j < k; ++j) {
      const int p = pos[t * k + j];
      if (p >= 0) s += to_float(dxp[static_cast<std::size_t>(p) * C + c]);
    }
    dx[i] = from_float<T>(s);
  }
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

inline void check_router_sizes(const char* kernel, int N, int E) {
  require_non_negative(kernel, "N", N);
  require_positive(kernel, "E", E);
  require(static_cast<long long>(N) * E <= 0x7fffffffLL, kernel, "N*E must fit in an int");
}
inline void check_assignment_sizes(const char* kernel, int N, int k) {
  require_non_negative(kernel, "N", N);
  require_positive(kernel, "k", k);
  require(static_cast<long long>(N) * k <= 0x7fffffffLL, kernel, "N*k must fit in an int");
}
inline unsigned moe_block_for(int C) {  // one block per row / assignment: a multiple of 32, at most 256
  return C >= 256 ? 256u : 32u * static_cast<unsigned>((C + 31) / 32);
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

// host_counts: E ints of host memory, the kept count of each expert. Waits for the stream
// (the counts are the all-to-all's sizes, host values). The offsets are computed on the
// device (one thread, E values), so the only transfer is the counts coming back.
inline void dispatch_plan(cudaStream_t stream, DispatchScratch& scratch, int* token_of, int* pos, int* host_counts,
                          const int* expert, int N, int k, int E, int capacity) {
  detail::check_assignment_sizes("dispatch_plan", N, k);
  detail::require_positive("dispatch_plan", "E", E);
  detail::require(E <= (0x7fffffff - 1) / 4, "dispatch_plan", "E is too large");
  const int n = N * k;
  if (n == 0) {
    std::fill_n(host_counts, E, 0);
    return;
  }
  scratch.reserve(static_cast<std::size_t>(n), E);
  int bits = 1;  // the sort looks at the bits an id in [0, E) can have
  while (bits < 31 && (1 << bits) < E) ++bits;
  std::size_t temp_bytes = 0;
  FIVED_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, expert, scratch.keys_sorted.data(),
                                                   scratch.values.data(), scratch.values_sorted.data(), n, 0, bits,
                                                   stream));
  scratch.reserve_temp(temp_bytes);
  int* meta = scratch.meta.data();

  FIVED_CUDA_CHECK(cudaMemsetAsync(meta, 0, (static_cast<std::size_t>(E) + 1) * sizeof(int), stream));
  const bool in_shared = E < 8192;
  const std::size_t smem = in_shared ? (static_cast<std::size_t>(E) + 1) * sizeof(int) : 0;
  detail::moe_histogram_kernel<<<detail::grid_for(static_cast<std::size_t>(n), 256, 1024), 256, smem, stream>>>(
      meta, expert, n, E, in_shared);
  FIVED_CUDA_CHECK_LAUNCH("moe_histogram_kernel");
  detail::moe_offsets_kernel<<<1, 1, 0, stream>>>(meta, E, capacity);
  FIVED_CUDA_CHECK_LAUNCH("moe_offsets_kernel");

  detail::moe_iota_kernel<<<detail::grid_for(static_cast<std::size_t>(n), 256), 256, 0, stream>>>(scratch.values.data(),
                                                                                                  n);
  FIVED_CUDA_CHECK_LAUNCH("moe_iota_kernel");
  // Stable: equal experts keep their assignment order, the host's dispatch order.
  FIVED_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch.temp.data(), temp_bytes, expert, scratch.keys_sorted.data(),
                                                   scratch.values.data(), scratch.values_sorted.data(), n, 0, bits,
                                                   stream));
  detail::moe_positions_kernel<<<detail::grid_for(static_cast<std::size_t>(n), 256), 256, 0, stream>>>(
      token_of, pos, scratch.keys_sorted.data(), scratch.values_sorted.data(), meta, n, k, E);
  FIVED_CUDA_CHECK_LAUNCH("moe_positions_kernel");

  int bad = 0;
  FIVED_CUDA_CHECK(cudaMemcpyAsync(host_counts, meta + E + 1, static_cast<std::size_t>(E) * sizeof(int),
                                   cudaMemcpyDeviceToHost, stream));
  FIVED_CUDA_CHECK(cudaMemcpyAsync(&bad, meta + E, sizeof(int), cudaMemcpyDeviceToHost, stream));
  FIVED_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bad != 0)
    detail::bad_argument("dispatch_plan", std::to_string(bad) + " expert ids are not in [0, E) (E=" +
                                              std::to_string(E) + "); pos and token_of are not valid");
}

template <class T>
void gather_rows(cudaStream_t stream, T* out, const T* x, const int* index, int rows, int C) {
  static_assert(std::is_trivially_copyable_v<T>, "gather_rows copies elements: T must be trivially copyable");
  detail::require_non_negative("gather_rows", "rows", rows);
  detail::require_positive("gather_rows", "C", C);
  if (rows == 0) return;
  const std::size_t n = static_cast<std::size_t>(rows) * C;
  detail::gather_rows_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(out), dev(x), index, rows, C);
  FIVED_CUDA_CHECK_LAUNCH("gather_rows_kernel");
}

template <class T>
void moe_combine(cudaStream_t stream, T* out, const T* y, const int* pos, const float* gate, int N, int k, int C) {
  static_assert(is_element_v<T>, "moe_combine: element type must be float or fived::bf16");
  detail::check_assignment_sizes("moe_combine", N, k);
  detail::require_positive("moe_combine", "C", C);
  if (N == 0) return;
  const std::size_t n = static_cast<std::size_t>(N) * C;
  detail::moe_combine_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(out), dev(y), pos, gate, N, k, C);
  FIVED_CUDA_CHECK_LAUNCH("moe_combine_kernel");
}

template <class T>
void moe_combine_backward(cudaStream_t stream, T* dy, float* dgate, const T* dout, const T* y, const int* pos,
                          const float* gate, int N, int k, int C) {
  static_assert(is_element_v<T>, "moe_combine_backward: element type must be float or fived::bf16");
  detail::check_assignment_sizes("moe_combine_backward", N, k);
  detail::require_positive("moe_combine_backward", "C", C);
  if (N == 0) return;
  detail::moe_combine_backward_kernel<<<static_cast<unsigned>(N * k), detail::moe_block_for(C), 0, stream>>>(
      dev(dy), dgate, dev(dout), dev(y), pos, gate, k, C);
  FIVED_CUDA_CHECK_LAUNCH("moe_combine_backward_kernel");
}

template <class T>
void moe_dispatch_backward(cudaStream_t stream, T* dx, const T* dxp, const int* pos, int N, int k, int C) {
  static_assert(is_element_v<T>, "moe_dispatch_backward: element type must be float or fived::bf16");
  detail::check_assignment_sizes("moe_dispatch_backward", N, k);
  detail::require_positive("moe_dispatch_backward", "C", C);
  if (N == 0) return;
  const std::size_t n = static_cast<std::size_t>(N) * C;
  detail::moe_dispatch_backward_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(dx), dev(dxp), pos, N, k, C);
  FIVED_CUDA_CHECK_LAUNCH("moe_dispatch_backward_kernel");
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

}  // namespace fived::kernels::cuda
