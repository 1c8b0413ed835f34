#pragma once
// The fp32 attention backward (kernels/cuda/attention.hpp says when it runs): D = dout . out
// per row, then two deterministic passes without atomics, one block per key tile of a
// key/value head for dK and dV (over the query tiles at or after it, for every query head of
// its group) and one block per query tile for dQ (over the key tiles at or before it), each
// recomputing p = exp(s - lse) from the forward's log-sum-exp.

#include <cmath>
#include <cstddef>

#include <fived/kernels/cuda/attention_tiles.hpp>
#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda::detail {

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
                                 int NH, int NKV, int hs, float scale, const int* doc_first) {
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
      const int from = doc_first != nullptr && tq < T ? doc_first[static_cast<std::size_t>(b) * T + tq] : 0;
      float p[attn_rows], ds[attn_rows];
#pragma unroll
      for (int i = 0; i < attn_rows; ++i) {
        const int tk = kt * attn_tile + warp * attn_rows + i;
        const bool valid = tq < T && tk <= tq && tk >= from;
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
                                int NH, int NKV, int hs, float scale, const int* doc_first) {
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
  int from[attn_rows];  // documents: each row's first key
#pragma unroll
  for (int i = 0; i < attn_rows; ++i) {
    const int tq = q0 + warp * attn_rows + i;
    rl[i] = tq < T ? lse_bh[tq] : 0.0f;
    rd[i] = tq < T ? D_bh[tq] : 0.0f;
    from[i] = doc_first != nullptr && tq < T ? doc_first[static_cast<std::size_t>(b) * T + tq] : 0;
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
      const bool valid = tq < T && tk <= tq && tk >= from[i];
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

}  // namespace fived::kernels::cuda::detail
