#pragma once
// Rotary positions, in place on the q|k|v projection's output, contract of
// fived/kernels/host/rotary.hpp:
//   rotary_forward(s, qkv, inv_freq, N, H, KV, hd, pos)    qkv [N, (H + 2 KV) hd]: queries and keys rotated
//   rotary_backward(s, dqkv, inv_freq, N, H, KV, hd, pos)  their gradients rotated back
// One thread per (row, query or key head, i < hd/2): it rotates columns i and i + hd/2 of
// the head. Angles in float (sincosf), as Hugging Face computes them.

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>
#include <fived/context/row_positions.hpp>

namespace fived::kernels::cuda {

namespace detail {

__device__ __forceinline__ int row_position(std::size_t r, int rows_per_chunk, int chunk_length, int first0, int first1) {
  return (r < static_cast<std::size_t>(rows_per_chunk) ? first0 : first1) +
         static_cast<int>(r % static_cast<std::size_t>(chunk_length));
}

// sign +1: the rotation by the row's angles; -1: by their negatives (the transpose).
template <class T>
__global__ void rotary_kernel(T* qkv, const float* inv_freq, std::size_t n, int H, int KV, int hd, float sign,
                              int rows_per_chunk, int chunk_length, int first0, int first1) {
  const int half = hd / 2, rotated = H + KV;
  const std::size_t width = static_cast<std::size_t>(H + 2 * KV) * hd;
  for (std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(t % half);
    const int h = static_cast<int>((t / half) % rotated);
    const std::size_t r = t / (static_cast<std::size_t>(half) * rotated);
    float s, c;
    sincosf(static_cast<float>(row_position(r, rows_per_chunk, chunk_length, first0, first1)) * inv_freq[i], &s, &c);
    s *= sign;
    T* x = qkv + r * width + static_cast<std::size_t>(h) * hd + i;
    const float x1 = to_float(x[0]), x2 = to_float(x[half]);
    x[0] = from_float<T>(x1 * c - x2 * s);
    x[half] = from_float<T>(x2 * c + x1 * s);
  }
}

template <class T>
void launch_rotary(cudaStream_t stream, const char* what, T* qkv, const float* inv_freq, int N, int H, int KV, int hd,
                   RowPositions pos, float sign) {
  static_assert(is_element_v<T>, "rotary: element type must be float or fived::bf16");
  require(N >= 0 && H >= 1 && KV >= 1 && H % KV == 0 && hd >= 2 && hd % 2 == 0, what,
          "needs N >= 0, KV >= 1 dividing H and an even head size");
  require(pos.rows_per_chunk >= 1 && pos.chunk_length >= 1 && N <= 2 * pos.rows_per_chunk, what,
          "at most two chunks of rows");
  const std::size_t n = static_cast<std::size_t>(N) * (H + KV) * (hd / 2);
  if (n == 0) return;
  rotary_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dev(qkv), inv_freq, n, H, KV, hd, sign, pos.rows_per_chunk,
                                                      pos.chunk_length, pos.first[0], pos.first[1]);
  FIVED_CUDA_CHECK_LAUNCH(what);
}

}  // namespace detail

template <class T>
void rotary_forward(cudaStream_t stream, T* qkv, const float* inv_freq, int N, int H, int KV, int hd, RowPositions pos) {
  detail::launch_rotary(stream, "rotary_forward", qkv, inv_freq, N, H, KV, hd, pos, 1.0f);
}

template <class T>
void rotary_backward(cudaStream_t stream, T* dqkv, const float* inv_freq, int N, int H, int KV, int hd,
                     RowPositions pos) {
  detail::launch_rotary(stream, "rotary_backward", dqkv, inv_freq, N, H, KV, hd, pos, -1.0f);
}

}  // namespace fived::kernels::cuda
