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
// The backward is deterministic (no atomics): the (row of wte, position) pairs are
// radix-sorted by row with CUB (stable, so positions stay in order; only the bits of
// vocab_rows, out-of-range ids sorted last), and one warp per distinct row sums its
// positions' gradients in order, in float, then adds the sum to dwte once. dwpe[t] sums
// over b in order. Both directions move 16 bytes a thread where C and the pointers allow.

#include <cub/device/device_radix_sort.cuh>

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

// The sort's keys and values: key = the row of wte a token adds to, or vocab_rows for an id
// outside the range (sorted last, skipped), so the sort needs only the bits of vocab_rows;
// value = the token's position. (A template, as every kernel in these headers: one
// definition however many TUs include it.)
template <class I>
__global__ void embedding_keys_kernel(I* keys, I* positions, const I* tokens, I n, I vocab_begin, I vocab_rows) {
  for (I i = static_cast<I>(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += static_cast<I>(gridDim.x * blockDim.x)) {
    const I tok = tokens[i];
    keys[i] = embedding_in_range(tok, vocab_begin, vocab_rows) ? tok - vocab_begin : vocab_rows;
    positions[i] = i;
  }
}

inline constexpr int embedding_warps = 8;  // a block's warps: one sorted index each (wte), 256 threads

// One warp per sorted index; only the first index of each run of equal in-range tokens
// works: it sums its positions' gradients in order, W elements a lane (16-byte accesses when
// W > 1), and adds the sum to its row. Out-of-range ids still take part in the sort (they
// are another rank's rows). The work is a short chain of dependent loads (the sorted row
// and position, then the gradient and the table's row), so each step's loads are issued
// together: the row, its neighbour and the first position at once, then K pieces a lane of
// both dout and the table row (ncu had the kernel at 12% of DRAM when each piece waited for
// the last).
template <int W, int K, class E>
__global__ void __launch_bounds__(32 * embedding_warps, 4)  // 4 blocks an SM: 64 registers at most
    embedding_backward_wte_kernel(E* dwte, const E* dout, const int* sorted_rows, const int* sorted_positions, int n,
                                  int C, int vocab_rows) {
  const int i = static_cast<int>(blockIdx.x) * embedding_warps + static_cast<int>(threadIdx.x) / 32;
  if (i >= n) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int row = sorted_rows[i], prev = i > 0 ? sorted_rows[i - 1] : -1, first = sorted_positions[i];
  if (row == vocab_rows || prev == row) return;
  E* w = dwte + static_cast<std::size_t>(row) * C;
  for (int c0 = 0; c0 < C; c0 += 32 * W * K) {  // K pieces a lane in flight at once
    float acc[K][W];
    Piece<E, W> held[K];  // the table's pieces, kept unconverted until the end (fewer registers)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = c0 + (k * 32 + lane) * W;
      if (c >= C) continue;
      held[k] = load_piece<E, W>(w + c);
      load_elems<W>(acc[k], dout + static_cast<std::size_t>(first) * C + c);
    }
    for (int j = i + 1; j < n && sorted_rows[j] == row; ++j) {  // the run's further positions, in order
      const std::size_t at = static_cast<std::size_t>(sorted_positions[j]) * C;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = c0 + (k * 32 + lane) * W;
        if (c >= C) continue;
        float d[W];
        load_elems<W>(d, dout + at + c);
#pragma unroll
        for (int e = 0; e < W; ++e) acc[k][e] += d[e];
      }
    }
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
  require(static_cast<long long>(B) * T <= 0x7fffffffLL, kernel, "B*T must fit in an int");
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
    Scratch<int> rows(static_cast<std::size_t>(n), stream), sorted_rows(static_cast<std::size_t>(n), stream),
        positions(static_cast<std::size_t>(n), stream), sorted_positions(static_cast<std::size_t>(n), stream);
    detail::embedding_keys_kernel<<<detail::grid_for(static_cast<std::size_t>(n), 256), 256, 0, stream>>>(
        rows.get(), positions.get(), tokens, n, vocab_begin, vocab_rows);
    FIVED_CUDA_CHECK_LAUNCH("embedding_keys_kernel");
    int bits = 1;  // keys are 0 .. vocab_rows
    while (bits < 31 && (vocab_rows >> bits) != 0) ++bits;
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
        detail::embedding_backward_wte_kernel<W, decltype(k)::value>
            <<<blocks, 32 * detail::embedding_warps, 0, stream>>>(dev(dwte), dev(dout), sorted_rows.get(),
                                                                 sorted_positions.get(), n, C, vocab_rows);
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
    FIVED_CUDA_CHECK_LAUNCH("embedding_backward_wte_kernel");
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
