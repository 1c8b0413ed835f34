#pragma once
// LayerNorm and RMSNorm forward/backward (eps = 1e-5), contract of
// fived/kernels/host/layernorm.hpp with a leading stream:
//   layernorm_forward(s, out, mean, rstd, inp, weight, bias, N, C)     mean/rstd may be null (not stored)
//   residual_layernorm_forward(s, res, out, mean, rstd, a, b, weight, bias, N, C)
//       res = a + b (residual_forward's rounding), then layernorm_forward of res: one pass
//   layernorm_backward(s, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C)   all three +=
//       (dinp null: the weight gradients alone, and weight may be null; the same for rmsnorm)
//   rmsnorm_forward(s, out, rstd, inp, weight, N, C)
//   residual_rmsnorm_forward(s, res, out, rstd, a, b, weight, N, C)
//   rmsnorm_backward(s, dinp, dweight, dout, inp, weight, rstd, N, C)                  both +=
// One warp per row (two-pass mean / variance in float; 16-byte accesses where the rows
// allow), the row held in registers between the passes where it fits; the weight and bias
// gradients are deterministic column reductions (no atomics). dweight/dbias
// may be null (not computed).

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

inline constexpr float layernorm_eps = 1e-5f;

namespace detail {

inline constexpr int norm_rows_per_block = 8;  // one warp per row, 256 threads

// The row kernels walk a row W elements at a time: W = vec16<T> (16-byte accesses) where C
// and the pointers allow it, else 1. A lane holds its pieces of the row (pieces lane, lane +
// 32, ...) in registers when they fit in K (K > 0: the row is read from memory once, every
// load in flight at once); K = 0 reads the row again for each pass (any C). The pieces are
// held as loaded and converted at each pass: bf16 takes half the registers of float, so an
// SM holds more rows at once (these kernels wait on their loads, not on their arithmetic).
template <class E, int W, int K>
struct RowPieces {
  Piece<E, W> held[K > 0 ? K : 1];
  // f(c, k) for each of this lane's pieces: c its first column, k where it is held (held[k]; a
  // constant once the loop is unrolled, so held stays in registers).
  template <class F>
  __device__ __forceinline__ void each(int C, F&& f) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k)
        if ((k * 32 + lane) * W < C) f((k * 32 + lane) * W, k);
    } else {
      for (int c = lane * W; c < C; c += 32 * W) f(c, 0);
    }
  }
  // Piece k of the row (at column c of row x) as floats: read (K = 0, or `first`), else
  // converted from what the first read held.
  __device__ __forceinline__ void fetch(float (&p)[W], const E* x, int c, int k, bool first) {
    if constexpr (K == 0) {
      load_elems<W>(p, x + c);
    } else {
      if (first) held[k] = load_piece<E, W>(x + c);
      to_floats(p, held[k]);
    }
  }
};

// The rows a forward norm reads: inp's, or (Residual) inp + add, rounded to E as
// residual_forward rounds it and written to sum as it is first read. The passes after the
// first read the pieces held, or (K = 0) sum's row again: the lane's own writes.
template <class E, bool Residual>
struct NormInput {
  const E* inp;
  const E* add = nullptr;  // Residual only
  E* sum = nullptr;        // Residual only; may alias inp or add (each lane reads its pieces before writing them)
  template <int W, int K>
  __device__ __forceinline__ void first(RowPieces<E, W, K>& xs, float (&v)[W], std::size_t row, int c, int k) const {
    if constexpr (!Residual) {
      xs.fetch(v, inp + row, c, k, true);
    } else {
      float y[W];
      load_elems<W>(v, inp + row + c);
      load_elems<W>(y, add + row + c);
      Piece<E, W> piece;
#pragma unroll
      for (int i = 0; i < W; ++i) piece.e[i] = from_float<E>(v[i] + y[i]);
      *reinterpret_cast<Piece<E, W>*>(sum + row + c) = piece;
      if constexpr (K > 0) xs.held[k] = piece;
      to_floats(v, piece);
    }
  }
  // Where the passes after the first read the row when it is not held.
  __device__ __forceinline__ const E* again(std::size_t row) const { return (Residual ? sum : inp) + row; }
};

// The blocks an SM must hold at once (the registers' bound, __launch_bounds__), where the
// pieces are held (K > 0); chosen with ptxas -v for sm_90. Forward, bf16 with K <= 3: 8 blocks
// (32 registers, from 47; LayerNorm spills 4 bytes), so GPT-2's 8,192 rows are one wave on
// 132 SMs (64 warps each), not 1.55 waves; float rows spill there, so no bound. Backward, K <= 3: 3
// (80 registers, from 122 for bf16, no spill); K = 4 spills at 3, so 2.
template <class T>
constexpr int forward_blocks_per_sm(int K) { return sizeof(T) == 2 && K > 0 && K <= 3 ? 8 : 1; }
constexpr int backward_blocks_per_sm(int K) { return K > 0 && K <= 3 ? 3 : K > 0 ? 2 : 1; }

template <int W, int K, bool Residual, class T>
__global__ void __launch_bounds__(32 * norm_rows_per_block, forward_blocks_per_sm<T>(K))
    layernorm_forward_kernel(T* out, float* mean, float* rstd, NormInput<T, Residual> in, const T* weight,
                             const T* bias, int N, int C) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int row = static_cast<int>(blockIdx.x) * norm_rows_per_block + static_cast<int>(threadIdx.x) / 32;
  if (row >= N) return;
  const std::size_t off = static_cast<std::size_t>(row) * C;
  const T* x = in.again(off);
  T* y = out + off;
  RowPieces<T, W, K> xs;
  float s = 0.0f;
  xs.each(C, [&](int c, int p) {
    float v[W];
    in.first(xs, v, off, c, p);
#pragma unroll
    for (int k = 0; k < W; ++k) s += v[k];
  });
  const float m = warp_sum(s) / static_cast<float>(C);
  float var = 0.0f;
  xs.each(C, [&](int c, int p) {
    float v[W];
    xs.fetch(v, x, c, p, false);
#pragma unroll
    for (int k = 0; k < W; ++k) var += (v[k] - m) * (v[k] - m);
  });
  const float r = 1.0f / sqrtf(warp_sum(var) / static_cast<float>(C) + layernorm_eps);
  xs.each(C, [&](int c, int p) {
    float v[W], w[W], b[W];
    xs.fetch(v, x, c, p, false);
    load_elems<W>(w, weight + c);
    if (bias != nullptr) load_elems<W>(b, bias + c);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = (v[k] - m) * r * w[k] + (bias != nullptr ? b[k] : 0.0f);
    store_elems<W>(y + c, v);
  });
  if (lane == 0) {
    if (mean != nullptr) mean[row] = m;
    if (rstd != nullptr) rstd[row] = r;
  }
}

// The rows [first, first + rows_per_block) of block b: dinp += each row's gradient (dinp may
// be null) and, where the rows are held in registers (K > 0) and `partials` is given, the
// block's column sums of (dout * xhat, dout) in partials[b * C ...], in the same pass: each
// warp adds its rows in order into its own K * 32 * W float2 of shared memory (the dynamic
// shared memory, norm_rows_per_block times that), lane-minor so that a warp's accesses meet no
// bank conflict, then the warps' sums are added in order (deterministic, no atomics;
// column_finish_kernel adds the blocks'). dout and inp are read once for all three gradients.
// mean == nullptr: RMSNorm (no centring, no bias term).
template <int W, int K, class T>
__global__ void __launch_bounds__(32 * norm_rows_per_block, backward_blocks_per_sm(K))
    norm_backward_kernel(T* dinp, float2* partials, const T* dout, const T* inp, const T* weight, const float* mean,
                         const float* rstd, int N, int C, int rows_per_block) {
  extern __shared__ float2 warp_sums[];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int first = static_cast<int>(blockIdx.x) * rows_per_block;
  const int last = min(N, first + rows_per_block);
  const bool sums = K > 0 && partials != nullptr;
  constexpr int slots = (K > 0 ? K : 1) * W * 32;  // a warp's: (piece p, element k, lane) at (p * W + k) * 32 + lane
  const int lane = static_cast<int>(threadIdx.x) % 32;
  float2* mine = warp_sums + warp * slots + lane;  // mine[(p * W + k) * 32]: this lane's alone
  RowPieces<T, W, K> ds, xs, gs;
  if (sums)
#pragma unroll
    for (int i = 0; i < slots / 32; ++i) mine[i * 32] = make_float2(0.0f, 0.0f);
  for (int row = first + warp; row < last; row += norm_rows_per_block) {
    const std::size_t off = static_cast<std::size_t>(row) * C;
    const float m = mean != nullptr ? mean[row] : 0.0f;
    const float r = rstd[row];
    float sd = 0.0f, sdx = 0.0f;
    ds.each(C, [&](int c, int p) {
      float d[W], x[W], w[W];
      ds.fetch(d, dout + off, c, p, true);
      xs.fetch(x, inp + off, c, p, true);
      if (dinp == nullptr) return;  // the weight gradients alone: no sums, and weight may be null
      if constexpr (K > 0) gs.held[p] = load_piece<T, W>(dinp + off + c);  // in flight with the others
      load_elems<W>(w, weight + c);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float dn = d[k] * w[k];
        sd += dn;
        sdx += dn * (x[k] - m) * r;
      }
    });
    const float dn_mean = mean != nullptr && dinp != nullptr ? warp_sum(sd) / static_cast<float>(C) : 0.0f;
    const float dnx_mean = dinp != nullptr ? warp_sum(sdx) / static_cast<float>(C) : 0.0f;
    ds.each(C, [&](int c, int p) {
      float d[W], x[W], h[W], w[W];  // h: dinp's piece, held since the first pass or read now (K = 0)
      ds.fetch(d, dout + off, c, p, false);
      xs.fetch(x, inp + off, c, p, false);
      if (dinp != nullptr) gs.fetch(h, dinp + off, c, p, false), load_elems<W>(w, weight + c);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float xh = (x[k] - m) * r;
        if (sums) {
          float2& a = mine[(p * W + k) * 32];
          a = make_float2(a.x + d[k] * xh, a.y + d[k]);
        }
        if (dinp != nullptr) h[k] += r * (d[k] * w[k] - dn_mean - xh * dnx_mean);
      }
      if (dinp != nullptr) store_elems<W>(dinp + off + c, h);
    });
  }
  if (!sums) return;  // the same for every thread of the block
  __syncthreads();
  for (int c = static_cast<int>(threadIdx.x); c < C; c += static_cast<int>(blockDim.x)) {
    const int at = (c / (32 * W) * W + c % W) * 32 + c / W % 32;  // column c's slot
    float2 s = warp_sums[at];
    for (int w = 1; w < norm_rows_per_block; ++w) {
      const float2 v = warp_sums[w * slots + at];
      s.x += v.x, s.y += v.y;
    }
    partials[static_cast<std::size_t>(blockIdx.x) * C + c] = s;
  }
}

// (dout * xhat, dout) at (row, col).
template <class T>
struct NormParamGrads {
  const T* dout;
  const T* inp;
  const float* mean;  // null: RMSNorm
  const float* rstd;
  int C;
  __device__ float2 operator()(int r, int c) const {
    const std::size_t i = static_cast<std::size_t>(r) * C + c;
    const float d = to_float(dout[i]);
    const float xh = (to_float(inp[i]) - (mean != nullptr ? mean[r] : 0.0f)) * rstd[r];
    return make_float2(d * xh, d);
  }
  template <int W>
  __device__ void at(int r, int c, float2 (&v)[W]) const {
    const std::size_t i = static_cast<std::size_t>(r) * C + c;
    float d[W], x[W];
    load_elems<W>(d, dout + i);
    load_elems<W>(x, inp + i);
    const float m = mean != nullptr ? mean[r] : 0.0f, s = rstd[r];
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = make_float2(d[k] * ((x[k] - m) * s), d[k]);
  }
};
template <class T>
struct AddNormParamGrads {
  T* dweight;
  T* dbias;
  __device__ void operator()(int c, float2 s) const {
    if (dweight != nullptr) dweight[c] = from_float<T>(to_float(dweight[c]) + s.x);
    if (dbias != nullptr) dbias[c] = from_float<T>(to_float(dbias[c]) + s.y);
  }
};

template <int W, int K, bool Residual, class T>
__global__ void __launch_bounds__(32 * norm_rows_per_block, forward_blocks_per_sm<T>(K))
    rmsnorm_forward_kernel(T* out, float* rstd, NormInput<T, Residual> in, const T* weight, int N, int C) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int row = static_cast<int>(blockIdx.x) * norm_rows_per_block + static_cast<int>(threadIdx.x) / 32;
  if (row >= N) return;
  const std::size_t off = static_cast<std::size_t>(row) * C;
  const T* x = in.again(off);
  T* y = out + off;
  RowPieces<T, W, K> xs;
  float ss = 0.0f;
  xs.each(C, [&](int c, int p) {
    float v[W];
    in.first(xs, v, off, c, p);
#pragma unroll
    for (int k = 0; k < W; ++k) ss += v[k] * v[k];
  });
  const float r = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(C) + layernorm_eps);
  xs.each(C, [&](int c, int p) {
    float v[W], w[W];
    xs.fetch(v, x, c, p, false);
    load_elems<W>(w, weight + c);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = v[k] * r * w[k];
    store_elems<W>(y + c, v);
  });
  if (lane == 0 && rstd != nullptr) rstd[row] = r;
}

inline void check_norm_sizes(const char* kernel, int N, int C) {
  require_non_negative(kernel, "N", N);
  require_positive(kernel, "C", C);
}

// Launches kernel<W, K> with W from with_width (16-byte accesses where the rows allow them);
// K = the pieces a lane holds: 2, 3 or 4 (no registers held for pieces past the row), or 16
// when MaxPieces allows, where the row fits (bf16 rows up to 1024 or 4096 wide), else 0 (read
// again). The backward holds two rows, so 4 at most: 16 pieces of each would spill.
template <class E, int MaxPieces = 16, class Launch>
void launch_by_width(int C, std::initializer_list<const void*> rows, Launch&& launch) {
  with_width<E>(C, rows, [&](auto w) {
    const int pieces = (C + 32 * w - 1) / (32 * w);
    if (pieces <= 2) return launch(w, std::integral_constant<int, 2>{});
    if (pieces == 3) return launch(w, std::integral_constant<int, 3>{});  // GPT-2 124M's bf16 rows
    if (pieces <= 4) return launch(w, std::integral_constant<int, 4>{});
    if constexpr (MaxPieces >= 16)
      if (pieces <= 16) return launch(w, std::integral_constant<int, 16>{});
    launch(w, std::integral_constant<int, 0>{});
  });
}

inline unsigned norm_blocks(int N) {
  return static_cast<unsigned>((N + norm_rows_per_block - 1) / norm_rows_per_block);
}

// Both backwards. Where the rows fit in registers, one pass gives dinp and each block's sums
// for the weight (and bias) gradients, as many blocks as are resident at once (each warp then
// adds several rows before the blocks' sums are written, so the partials stay small); else the
// row kernel (one row a warp) and a column reduction that reads dout and inp again.
template <class T>
void norm_backward(cudaStream_t stream, T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                   const float* mean, const float* rstd, int N, int C) {
  const bool param_grads = dweight != nullptr || dbias != nullptr;
  const AddNormParamGrads<device_t<T>> add{dev(dweight), dev(dbias)};
  launch_by_width<T, 4>(C, {dinp, dout, inp, weight}, [&](auto w, auto k) {
    constexpr int W = decltype(w)::value, K = decltype(k)::value;
    const auto kernel = norm_backward_kernel<W, K, device_t<T>>;
    constexpr int threads = 32 * norm_rows_per_block;
    if (K > 0 && param_grads) {
      constexpr int smem = static_cast<int>(norm_rows_per_block * K * 32 * W * sizeof(float2));  // 64 KB at most
      allow_dynamic_smem(kernel, smem);  // every launch: the limit is per device
      static const int per_sm = resident_blocks(kernel, threads, smem);
      const int resident = per_sm * sm_count();
      const int rows = (N + resident * norm_rows_per_block - 1) / (resident * norm_rows_per_block) * norm_rows_per_block;
      const int blocks = (N + rows - 1) / rows;
      Scratch<float2> partials(static_cast<std::size_t>(blocks) * C, stream);
      kernel<<<blocks, threads, smem, stream>>>(dev(dinp), partials.get(), dev(dout), dev(inp), dev(weight), mean,
                                                rstd, N, C, rows);
      FIVED_CUDA_CHECK_LAUNCH("norm_backward_kernel");
      finish_columns(stream, partials.get(), add, C, blocks);
      return;
    }
    if (dinp != nullptr) {
      kernel<<<norm_blocks(N), threads, 0, stream>>>(dev(dinp), nullptr, dev(dout), dev(inp), dev(weight), mean, rstd,
                                                     N, C, norm_rows_per_block);
      FIVED_CUDA_CHECK_LAUNCH("norm_backward_kernel");
    }
    if (param_grads)
      column_reduce<vec16<T>>(stream, NormParamGrads<device_t<T>>{dev(dout), dev(inp), mean, rstd, C}, add, N, C,
                              C % vec16<T> == 0 && aligned16({dout, inp}));
  });
}

// The norms' forward launches, with or without the residual add before them (NormInput).
template <bool Residual, class T>
void layernorm_forward_launch(cudaStream_t stream, T* out, float* mean, float* rstd, NormInput<device_t<T>, Residual> in,
                              const T* weight, const T* bias, int N, int C) {
  launch_by_width<T>(C, {out, in.inp, in.add, in.sum, weight, bias}, [&](auto w, auto k) {
    layernorm_forward_kernel<decltype(w)::value, decltype(k)::value, Residual>
        <<<norm_blocks(N), 32 * norm_rows_per_block, 0, stream>>>(dev(out), mean, rstd, in, dev(weight), dev(bias), N,
                                                                  C);
  });
  FIVED_CUDA_CHECK_LAUNCH("layernorm_forward_kernel");
}
template <bool Residual, class T>
void rmsnorm_forward_launch(cudaStream_t stream, T* out, float* rstd, NormInput<device_t<T>, Residual> in,
                            const T* weight, int N, int C) {
  launch_by_width<T>(C, {out, in.inp, in.add, in.sum, weight}, [&](auto w, auto k) {
    rmsnorm_forward_kernel<decltype(w)::value, decltype(k)::value, Residual>
        <<<norm_blocks(N), 32 * norm_rows_per_block, 0, stream>>>(dev(out), rstd, in, dev(weight), N, C);
  });
  FIVED_CUDA_CHECK_LAUNCH("rmsnorm_forward_kernel");
}

}  // namespace detail

template <class T>
void layernorm_forward(cudaStream_t stream, T* out, float* mean, float* rstd, const T* inp, const T* weight,
                       const std::type_identity_t<T>* bias, int N, int C) {
  static_assert(is_element_v<T>, "layernorm_forward: element type must be float or fived::bf16");
  detail::check_norm_sizes("layernorm_forward", N, C);
  if (N == 0) return;
  detail::layernorm_forward_launch<false>(stream, out, mean, rstd, detail::NormInput<device_t<T>, false>{dev(inp)},
                                          weight, bias, N, C);
}

// The residual add before a LayerNorm, fused into it: res = a + b, then out = LayerNorm(res).
template <class T>
void residual_layernorm_forward(cudaStream_t stream, T* res, T* out, float* mean, float* rstd, const T* a,
                                const std::type_identity_t<T>* b, const T* weight, const T* bias, int N, int C) {
  static_assert(is_element_v<T>, "residual_layernorm_forward: element type must be float or fived::bf16");
  detail::check_norm_sizes("residual_layernorm_forward", N, C);
  if (N == 0) return;
  detail::layernorm_forward_launch<true>(stream, out, mean, rstd,
                                         detail::NormInput<device_t<T>, true>{dev(a), dev(b), dev(res)}, weight, bias,
                                         N, C);
}

template <class T>
void layernorm_backward(cudaStream_t stream, T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                        const T* weight, const float* mean, const float* rstd, int N, int C) {
  static_assert(is_element_v<T>, "layernorm_backward: element type must be float or fived::bf16");
  detail::check_norm_sizes("layernorm_backward", N, C);
  if (N == 0) return;
  detail::require(mean != nullptr && rstd != nullptr, "layernorm_backward", "mean and rstd from the forward are needed");
  detail::norm_backward(stream, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}

template <class T>
void rmsnorm_forward(cudaStream_t stream, T* out, float* rstd, const T* inp, const T* weight, int N, int C) {
  static_assert(is_element_v<T>, "rmsnorm_forward: element type must be float or fived::bf16");
  detail::check_norm_sizes("rmsnorm_forward", N, C);
  if (N == 0) return;
  detail::rmsnorm_forward_launch<false>(stream, out, rstd, detail::NormInput<device_t<T>, false>{dev(inp)}, weight, N, C);
}

// The residual add before an RMSNorm, fused into it: res = a + b, then out = RMSNorm(res).
template <class T>
void residual_rmsnorm_forward(cudaStream_t stream, T* res, T* out, float* rstd, const T* a,
                              const std::type_identity_t<T>* b, const T* weight, int N, int C) {
  static_assert(is_element_v<T>, "residual_rmsnorm_forward: element type must be float or fived::bf16");
  detail::check_norm_sizes("residual_rmsnorm_forward", N, C);
  if (N == 0) return;
  detail::rmsnorm_forward_launch<true>(stream, out, rstd, detail::NormInput<device_t<T>, true>{dev(a), dev(b), dev(res)},
                                       weight, N, C);
}

template <class T>
void rmsnorm_backward(cudaStream_t stream, T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                      const float* rstd, int N, int C) {
  static_assert(is_element_v<T>, "rmsnorm_backward: element type must be float or fived::bf16");
  detail::check_norm_sizes("rmsnorm_backward", N, C);
  if (N == 0) return;
  detail::require(rstd != nullptr, "rmsnorm_backward", "rstd from the forward is needed");
  detail::norm_backward(stream, dinp, dweight, static_cast<T*>(nullptr), dout, inp, weight,
                        static_cast<const float*>(nullptr), rstd, N, C);
}

}  // namespace fived::kernels::cuda
