#pragma once
// What the fp32 attention kernels (kernels/cuda/attention.hpp, attention_fp32_backward.hpp)
// share: where a head's rows lie in a q|k|v buffer, the tile shape, and loading a tile into
// shared memory.

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda::detail {

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

}  // namespace fived::kernels::cuda::detail
