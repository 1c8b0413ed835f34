#pragma once
// Causal multi-head self-attention with grouped key/value heads, flash-style, contract of
// fived/kernels/host/attention.hpp with a leading stream:
//   attention_forward(s, out, lse, qkv, B, T, C, NH, NKV, doc_first = nullptr)
//     qkv [B,T,C + 2Ckv] = [q | k | v], Ckv = NKV*hs; query head h uses columns
//     [h*hs, (h+1)*hs) of q and key/value head h / (NH/NKV) of k and v, hs = C/NH <= 128;
//     out [B,T,C]; lse [B,NH,T] = log sum_{j<=t} exp(q_t.k_j / sqrt(hs)) (natural log), the
//     sum from the token's document's first j with documents (doc_first [B,T]).
//   attention_backward(s, dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, doc_first = nullptr)
//     dqkv is overwritten
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
// Ring attention's blocks (context parallelism): kernels/cuda/attention_blocks.hpp.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>

#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/cuda/attention_fp32_backward.hpp>
#include <fived/kernels/cuda/attention_tiles.hpp>
#include <fived/kernels/cuda/flash_attention.hpp>

namespace fived::kernels::cuda {

namespace detail {

template <class E, int D>
__global__ void __launch_bounds__(attn_threads)
    attention_forward_kernel(E* out, float* lse, const E* qkv, int T, int C, int NH, int NKV, int hs, float scale,
                             const int* doc_first) {
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
  int from[attn_rows];  // documents: each row's first key
#pragma unroll
  for (int i = 0; i < attn_rows; ++i) {
    const int tq = q0 + warp * attn_rows + i;
    from[i] = doc_first != nullptr && tq < T ? doc_first[static_cast<std::size_t>(b) * T + tq] : 0;
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
      const bool valid = tk <= tq && tk < T && tk >= from[i];
      const float si = valid ? s[i] : -INFINITY;
      const float m_new = fmaxf(m[i], warp_max(si));  // -inf until a row's document begins
      p[i] = valid ? expf(si - m_new) : 0.0f;
      const float corr = m_new == -INFINITY ? 1.0f : expf(m[i] - m_new);
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


// Whole causal sequences of a [B,T,C + 2Ckv] q|k|v buffer as the tensor-core kernels' problem.
inline flash::Operands whole_sequences(const __nv_bfloat16* qkv, int T, int C, int NH, int NKV, const int* doc_first) {
  const int hs = C / NH;
  const std::size_t ld = static_cast<std::size_t>(C) + 2 * static_cast<std::size_t>(NKV) * hs;
  return {qkv, qkv + C, qkv + C + static_cast<std::size_t>(NKV) * hs, ld, ld, T, NH, NKV, true,
          1.0f / sqrtf(static_cast<float>(hs)), DocumentMask{doc_first, 0}};
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
  static void run(cudaStream_t stream, E* out, float* lse, const E* qkv, int B, int T, int C, int NH, int NKV, int hs,
                  const int* doc_first) {
    const std::size_t smem = sizeof(float) * (attn_tile * D * 2 + attn_tile * (D + 1));
    allow_dynamic_smem(attention_forward_kernel<E, D>, smem);
    const dim3 grid(static_cast<unsigned>((T + attn_tile - 1) / attn_tile), static_cast<unsigned>(NH),
                    static_cast<unsigned>(B));
    attention_forward_kernel<E, D><<<grid, attn_threads, smem, stream>>>(out, lse, qkv, T, C, NH, NKV, hs,
                                                                        1.0f / sqrtf(static_cast<float>(hs)), doc_first);
    FIVED_CUDA_CHECK_LAUNCH("attention_forward_kernel");
  }
};

template <class E, int D>
struct AttentionBackward {
  static void run(cudaStream_t stream, E* dqkv, const E* dout, const E* qkv, const float* lse, const float* Dd, int B,
                  int T, int C, int NH, int NKV, int hs, const int* doc_first) {
    const float scale = 1.0f / sqrtf(static_cast<float>(hs));
    const unsigned tiles = static_cast<unsigned>((T + attn_tile - 1) / attn_tile);
    const std::size_t smem_kv = sizeof(float) * (attn_tile * D * 2 + attn_tile * (D + 1) * 2 + 2 * attn_tile);
    allow_dynamic_smem(attention_backward_kv_kernel<E, D>, smem_kv);
    attention_backward_kv_kernel<E, D>
        <<<dim3(tiles, static_cast<unsigned>(NKV), static_cast<unsigned>(B)), attn_threads, smem_kv, stream>>>(
            dqkv, dout, qkv, lse, Dd, T, C, NH, NKV, hs, scale, doc_first);
    FIVED_CUDA_CHECK_LAUNCH("attention_backward_kv_kernel");
    const std::size_t smem_q = sizeof(float) * (attn_tile * D * 2 + attn_tile * (D + 1) * 2);
    allow_dynamic_smem(attention_backward_q_kernel<E, D>, smem_q);
    attention_backward_q_kernel<E, D>
        <<<dim3(tiles, static_cast<unsigned>(NH), static_cast<unsigned>(B)), attn_threads, smem_q, stream>>>(
            dqkv, dout, qkv, lse, Dd, T, C, NH, NKV, hs, scale, doc_first);
    FIVED_CUDA_CHECK_LAUNCH("attention_backward_q_kernel");
  }
};

}  // namespace detail

template <class E>
void attention_forward(cudaStream_t stream, E* out, float* lse, const E* qkv, int B, int T, int C, int NH, int NKV,
                       const int* doc_first = nullptr) {
  static_assert(is_element_v<E>, "attention_forward: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_forward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  detail::require(lse != nullptr, "attention_forward", "lse [B,NH,T] is an output and must not be null");
  if constexpr (std::is_same_v<E, fived::bf16>) {
    const auto a = detail::whole_sequences(dev(qkv), T, C, NH, NKV, doc_first);
    if (detail::flash::fits(hs, NH, NKV, {a.ldq, static_cast<std::size_t>(C)}, {out, qkv})) {
      detail::flash::with_head_size(hs, [&]<int D>() {
        detail::flash::forward<D>(stream, a, B, dev(out), static_cast<std::size_t>(C), lse, true);
      });
      return;
    }
  }
  detail::attention_dispatch<detail::AttentionForward, device_t<E>>(hs, stream, dev(out), lse, dev(qkv), B, T, C, NH,
                                                                    NKV, hs, doc_first);
}

template <class E>
void attention_backward(cudaStream_t stream, E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse,
                        int B, int T, int C, int NH, int NKV, const int* doc_first = nullptr) {
  static_assert(is_element_v<E>, "attention_backward: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_backward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  const std::size_t rows = static_cast<std::size_t>(B) * T * NH;
  Scratch<float> Dd(rows, stream);
  detail::attention_dot(stream, Dd.get(), dev(dout), dev(out), B, T, C, NH, hs);
  if constexpr (std::is_same_v<E, fived::bf16>) {
    const auto a = detail::whole_sequences(dev(qkv), T, C, NH, NKV, doc_first);
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
                                                                     NKV, hs, doc_first);
}

// Whether attention_forward and attention_backward run on tensor cores for this shape on the
// current device (buffers from Buffer or cudaMalloc: 16-byte aligned).
template <class E>
bool attention_on_tensor_cores(int C, int NH, int NKV) {
  return std::is_same_v<E, fived::bf16> && NH > 0 && NKV > 0 && C % NH == 0 &&
         detail::flash::fits(C / NH, NH, NKV, {static_cast<std::size_t>(C) + 2ULL * NKV * (C / NH)}, {});
}

}  // namespace fived::kernels::cuda
