#pragma once
// Causal multi-head self-attention with grouped key/value heads, flash-style, contract of
// fived/kernels/host/attention.hpp with a leading stream:
//   attention_forward(s, out, lse, qkv, B, T, C, NH, NKV)
//     qkv [B,T,C + 2Ckv] = [q | k | v], Ckv = NKV*hs; query head h uses columns
//     [h*hs, (h+1)*hs) of q and key/value head h / (NH/NKV) of k and v, hs = C/NH <= 128;
//     out [B,T,C]; lse [B,NH,T] = log sum_{j<=t} exp(q_t.k_j / sqrt(hs)) (natural log).
//   attention_backward(s, dqkv, dout, qkv, out, lse, B, T, C, NH, NKV)     dqkv is overwritten
// Neither pass stores a T x T matrix: the forward walks key tiles of 32 with an
// online softmax (fp32 running max, sum and output accumulators), one block per
// (32-query tile, head, batch); K/V tiles live in shared memory. The backward
// recomputes p = exp(s - lse), with D_t = dout_t . out_t precomputed ([B,NH,T]
// floats), in two deterministic passes (no atomics): one block per key tile of a
// key/value head accumulates dK and dV over the query tiles at or after it, for every
// query head of its group; one block per query tile accumulates dQ over the key tiles at
// or before it.
// bf16 at head size 32, 64 or 128 runs on tensor cores (kernels/cuda/flash_attention.hpp,
// attention_on_tensor_cores says when); the kernels below are the rest: fp32, any head size
// up to 128 (padded to 32, 64 or 128 inside), scores and products as fp32 FMAs from shared
// memory, and the reference the tensor-core kernels are tested beside.
//
// Ring attention's blocks (context parallelism), contract of the host block kernels:
//   attention_block_forward(s, o, lse, q, k, v, ldq, ldkv, B, n, C, NH, NKV, causal, first)
//   attention_row_dot(s, Dd, dout, out, B, n, C, NH)
//   attention_block_backward(s, dq, dk, dv, lddkv, dout, Dd, lse, q, k, v, ldq, ldkv, B, n, C, NH, NKV, causal)
// o, lse, dq, dk, dv are float. bf16 blocks that fit run on the tensor-core kernels (the
// same ones as whole sequences, merging into the float accumulators); the rest run one warp
// per query (or key) row walking the other side's rows with warp reductions: simple and
// deterministic, and far from the tile kernels in speed.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>

#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/cuda/flash_attention.hpp>

namespace fived::kernels::cuda {

namespace detail {

// Where sequence b's rows of query head h, and of the key/value head it reads, start in a
// [B,T,C + 2Ckv] q|k|v buffer (row stride `stride`).
template <class E>
struct QkvRows {
  std::size_t stride;
  const E *q, *k, *v;
  __device__ QkvRows(const E* qkv, int b, int h, int T, int C, int NH, int NKV, int hs)
      : stride(static_cast<std::size_t>(C) + 2 * static_cast<std::size_t>(NKV) * hs),
        q(qkv + static_cast<std::size_t>(b) * T * stride + static_cast<std::size_t>(h) * hs),
        k(qkv + static_cast<std::size_t>(b) * T * stride + C + static_cast<std::size_t>(h / (NH / NKV)) * hs),
        v(k + static_cast<std::size_t>(NKV) * hs) {}
};

inline constexpr int attn_tile = 32;     // queries and keys per tile
inline constexpr int attn_threads = 256; // 8 warps x 4 rows = 32 rows
inline constexpr int attn_rows = 4;      // rows (queries or keys) per warp

// Loads rows [t0, t0+32) of one head's part of qkv (or of a [B,T,C] tensor) into
// shared memory as float, stride `ld`, zero past T and past hs; times `mul`.
template <class E, int D>
__device__ __forceinline__ void attn_load_tile(float* dst, int ld, const E* src, std::size_t row_stride, int t0, int T,
                                               int hs, float mul) {
  for (int idx = static_cast<int>(threadIdx.x); idx < attn_tile * D; idx += attn_threads) {
    const int r = idx / D, d = idx % D, t = t0 + r;
    dst[r * ld + d] = (t < T && d < hs) ? to_float(src[static_cast<std::size_t>(t) * row_stride + d]) * mul : 0.0f;
  }
}

template <class E, int D>
__global__ void __launch_bounds__(attn_threads)
    attention_forward_kernel(E* out, float* lse, const E* qkv, int T, int C, int NH, int NKV, int hs, float scale) {
  constexpr int W = D / 32;
  extern __shared__ float smem[];
  float* sQ = smem;                         // [32][D]   (broadcast reads)
  float* sK = sQ + attn_tile * D;           // [32][D+1] (lane = key: padded)
  float* sV = sK + attn_tile * (D + 1);     // [32][D]   (lane = channel)
  const int qt = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest rows first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const QkvRows<E> at(qkv, b, h, T, C, NH, NKV, hs);
  const std::size_t rs = at.stride;
  const E* q = at.q;
  const int q0 = qt * attn_tile;
  attn_load_tile<E, D>(sQ, D, q, rs, q0, T, hs, scale);  // the 1/sqrt(hs) is folded into q

  float m[attn_rows], l[attn_rows], acc[attn_rows][W];
#pragma unroll
  for (int i = 0; i < attn_rows; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) acc[i][w] = 0.0f;
  }
  for (int kt = 0; kt <= qt; ++kt) {
    __syncthreads();  // the previous tile is no longer read
    attn_load_tile<E, D>(sK, D + 1, at.k, rs, kt * attn_tile, T, hs, 1.0f);
    attn_load_tile<E, D>(sV, D, at.v, rs, kt * attn_tile, T, hs, 1.0f);
    __syncthreads();
    float s[attn_rows];
#pragma unroll
    for (int i = 0; i < attn_rows; ++i) s[i] = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float k = sK[lane * (D + 1) + d];
#pragma unroll
      for (int i = 0; i < attn_rows; ++i) s[i] += sQ[(warp * attn_rows + i) * D + d] * k;
    }
    const int tk = kt * attn_tile + lane;
    float p[attn_rows];
#pragma unroll
    for (int i = 0; i < attn_rows; ++i) {
      const int tq = q0 + warp * attn_rows + i;
      const bool valid = tk <= tq && tk < T;
      const float si = valid ? s[i] : -INFINITY;
      const float m_new = fmaxf(m[i], warp_max(si));  // finite: key 0 of the first tile is always valid
      p[i] = valid ? expf(si - m_new) : 0.0f;
      const float corr = expf(m[i] - m_new);
      l[i] = l[i] * corr + warp_sum(p[i]);
      m[i] = m_new;
#pragma unroll
      for (int w = 0; w < W; ++w) acc[i][w] *= corr;
    }
    for (int j = 0; j < attn_tile; ++j) {
      float pj[attn_rows];
#pragma unroll
      for (int i = 0; i < attn_rows; ++i) pj[i] = __shfl_sync(0xffffffffu, p[i], j);
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float v = sV[j * D + w * 32 + lane];
#pragma unroll
        for (int i = 0; i < attn_rows; ++i) acc[i][w] += pj[i] * v;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < attn_rows; ++i) {
    const int tq = q0 + warp * attn_rows + i;
    if (tq >= T) continue;
    const float inv = 1.0f / l[i];
    E* o = out + (static_cast<std::size_t>(b) * T + tq) * C + static_cast<std::size_t>(h) * hs;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const int d = w * 32 + lane;
      if (d < hs) o[d] = from_float<E>(acc[i][w] * inv);
    }
    if (lane == 0) lse[(static_cast<std::size_t>(b) * NH + h) * T + tq] = m[i] + logf(l[i]);
  }
}

// Dd[b,h,t] = dout[b,t,h,:] . out[b,t,h,:], one warp per (b, t, h).
template <class E>
__global__ void attention_dot_kernel(float* Dd, const E* dout, const E* out, int B, int T, int C, int NH, int hs) {
  const long long row = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (row >= static_cast<long long>(B) * T * NH) return;
  const int h = static_cast<int>(row % NH);
  const long long bt = row / NH;
  const std::size_t off = static_cast<std::size_t>(bt) * C + static_cast<std::size_t>(h) * hs;
  float s = 0.0f;
  for (int d = lane; d < hs; d += 32) s += to_float(dout[off + d]) * to_float(out[off + d]);
  s = warp_sum(s);
  const int b = static_cast<int>(bt / T), t = static_cast<int>(bt % T);
  if (lane == 0) Dd[(static_cast<std::size_t>(b) * NH + h) * T + t] = s;
}

// The same with 16-byte loads, one block per token row (b, t): its C / vec16 pieces over the
// threads, `lanes` consecutive lanes a head (hs = lanes * vec16<E>, lanes a power of two up
// to 32, so a head's lanes share a warp).
template <class E>
__global__ void attention_dot_wide_kernel(float* Dd, const E* dout, const E* out, int T, int C, int NH, int lanes) {
  constexpr int W = vec16<E>;
  const int bt = static_cast<int>(blockIdx.x), b = bt / T, t = bt % T, pieces = C / W;
  const std::size_t row = static_cast<std::size_t>(bt) * C;
  for (int j0 = 0; j0 < pieces; j0 += static_cast<int>(blockDim.x)) {  // the same trip count in every thread
    const int j = j0 + static_cast<int>(threadIdx.x);
    float s = 0.0f;
    if (j < pieces) {
      float a[W], c[W];
      load_vec16(a, dout + row + static_cast<std::size_t>(j) * W);
      load_vec16(c, out + row + static_cast<std::size_t>(j) * W);
#pragma unroll
      for (int k = 0; k < W; ++k) s += a[k] * c[k];
    }
    for (int o = lanes / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (j < pieces && j % lanes == 0) Dd[(static_cast<std::size_t>(b) * NH + j / lanes) * T + t] = s;
  }
}

// Dd for B * T * NH rows: 16-byte loads where the rows allow.
template <class E>
void attention_dot(cudaStream_t stream, float* Dd, const E* dout, const E* out, int B, int T, int C, int NH, int hs) {
  const long long rows = static_cast<long long>(B) * T * NH;
  const int lanes = hs / vec16<E>;
  if (hs % vec16<E> == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0 && C % vec16<E> == 0 && aligned16({dout, out}) &&
      static_cast<long long>(B) * T <= 0x7fffffffLL) {
    const int pieces = C / vec16<E>, block = std::min(256, (pieces + 31) / 32 * 32);
    attention_dot_wide_kernel<<<static_cast<unsigned>(static_cast<long long>(B) * T), block, 0, stream>>>(Dd, dout, out, T, C, NH, lanes);
    FIVED_CUDA_CHECK_LAUNCH("attention_dot_wide_kernel");
    return;
  }
  attention_dot_kernel<<<grid_for(static_cast<std::size_t>(rows), 8, 0x7fffffffu), 256, 0, stream>>>(Dd, dout, out, B,
                                                                                                      T, C, NH, hs);
  FIVED_CUDA_CHECK_LAUNCH("attention_dot_kernel");
}

// dK and dV of one key tile of key/value head j, summed over the query tiles at or after it
// of every query head that reads j.
template <class E, int D>
__global__ void __launch_bounds__(attn_threads)
    attention_backward_kv_kernel(E* dqkv, const E* dout, const E* qkv, const float* lse, const float* Dd, int T, int C,
                                 int NH, int NKV, int hs, float scale) {
  constexpr int W = D / 32;
  extern __shared__ float smem[];
  float* sK = smem;                          // [32][D]   (broadcast)
  float* sV = sK + attn_tile * D;            // [32][D]   (broadcast)
  float* sQ = sV + attn_tile * D;            // [32][D+1] (lane = query: padded)
  float* sO = sQ + attn_tile * (D + 1);      // [32][D+1] dout tile
  float* sL = sO + attn_tile * (D + 1);      // [32] lse
  float* sD = sL + attn_tile;                // [32] D
  const int nt = static_cast<int>(gridDim.x);
  const int kt = static_cast<int>(blockIdx.x);  // tile 0 has the most work and starts first
  const int j = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z), group = NH / NKV;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const QkvRows<E> kv(qkv, b, j * group, T, C, NH, NKV, hs);
  const std::size_t rs = kv.stride;
  attn_load_tile<E, D>(sK, D, kv.k, rs, kt * attn_tile, T, hs, 1.0f);
  attn_load_tile<E, D>(sV, D, kv.v, rs, kt * attn_tile, T, hs, 1.0f);

  float dk[attn_rows][W], dv[attn_rows][W];
#pragma unroll
  for (int i = 0; i < attn_rows; ++i)
#pragma unroll
    for (int w = 0; w < W; ++w) dk[i][w] = dv[i][w] = 0.0f;

  for (int h = j * group; h < (j + 1) * group; ++h) {
    const std::size_t head = static_cast<std::size_t>(h) * hs;
    const E* q = qkv + static_cast<std::size_t>(b) * T * rs + head;
    const E* dO = dout + static_cast<std::size_t>(b) * T * C + head;
    const float* lse_bh = lse + (static_cast<std::size_t>(b) * NH + h) * T;
    const float* D_bh = Dd + (static_cast<std::size_t>(b) * NH + h) * T;
    for (int qt = kt; qt < nt; ++qt) {
      __syncthreads();
      attn_load_tile<E, D>(sQ, D + 1, q, rs, qt * attn_tile, T, hs, 1.0f);
      attn_load_tile<E, D>(sO, D + 1, dO, static_cast<std::size_t>(C), qt * attn_tile, T, hs, 1.0f);
      if (threadIdx.x < attn_tile) {
        const int t = qt * attn_tile + static_cast<int>(threadIdx.x);
        sL[threadIdx.x] = t < T ? lse_bh[t] : 0.0f;
        sD[threadIdx.x] = t < T ? D_bh[t] : 0.0f;
      }
      __syncthreads();
      // lane = query of this tile, i = key of this warp
      float s[attn_rows], dp[attn_rows];
#pragma unroll
      for (int i = 0; i < attn_rows; ++i) s[i] = dp[i] = 0.0f;
      for (int d = 0; d < D; ++d) {
        const float qd = sQ[lane * (D + 1) + d], od = sO[lane * (D + 1) + d];
#pragma unroll
        for (int i = 0; i < attn_rows; ++i) {
          s[i] += qd * sK[(warp * attn_rows + i) * D + d];
          dp[i] += od * sV[(warp * attn_rows + i) * D + d];
        }
      }
      const int tq = qt * attn_tile + lane;
      float p[attn_rows], ds[attn_rows];
#pragma unroll
      for (int i = 0; i < attn_rows; ++i) {
        const int tk = kt * attn_tile + warp * attn_rows + i;
        const bool valid = tq < T && tk <= tq;
        p[i] = valid ? expf(s[i] * scale - sL[lane]) : 0.0f;
        ds[i] = p[i] * (dp[i] - sD[lane]);
      }
      for (int u = 0; u < attn_tile; ++u) {
        float pu[attn_rows], dsu[attn_rows];
#pragma unroll
        for (int i = 0; i < attn_rows; ++i) {
          pu[i] = __shfl_sync(0xffffffffu, p[i], u);
          dsu[i] = __shfl_sync(0xffffffffu, ds[i], u);
        }
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const float o = sO[u * (D + 1) + w * 32 + lane], qv = sQ[u * (D + 1) + w * 32 + lane];
#pragma unroll
          for (int i = 0; i < attn_rows; ++i) {
            dv[i][w] += pu[i] * o;
            dk[i][w] += dsu[i] * qv;
          }
        }
      }
    }
  }
  const std::size_t k_col = static_cast<std::size_t>(C) + static_cast<std::size_t>(j) * hs,
                    v_col = k_col + static_cast<std::size_t>(NKV) * hs;
#pragma unroll
  for (int i = 0; i < attn_rows; ++i) {
    const int tk = kt * attn_tile + warp * attn_rows + i;
    if (tk >= T) continue;
    E* g = dqkv + (static_cast<std::size_t>(b) * T + tk) * rs;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const int d = w * 32 + lane;
      if (d < hs) {
        g[k_col + d] = from_float<E>(dk[i][w] * scale);
        g[v_col + d] = from_float<E>(dv[i][w]);
      }
    }
  }
}

// dQ of one query tile, summed over the key tiles at or before it.
template <class E, int D>
__global__ void __launch_bounds__(attn_threads)
    attention_backward_q_kernel(E* dqkv, const E* dout, const E* qkv, const float* lse, const float* Dd, int T, int C,
                                int NH, int NKV, int hs, float scale) {
  constexpr int W = D / 32;
  extern __shared__ float smem[];
  float* sQ = smem;                       // [32][D]   (broadcast)
  float* sO = sQ + attn_tile * D;         // [32][D]   (broadcast) dout tile
  float* sK = sO + attn_tile * D;         // [32][D+1] (lane = key: padded)
  float* sV = sK + attn_tile * (D + 1);   // [32][D+1]
  const int qt = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest rows first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const QkvRows<E> at(qkv, b, h, T, C, NH, NKV, hs);
  const std::size_t rs = at.stride, head = static_cast<std::size_t>(h) * hs;
  const E* q = at.q;
  const E* dO = dout + static_cast<std::size_t>(b) * T * C + head;
  const float* lse_bh = lse + (static_cast<std::size_t>(b) * NH + h) * T;
  const float* D_bh = Dd + (static_cast<std::size_t>(b) * NH + h) * T;
  const int q0 = qt * attn_tile;
  attn_load_tile<E, D>(sQ, D, q, rs, q0, T, hs, 1.0f);
  attn_load_tile<E, D>(sO, D, dO, static_cast<std::size_t>(C), q0, T, hs, 1.0f);
  float rl[attn_rows], rd[attn_rows], dq[attn_rows][W];
#pragma unroll
  for (int i = 0; i < attn_rows; ++i) {
    const int tq = q0 + warp * attn_rows + i;
    rl[i] = tq < T ? lse_bh[tq] : 0.0f;
    rd[i] = tq < T ? D_bh[tq] : 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) dq[i][w] = 0.0f;
  }
  for (int kt = 0; kt <= qt; ++kt) {
    __syncthreads();
    attn_load_tile<E, D>(sK, D + 1, at.k, rs, kt * attn_tile, T, hs, 1.0f);
    attn_load_tile<E, D>(sV, D + 1, at.v, rs, kt * attn_tile, T, hs, 1.0f);
    __syncthreads();
    float s[attn_rows], dp[attn_rows];
#pragma unroll
    for (int i = 0; i < attn_rows; ++i) s[i] = dp[i] = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float kd = sK[lane * (D + 1) + d], vd = sV[lane * (D + 1) + d];
#pragma unroll
      for (int i = 0; i < attn_rows; ++i) {
        s[i] += sQ[(warp * attn_rows + i) * D + d] * kd;
        dp[i] += sO[(warp * attn_rows + i) * D + d] * vd;
      }
    }
    const int tk = kt * attn_tile + lane;
    float ds[attn_rows];
#pragma unroll
    for (int i = 0; i < attn_rows; ++i) {
      const int tq = q0 + warp * attn_rows + i;
      const bool valid = tq < T && tk <= tq;
      const float p = valid ? expf(s[i] * scale - rl[i]) : 0.0f;
      ds[i] = p * (dp[i] - rd[i]);
    }
    for (int j = 0; j < attn_tile; ++j) {
      float dsj[attn_rows];
#pragma unroll
      for (int i = 0; i < attn_rows; ++i) dsj[i] = __shfl_sync(0xffffffffu, ds[i], j);
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float kv = sK[j * (D + 1) + w * 32 + lane];
#pragma unroll
        for (int i = 0; i < attn_rows; ++i) dq[i][w] += dsj[i] * kv;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < attn_rows; ++i) {
    const int tq = q0 + warp * attn_rows + i;
    if (tq >= T) continue;
    E* g = dqkv + (static_cast<std::size_t>(b) * T + tq) * rs + head;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const int d = w * 32 + lane;
      if (d < hs) g[d] = from_float<E>(dq[i][w] * scale);
    }
  }
}

// Whole causal sequences of a [B,T,C + 2Ckv] q|k|v buffer as the tensor-core kernels' problem.
inline flash::Operands whole_sequences(const __nv_bfloat16* qkv, int T, int C, int NH, int NKV) {
  const int hs = C / NH;
  const std::size_t ld = static_cast<std::size_t>(C) + 2 * static_cast<std::size_t>(NKV) * hs;
  return {qkv, qkv + C, qkv + C + static_cast<std::size_t>(NKV) * hs, ld, ld, T, NH, NKV, true,
          1.0f / sqrtf(static_cast<float>(hs))};
}

inline int attention_check(const char* kernel, int B, int T, int C, int NH, int NKV) {
  require_non_negative(kernel, "B", B);
  require_non_negative(kernel, "T", T);
  require_positive(kernel, "C", C);
  require_positive(kernel, "NH", NH);
  require_positive(kernel, "NKV", NKV);
  require(C % NH == 0, kernel,
          "the channel count C=" + std::to_string(C) + " is not divisible by the head count NH=" + std::to_string(NH));
  require(NH % NKV == 0, kernel,
          "the key/value heads NKV=" + std::to_string(NKV) + " do not divide the query heads NH=" + std::to_string(NH));
  const int hs = C / NH;
  require(hs <= 128, kernel, "head size " + std::to_string(hs) + " is larger than the supported 128");
  require(B <= 65535 && NH <= 65535, kernel, "B and NH must be at most 65535 (grid dimensions)");
  return hs;
}

// Launches kernel<E, D> with D the head size rounded up to 32, 64 or 128.
template <template <class, int> class Launch, class E, class... Args>
void attention_dispatch(int hs, Args&&... args) {
  if (hs <= 32)
    Launch<E, 32>::run(static_cast<Args&&>(args)...);
  else if (hs <= 64)
    Launch<E, 64>::run(static_cast<Args&&>(args)...);
  else
    Launch<E, 128>::run(static_cast<Args&&>(args)...);
}

template <class E, int D>
struct AttentionForward {
  static void run(cudaStream_t stream, E* out, float* lse, const E* qkv, int B, int T, int C, int NH, int NKV, int hs) {
    const std::size_t smem = sizeof(float) * (attn_tile * D * 2 + attn_tile * (D + 1));
    allow_dynamic_smem(attention_forward_kernel<E, D>, smem);
    const dim3 grid(static_cast<unsigned>((T + attn_tile - 1) / attn_tile), static_cast<unsigned>(NH),
                    static_cast<unsigned>(B));
    attention_forward_kernel<E, D><<<grid, attn_threads, smem, stream>>>(out, lse, qkv, T, C, NH, NKV, hs,
                                                                        1.0f / sqrtf(static_cast<float>(hs)));
    FIVED_CUDA_CHECK_LAUNCH("attention_forward_kernel");
  }
};

template <class E, int D>
struct AttentionBackward {
  static void run(cudaStream_t stream, E* dqkv, const E* dout, const E* qkv, const float* lse, const float* Dd, int B,
                  int T, int C, int NH, int NKV, int hs) {
    const float scale = 1.0f / sqrtf(static_cast<float>(hs));
    const unsigned tiles = static_cast<unsigned>((T + attn_tile - 1) / attn_tile);
    const std::size_t smem_kv = sizeof(float) * (attn_tile * D * 2 + attn_tile * (D + 1) * 2 + 2 * attn_tile);
    allow_dynamic_smem(attention_backward_kv_kernel<E, D>, smem_kv);
    attention_backward_kv_kernel<E, D>
        <<<dim3(tiles, static_cast<unsigned>(NKV), static_cast<unsigned>(B)), attn_threads, smem_kv, stream>>>(
            dqkv, dout, qkv, lse, Dd, T, C, NH, NKV, hs, scale);
    FIVED_CUDA_CHECK_LAUNCH("attention_backward_kv_kernel");
    const std::size_t smem_q = sizeof(float) * (attn_tile * D * 2 + attn_tile * (D + 1) * 2);
    allow_dynamic_smem(attention_backward_q_kernel<E, D>, smem_q);
    attention_backward_q_kernel<E, D>
        <<<dim3(tiles, static_cast<unsigned>(NH), static_cast<unsigned>(B)), attn_threads, smem_q, stream>>>(
            dqkv, dout, qkv, lse, Dd, T, C, NH, NKV, hs, scale);
    FIVED_CUDA_CHECK_LAUNCH("attention_backward_q_kernel");
  }
};

}  // namespace detail

template <class E>
void attention_forward(cudaStream_t stream, E* out, float* lse, const E* qkv, int B, int T, int C, int NH, int NKV) {
  static_assert(is_element_v<E>, "attention_forward: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_forward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  detail::require(lse != nullptr, "attention_forward", "lse [B,NH,T] is an output and must not be null");
  if constexpr (std::is_same_v<E, fived::bf16>) {
    const auto a = detail::whole_sequences(dev(qkv), T, C, NH, NKV);
    if (detail::flash::fits(hs, NH, NKV, {a.ldq, static_cast<std::size_t>(C)}, {out, qkv})) {
      detail::flash::with_head_size(hs, [&]<int D>() {
        detail::flash::forward<D>(stream, a, B, dev(out), static_cast<std::size_t>(C), lse, true);
      });
      return;
    }
  }
  detail::attention_dispatch<detail::AttentionForward, device_t<E>>(hs, stream, dev(out), lse, dev(qkv), B, T, C, NH,
                                                                    NKV, hs);
}

template <class E>
void attention_backward(cudaStream_t stream, E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse,
                        int B, int T, int C, int NH, int NKV) {
  static_assert(is_element_v<E>, "attention_backward: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_backward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  const std::size_t rows = static_cast<std::size_t>(B) * T * NH;
  Scratch<float> Dd(rows, stream);
  detail::attention_dot(stream, Dd.get(), dev(dout), dev(out), B, T, C, NH, hs);
  if constexpr (std::is_same_v<E, fived::bf16>) {
    const auto a = detail::whole_sequences(dev(qkv), T, C, NH, NKV);
    if (detail::flash::fits(hs, NH, NKV, {a.ldq, static_cast<std::size_t>(C)}, {dqkv, dout, qkv})) {
      auto* g = dev(dqkv);
      const detail::flash::Gradients<__nv_bfloat16> gr{dev(dout), static_cast<std::size_t>(C), lse, Dd.get(), g,
                                                       g + C, g + C + static_cast<std::size_t>(NKV) * hs, a.ldq, a.ldq};
      detail::flash::with_head_size(hs, [&]<int D>() { detail::flash::backward<D>(stream, a, B, gr); });
      return;
    }
  }
  detail::attention_dispatch<detail::AttentionBackward, device_t<E>>(hs, stream, dev(dqkv), dev(dout), dev(qkv), lse,
                                                                     static_cast<const float*>(Dd.get()), B, T, C, NH,
                                                                     NKV, hs);
}

// Whether attention_forward and attention_backward run on tensor cores for this shape on the
// current device (buffers from Buffer or cudaMalloc: 16-byte aligned).
template <class E>
bool attention_on_tensor_cores(int C, int NH, int NKV) {
  return std::is_same_v<E, fived::bf16> && NH > 0 && NKV > 0 && C % NH == 0 &&
         detail::flash::fits(C / NH, NH, NKV, {static_cast<std::size_t>(C) + 2ULL * NKV * (C / NH)}, {});
}

// ---- ring attention's blocks --------------------------------------------------------------

namespace detail {

inline constexpr int block_row_warps = 8;  // rows (warps) per thread block
inline constexpr int block_dims = 4;       // head size up to 4 x 32 = 128 per lane set

// Row r of B * NH * n: (b, h, t) with t fastest.
struct BlockRow {
  int b, h, t;
  __device__ BlockRow(long long r, int n, int NH)
      : b(static_cast<int>(r / (static_cast<long long>(n) * NH))), h(static_cast<int>((r / n) % NH)),
        t(static_cast<int>(r % n)) {}
};

template <class E>
__device__ __forceinline__ void load_row(float (&x)[block_dims], const E* p, int hs, int lane, float mul) {
#pragma unroll
  for (int i = 0; i < block_dims; ++i) {
    const int d = lane + 32 * i;
    x[i] = d < hs ? to_float(p[d]) * mul : 0.0f;
  }
}
__device__ __forceinline__ float row_dot(const float (&a)[block_dims], const float (&b)[block_dims]) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < block_dims; ++i) s += a[i] * b[i];
  return warp_sum(s);
}

template <class E>
__global__ void attention_block_forward_kernel(float* o, float* lse, const E* q, const E* k, const E* v, int ldq,
                                               int ldkv, int B, int n, int C, int NH, int NKV, int hs, float scale,
                                               bool causal, bool first) {
  const long long r = static_cast<long long>(blockIdx.x) * block_row_warps + threadIdx.x / 32;
  if (r >= static_cast<long long>(B) * NH * n) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const BlockRow at(r, n, NH);
  const std::size_t base = static_cast<std::size_t>(at.b) * n, kvh = static_cast<std::size_t>(at.h / (NH / NKV)) * hs;
  float qr[block_dims], kr[block_dims], vr[block_dims], acc[block_dims] = {};
  load_row(qr, q + (base + at.t) * ldq + static_cast<std::size_t>(at.h) * hs, hs, lane, scale);
  float m = -INFINITY, l = 0.0f;
  for (int j = 0, keys = causal ? at.t + 1 : n; j < keys; ++j) {
    load_row(kr, k + (base + j) * ldkv + kvh, hs, lane, 1.0f);
    load_row(vr, v + (base + j) * ldkv + kvh, hs, lane, 1.0f);
    const float s = row_dot(qr, kr), m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), p = expf(s - m_new);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < block_dims; ++i) acc[i] = acc[i] * corr + p * vr[i];
    m = m_new;
  }
  const float l_new = m + logf(l);
  const std::size_t srow = (static_cast<std::size_t>(at.b) * NH + at.h) * n + at.t;
  float* out = o + (base + at.t) * C + static_cast<std::size_t>(at.h) * hs;
  float keep = 0.0f, add = 1.0f / l, merged = l_new;
  if (!first) {
    const float lo = lse[srow], top = fmaxf(lo, l_new);
    merged = top + logf(expf(lo - top) + expf(l_new - top));
    keep = expf(lo - merged), add = expf(l_new - merged) / l;
  }
#pragma unroll
  for (int i = 0; i < block_dims; ++i) {
    const int d = lane + 32 * i;
    if (d < hs) out[d] = (first ? 0.0f : out[d] * keep) + acc[i] * add;
  }
  __syncwarp();  // every lane has read lse[srow]
  if (lane == 0) lse[srow] = merged;
}

// dq of one query row over the block's keys.
template <class E>
__global__ void attention_block_backward_q_kernel(float* dq, const E* dout, const float* Dd, const float* lse,
                                                  const E* q, const E* k, const E* v, int ldq, int ldkv, int B, int n,
                                                  int C, int NH, int NKV, int hs, float scale, bool causal) {
  const long long r = static_cast<long long>(blockIdx.x) * block_row_warps + threadIdx.x / 32;
  if (r >= static_cast<long long>(B) * NH * n) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const BlockRow at(r, n, NH);
  const std::size_t base = static_cast<std::size_t>(at.b) * n, head = static_cast<std::size_t>(at.h) * hs;
  const std::size_t kvh = static_cast<std::size_t>(at.h / (NH / NKV)) * hs;
  const std::size_t srow = (static_cast<std::size_t>(at.b) * NH + at.h) * n + at.t;
  float qr[block_dims], gr[block_dims], kr[block_dims], vr[block_dims], acc[block_dims] = {};
  load_row(qr, q + (base + at.t) * ldq + head, hs, lane, 1.0f);
  load_row(gr, dout + (base + at.t) * C + head, hs, lane, 1.0f);
  const float l = lse[srow], D = Dd[srow];
  for (int j = 0, keys = causal ? at.t + 1 : n; j < keys; ++j) {
    load_row(kr, k + (base + j) * ldkv + kvh, hs, lane, 1.0f);
    load_row(vr, v + (base + j) * ldkv + kvh, hs, lane, 1.0f);
    const float p = expf(row_dot(qr, kr) * scale - l), ds = p * (row_dot(gr, vr) - D) * scale;
#pragma unroll
    for (int i = 0; i < block_dims; ++i) acc[i] += ds * kr[i];
  }
  float* out = dq + (base + at.t) * C + head;
#pragma unroll
  for (int i = 0; i < block_dims; ++i)
    if (lane + 32 * i < hs) out[lane + 32 * i] += acc[i];
}

// dk and dv of one key row of key/value head j over the block's queries, of every query head
// that reads j.
template <class E>
__global__ void attention_block_backward_kv_kernel(float* dk, float* dv, int lddkv, const E* dout, const float* Dd,
                                                   const float* lse, const E* q, const E* k, const E* v, int ldq,
                                                   int ldkv, int B, int n, int C, int NH, int NKV, int hs, float scale,
                                                   bool causal) {
  const long long r = static_cast<long long>(blockIdx.x) * block_row_warps + threadIdx.x / 32;
  if (r >= static_cast<long long>(B) * NKV * n) return;
  const int lane = static_cast<int>(threadIdx.x) % 32, group = NH / NKV;
  const BlockRow at(r, n, NKV);  // at.h: the key/value head j, at.t: the key row
  const std::size_t base = static_cast<std::size_t>(at.b) * n, kvh = static_cast<std::size_t>(at.h) * hs;
  float kr[block_dims], vr[block_dims], qr[block_dims], gr[block_dims], ak[block_dims] = {}, av[block_dims] = {};
  load_row(kr, k + (base + at.t) * ldkv + kvh, hs, lane, 1.0f);
  load_row(vr, v + (base + at.t) * ldkv + kvh, hs, lane, 1.0f);
  for (int h = at.h * group; h < (at.h + 1) * group; ++h) {
    const std::size_t head = static_cast<std::size_t>(h) * hs;
    const std::size_t stats = (static_cast<std::size_t>(at.b) * NH + h) * n;
    for (int i = causal ? at.t : 0; i < n; ++i) {
      load_row(qr, q + (base + i) * ldq + head, hs, lane, 1.0f);
      load_row(gr, dout + (base + i) * C + head, hs, lane, 1.0f);
      const float p = expf(row_dot(qr, kr) * scale - lse[stats + i]);
      const float ds = p * (row_dot(gr, vr) - Dd[stats + i]) * scale;
#pragma unroll
      for (int d = 0; d < block_dims; ++d) ak[d] += ds * qr[d], av[d] += p * gr[d];
    }
  }
  float* outk = dk + (base + at.t) * lddkv + kvh;
  float* outv = dv + (base + at.t) * lddkv + kvh;
#pragma unroll
  for (int d = 0; d < block_dims; ++d)
    if (lane + 32 * d < hs) outk[lane + 32 * d] += ak[d], outv[lane + 32 * d] += av[d];
}

inline unsigned block_row_grid(int B, int n, int NH, const char* kernel) {
  const long long rows = static_cast<long long>(B) * NH * n;
  const long long blocks = (rows + block_row_warps - 1) / block_row_warps;
  require(blocks <= 0x7fffffffLL, kernel, "too many rows for one grid");
  return static_cast<unsigned>(blocks);
}

}  // namespace detail

template <class E>
void attention_block_forward(cudaStream_t stream, float* o, float* lse, const E* q, const E* k, const E* v, int ldq,
                             int ldkv, int B, int n, int C, int NH, int NKV, bool causal, bool first) {
  static_assert(is_element_v<E>, "attention_block_forward: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_block_forward", B, n, C, NH, NKV);
  if (B == 0 || n == 0) return;
  if constexpr (std::is_same_v<E, fived::bf16>) {
    const detail::flash::Operands a{dev(q), dev(k), dev(v), static_cast<std::size_t>(ldq), static_cast<std::size_t>(ldkv),
                                    n, NH, NKV, causal, 1.0f / sqrtf(static_cast<float>(hs))};
    if (detail::flash::fits(hs, NH, NKV, {a.ldq, a.ldkv, static_cast<std::size_t>(C)}, {o, q, k, v})) {
      detail::flash::with_head_size(hs, [&]<int D>() {
        detail::flash::forward<D>(stream, a, B, o, static_cast<std::size_t>(C), lse, first);
      });
      return;
    }
  }
  detail::attention_block_forward_kernel<<<detail::block_row_grid(B, n, NH, "attention_block_forward"),
                                           32 * detail::block_row_warps, 0, stream>>>(
      o, lse, dev(q), dev(k), dev(v), ldq, ldkv, B, n, C, NH, NKV, hs, 1.0f / sqrtf(static_cast<float>(hs)), causal,
      first);
  FIVED_CUDA_CHECK_LAUNCH("attention_block_forward_kernel");
}

template <class E>
void attention_row_dot(cudaStream_t stream, float* Dd, const E* dout, const E* out, int B, int n, int C, int NH) {
  static_assert(is_element_v<E>, "attention_row_dot: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_row_dot", B, n, C, NH, 1);
  if (B == 0 || n == 0) return;
  detail::attention_dot(stream, Dd, dev(dout), dev(out), B, n, C, NH, hs);
}

template <class E>
void attention_block_backward(cudaStream_t stream, float* dq, float* dk, float* dv, int lddkv, const E* dout,
                              const float* Dd, const float* lse, const E* q, const E* k, const E* v, int ldq, int ldkv,
                              int B, int n, int C, int NH, int NKV, bool causal) {
  static_assert(is_element_v<E>, "attention_block_backward: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_block_backward", B, n, C, NH, NKV);
  if (B == 0 || n == 0) return;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  if constexpr (std::is_same_v<E, fived::bf16>) {
    const detail::flash::Operands a{dev(q), dev(k), dev(v), static_cast<std::size_t>(ldq), static_cast<std::size_t>(ldkv),
                                    n, NH, NKV, causal, scale};
    const std::size_t Cs = static_cast<std::size_t>(C), lds = static_cast<std::size_t>(lddkv);
    if (detail::flash::fits(hs, NH, NKV, {a.ldq, a.ldkv, Cs, lds}, {dq, dk, dv, dout, q, k, v})) {
      const detail::flash::Gradients<float> gr{dev(dout), Cs, lse, Dd, dq, dk, dv, Cs, lds};
      detail::flash::with_head_size(hs, [&]<int D>() { detail::flash::backward<D>(stream, a, B, gr); });
      return;
    }
  }
  detail::attention_block_backward_q_kernel<<<detail::block_row_grid(B, n, NH, "attention_block_backward"),
                                              32 * detail::block_row_warps, 0, stream>>>(
      dq, dev(dout), Dd, lse, dev(q), dev(k), dev(v), ldq, ldkv, B, n, C, NH, NKV, hs, scale, causal);
  FIVED_CUDA_CHECK_LAUNCH("attention_block_backward_q_kernel");
  detail::attention_block_backward_kv_kernel<<<detail::block_row_grid(B, n, NKV, "attention_block_backward"),
                                               32 * detail::block_row_warps, 0, stream>>>(
      dk, dv, lddkv, dev(dout), Dd, lse, dev(q), dev(k), dev(v), ldq, ldkv, B, n, C, NH, NKV, hs, scale, causal);
  FIVED_CUDA_CHECK_LAUNCH("attention_block_backward_kv_kernel");
}

}  // namespace fived::kernels::cuda
