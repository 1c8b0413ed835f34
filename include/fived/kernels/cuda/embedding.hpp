#pragma once
// Token + position embedding over a range of the vocabulary, contract of
// fived/kernels/host/embedding.hpp (wte holds rows [vocab_begin, vocab_begin + vocab_rows)):
//   embedding_forward(s, out, tokens, wte, vocab_begin, vocab_rows, wpe, B, T, C)
//       out[b,t] = (wte[tok - vocab_begin] if tok is in the range, else 0) + (wpe ? wpe[t] : 0)
//   embedding_backward(s, dwte, dwpe, dout, tokens, B, T, C, vocab_begin, vocab_rows)
//       both +=; dwte gets in-range ids only, dwpe every position; dwte or dwpe may be null
// tokens is device memory [B*T]. The ids cannot be checked here (they are on the
// device): the model checks them against the vocabulary on the host. An id outside the
// range (another rank's, or a negative one) contributes 0 to out and nothing to dwte.
// With only one of the two terms present the forward copies it exactly, as the host does.
//
// The backward is deterministic (no atomics on the gradients): the (row of wte, position)
// pairs are radix-sorted by row with CUB (stable, so positions stay in order; only the bits of
// vocab_rows, out-of-range ids sorted last). A row's positions (a run of the sorted pairs)
// are summed in float and the sum added to dwte once: by one warp, in order, for a run of up
// to 8; by a block for a longer one, in a fixed order of parts, whichever block takes it.
// dwpe[t] sums over b in order. Both directions move 16 bytes a thread where C and the
// pointers allow.

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

// vocab_begin >= 0 (checked by the launchers), so tok - vocab_begin cannot overflow
// once tok >= vocab_begin.
__device__ __forceinline__ bool embedding_in_range(int tok, int vocab_begin, int vocab_rows) {
  return tok >= vocab_begin && tok - vocab_begin < vocab_rows;
}

// Elements [i, i + W) of out (never across a row: C % W == 0 when W > 1).
template <class E>
struct EmbedRows {
  E* out;
  const int* tokens;
  const E* wte;
  int vocab_begin, vocab_rows;
  const E* wpe;
  int T, C;
  template <int W>
  __device__ void at(std::size_t i) const {
    const int bt = static_cast<int>(i / C), c = static_cast<int>(i % C);
    const int tok = tokens[bt];
    const E* e = embedding_in_range(tok, vocab_begin, vocab_rows)
                     ? wte + static_cast<std::size_t>(tok - vocab_begin) * C + c
                     : nullptr;
    const E* p = wpe != nullptr ? wpe + static_cast<std::size_t>(bt % T) * C + c : nullptr;
    float x[W] = {}, y[W] = {};
    if (e != nullptr) load_elems<W>(x, e);
    if (p != nullptr) load_elems<W>(y, p);
#pragma unroll
    for (int k = 0; k < W; ++k)  // one term alone is copied (float holds a bf16 exactly), not added to 0.0f (-0 -> +0)
      x[k] = e != nullptr && p != nullptr ? x[k] + y[k] : e != nullptr ? x[k] : p != nullptr ? y[k] : 0.0f;
    store_elems<W>(out + i, x);
  }
};

inline constexpr int embedding_warps = 8;  // the short runs' block: one sorted index a warp, 256 threads
// A run of equal rows up to this long is summed by the warp at its first sorted index. A longer
// one, a frequent token of real text (" the" or "," is 3-4% of the positions: hundreds in a
// batch), goes to a block of its own whose warps sum consecutive parts of it: one warp
// walking hundreds of positions, a dependent load after another, would outlast the rest of
// the kernel many times over.
inline constexpr int embedding_short_run = 8;
inline constexpr int embedding_long_warps = 16;  // a long run's block: 512 threads

// acc[k] += dout's rows at `count` positions, in order (lane t holds the t-th in `pos`), at
// this lane's K pieces of W columns from c0. The positions come by shuffle, not from memory,
// and every load is issued unconditionally (a piece past the row, or a row past the count,
// loads a valid piece that is not added), so Unroll rows' loads are in flight together:
// where a branch guarded each load, they went out one after another.
template <int Unroll, int W, int K, class E>
__device__ __forceinline__ void add_dout_rows(float (&acc)[K][W], const E* dout, int pos, int count, int c0, int C) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if constexpr (Unroll == 1) {  // a row at a time: its pieces' loads guarded, not redirected (fewer registers)
    for (int t = 0; t < count; ++t) {
      const E* r = dout + static_cast<std::size_t>(__shfl_sync(0xffffffffu, pos, t)) * C;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = c0 + (k * 32 + lane) * W;
        if (c >= C) continue;
        float d[W];
        load_elems<W>(d, r + c);
#pragma unroll
        for (int e = 0; e < W; ++e) acc[k][e] += d[e];
      }
    }
  } else {
    for (int t0 = 0; t0 < count; t0 += Unroll) {
      Piece<E, W> got[Unroll][K];
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const E* r = dout + static_cast<std::size_t>(__shfl_sync(0xffffffffu, pos, min(t0 + u, count - 1))) * C;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int c = c0 + (k * 32 + lane) * W;
          got[u][k] = load_piece<E, W>(r + (c < C ? c : 0));
        }
      }
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        if (t0 + u >= count) break;  // the same for the whole warp
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (c0 + (k * 32 + lane) * W >= C) continue;
          float d[W];
          to_floats(d, got[u][k]);
#pragma unroll
          for (int e = 0; e < W; ++e) acc[k][e] += d[e];
        }
      }
    }
  }
}

// One warp per sorted index; only the first index of each run of equal in-range rows works.
// Its lanes look at the 32 indices after it at once (sorted: the run's come first), so the
// warp knows the run's length and, with one more load, its positions. A run of up to
// embedding_short_run positions is summed here in order, in float, W elements a lane (16-byte
// accesses when W > 1), and added to its row of dwte; a longer one is listed in long_runs
// (after the count in long_runs[0]) for embedding_backward_long_runs_kernel. Out-of-range ids
// take part in the sort (they are another rank's rows) and are skipped.
template <int W, int K, class E>
__global__ void __launch_bounds__(32 * embedding_warps, 4)  // 4 blocks an SM: 64 registers at most
    embedding_backward_wte_kernel(E* dwte, const E* dout, const int* sorted_rows, const int* sorted_positions, int n,
                                  int C, int vocab_rows, int* long_runs) {
  const int i = static_cast<int>(blockIdx.x) * embedding_warps + static_cast<int>(threadIdx.x) / 32;
  if (i >= n) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  // Loaded together: the row, its neighbours, and the positions (used only if the run is short).
  const int next = i + 1 + lane;
  const int row = sorted_rows[i], prev = i > 0 ? sorted_rows[i - 1] : -1, after = next < n ? sorted_rows[next] : -1;
  const int pos = i + lane < n ? sorted_positions[i + lane] : 0;
  if (row == vocab_rows || prev == row) return;
  const int len = 1 + __popc(__ballot_sync(0xffffffffu, after == row));
  if (len > embedding_short_run) {
    if (lane == 0) long_runs[1 + atomicAdd(long_runs, 1)] = i;  // the list's order does not matter
    return;
  }
  E* w = dwte + static_cast<std::size_t>(row) * C;
  for (int c0 = 0; c0 < C; c0 += 32 * W * K) {  // K pieces a lane in flight at once
    float acc[K][W] = {};
    Piece<E, W> held[K];  // the table's pieces, kept unconverted until the end (fewer registers)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = c0 + (k * 32 + lane) * W;
      if (c < C) held[k] = load_piece<E, W>(w + c);
    }
    add_dout_rows<(W > 1 && K >= 3 ? 1 : 2), W, K>(acc, dout, pos, len, c0, C);  // 2 rows at once spill at K = 3
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = c0 + (k * 32 + lane) * W;
      if (c >= C) continue;
      float g[W];
      to_floats(g, held[k]);
#pragma unroll
      for (int e = 0; e < W; ++e) g[e] += acc[k][e];
      store_elems<W>(w + c, g);
    }
  }
}

// The long runs (long_runs[1 ..], long_runs[0] of them), a run at a time a block (runs
// blockIdx.x, + gridDim.x, ...), over 32 * W columns (blockIdx.y: one piece a lane). The
// block finds the run's end 512 indices at a time; warp w
// sums the w-th of embedding_long_warps consecutive parts of the run in order, in float, four
// rows in flight; the parts are added in order through shared memory (deterministic: the sum
// does not depend on the block that takes the run) and the total onto the row of dwte.
template <int W, class E>
__global__ void __launch_bounds__(32 * embedding_long_warps, 2)
    embedding_backward_long_runs_kernel(E* dwte, const E* dout, const int* sorted_rows, const int* sorted_positions,
                                        int n, int C, const int* long_runs) {
  constexpr int cols = 32 * W;
  __shared__ float parts[embedding_long_warps][cols];  // a warp's sums, by column (c0 + its index)
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int c0 = static_cast<int>(blockIdx.y) * cols;
  const int runs = long_runs[0];
  for (int r = static_cast<int>(blockIdx.x); r < runs; r += static_cast<int>(gridDim.x)) {
    const int first = long_runs[1 + r];
    const int row = sorted_rows[first];
    int len = 0;
    for (;;) {
      const int j = first + len + static_cast<int>(threadIdx.x);
      const int same = __syncthreads_count(j < n && sorted_rows[j] == row);
      len += same;
      if (same < static_cast<int>(blockDim.x)) break;
    }
    const int begin = first + static_cast<int>(static_cast<long long>(len) * warp / embedding_long_warps);
    const int end = first + static_cast<int>(static_cast<long long>(len) * (warp + 1) / embedding_long_warps);
    float acc[1][W] = {};
    for (int b = begin; b < end; b += 32) {
      const int count = min(32, end - b);
      add_dout_rows<4, W, 1>(acc, dout, lane < count ? sorted_positions[b + lane] : 0, count, c0, C);
    }
#pragma unroll
    for (int e = 0; e < W; ++e) parts[warp][lane * W + e] = acc[0][e];
    __syncthreads();
    E* w = dwte + static_cast<std::size_t>(row) * C + c0;
    for (int c = static_cast<int>(threadIdx.x); c < cols && c0 + c < C; c += static_cast<int>(blockDim.x)) {
      float s = parts[0][c];
#pragma unroll
      for (int p = 1; p < embedding_long_warps; ++p) s += parts[p][c];
      w[c] = from_float<E>(to_float(w[c]) + s);
    }
    __syncthreads();  // the parts are read before the next run writes them
  }
}

// dwpe[t, c .. c + W) += the sum over b in order; a thread's W elements (16 bytes when W > 1).
template <int W, class E>
__global__ void embedding_backward_wpe_kernel(E* dwpe, const E* dout, int B, int T, int C) {
  const std::size_t n = static_cast<std::size_t>(T) * C / W;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float acc[W] = {}, g[W];
    for (int b = 0; b < B; ++b) {
      load_elems<W>(g, dout + (static_cast<std::size_t>(b) * n + i) * W);
#pragma unroll
      for (int k = 0; k < W; ++k) acc[k] += g[k];
    }
    load_elems<W>(g, dwpe + i * W);
#pragma unroll
    for (int k = 0; k < W; ++k) g[k] += acc[k];
    store_elems<W>(dwpe + i * W, g);
  }
}

inline void check_embedding_sizes(const char* kernel, int B, int T, int C, int vocab_begin, int vocab_rows) {
  require_non_negative(kernel, "B", B);
  require_non_negative(kernel, "T", T);
  require_positive(kernel, "C", C);
  require_non_negative(kernel, "vocab_begin", vocab_begin);
  require_non_negative(kernel, "vocab_rows", vocab_rows);
  // Index arithmetic is in int, with a grid stride or a block's 512 threads past the last
  // index: 2^30 positions leave room for both.
  require(static_cast<long long>(B) * T <= (1LL << 30), kernel, "B*T must be at most 2^30");
}

}  // namespace detail

template <class E>
void embedding_forward(cudaStream_t stream, E* out, const int* tokens, const E* wte, int vocab_begin, int vocab_rows,
                       const E* wpe, int B, int T, int C) {
  static_assert(is_element_v<E>, "embedding_forward: element type must be float or fived::bf16");
  detail::check_embedding_sizes("embedding_forward", B, T, C, vocab_begin, vocab_rows);
  if (B == 0 || T == 0) return;
  const std::size_t n = static_cast<std::size_t>(B) * T * C;
  detail::launch_elementwise<E>(
      stream, "embedding_forward", n,
      detail::EmbedRows<device_t<E>>{dev(out), tokens, dev(wte), vocab_begin, vocab_rows, dev(wpe), T, C},
      C % vec16<E> == 0 && detail::aligned16({out, wte, wpe}));
}

template <class E>
void embedding_backward(cudaStream_t stream, E* dwte, E* dwpe, const E* dout, const int* tokens, int B, int T, int C,
                        int vocab_begin, int vocab_rows) {
  static_assert(is_element_v<E>, "embedding_backward: element type must be float or fived::bf16");
  detail::check_embedding_sizes("embedding_backward", B, T, C, vocab_begin, vocab_rows);
  if (B == 0 || T == 0) return;
  const int n = B * T;
  if (dwte != nullptr && vocab_rows > 0) {
    // long_runs: the count, then the first sorted index of each run longer than
    // embedding_short_run (so at most n / (embedding_short_run + 1) of them).
    const int max_long_runs = n / (detail::embedding_short_run + 1);
    Scratch<int> rows(static_cast<std::size_t>(n), stream), sorted_rows(static_cast<std::size_t>(n), stream),
        positions(static_cast<std::size_t>(n), stream), sorted_positions(static_cast<std::size_t>(n), stream),
        long_runs(static_cast<std::size_t>(1 + max_long_runs), stream);
    // The (row of wte, position) pairs, an id outside the range sorted last and skipped; the
    // list of long runs emptied (long_runs[0], its count) before the kernels that fill it.
    detail::row_sort_keys(stream, rows.get(), positions.get(), long_runs.get(), tokens, n, vocab_begin, vocab_rows);
    const int bits = detail::row_key_bits(vocab_rows);
    std::size_t temp_bytes = 0;
    FIVED_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, rows.get(), sorted_rows.get(), positions.get(),
                                                     sorted_positions.get(), n, 0, bits, stream));
    Scratch<unsigned char> temp(temp_bytes, stream);
    FIVED_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), temp_bytes, rows.get(), sorted_rows.get(),
                                                     positions.get(), sorted_positions.get(), n, 0, bits, stream));
    detail::with_width<E>(C, {dwte, dout}, [&](auto w) {
      constexpr int W = decltype(w)::value;
      const unsigned blocks = static_cast<unsigned>((n + detail::embedding_warps - 1) / detail::embedding_warps);
      auto launch = [&](auto k) {
        constexpr int K = decltype(k)::value;
        detail::embedding_backward_wte_kernel<W, K><<<blocks, 32 * detail::embedding_warps, 0, stream>>>(
            dev(dwte), dev(dout), sorted_rows.get(), sorted_positions.get(), n, C, vocab_rows, long_runs.get());
        FIVED_CUDA_CHECK_LAUNCH("embedding_backward_wte_kernel");
      };
      const int pieces = (C + 32 * W - 1) / (32 * W);  // a lane's pieces of a row: 3 for GPT-2 124M's bf16
      if constexpr (W > 1) {  // wider rows in chunks of 3 pieces a lane (4 spill at 4 blocks an SM)
        if (pieces <= 1) return launch(std::integral_constant<int, 1>{});
        if (pieces == 2) return launch(std::integral_constant<int, 2>{});
        return launch(std::integral_constant<int, 3>{});
      } else {
        launch(std::integral_constant<int, 4>{});  // one element a piece: chunks of 4
      }
    });
    if (max_long_runs > 0)
      detail::with_width<E>(C, {dwte, dout}, [&](auto w) {
        constexpr int W = decltype(w)::value;
        // A run at a time a block: for each piece of the row, as many blocks as there can be
        // runs, up to the two an SM holds (the rest wait for a block that has finished one).
        const dim3 grid(static_cast<unsigned>(std::min(max_long_runs, 2 * detail::sm_count())),
                        static_cast<unsigned>((C + 32 * W - 1) / (32 * W)));
        detail::embedding_backward_long_runs_kernel<W><<<grid, 32 * detail::embedding_long_warps, 0, stream>>>(
            dev(dwte), dev(dout), sorted_rows.get(), sorted_positions.get(), n, C, long_runs.get());
        FIVED_CUDA_CHECK_LAUNCH("embedding_backward_long_runs_kernel");
      });
  }
  if (dwpe != nullptr) {
    detail::with_width<E>(C, {dwpe, dout}, [&](auto w) {
      constexpr int W = decltype(w)::value;
      const std::size_t m = static_cast<std::size_t>(T) * C / W;
      detail::embedding_backward_wpe_kernel<W><<<detail::grid_for(m, 256), 256, 0, stream>>>(dev(dwpe), dev(dout), B, T, C);
    });
    FIVED_CUDA_CHECK_LAUNCH("embedding_backward_wpe_kernel");
  }
}

}  // namespace fived::kernels::cuda
