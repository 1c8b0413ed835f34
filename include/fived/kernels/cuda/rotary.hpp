#pragma once
// Rotary positions with grouped query heads, contract of fived/kernels/host/rotary.hpp:
//   rotary_forward(s, qkv, raw, inv_freq, N, H, KV, hd, pos)    qkv [N, 3 H hd] from raw [N, (H + 2 KV) hd]
//   rotary_backward(s, draw, dqkv, inv_freq, N, H, KV, hd, pos)  draw ("=") from dqkv
// One thread per (row, query head, i < hd/2): it writes columns i and i + hd/2 of the head's
// q, k and v (forward), or of its q gradient and, for h < KV, of key/value head h's gradient
// summed over the H / KV query heads that read it (backward). Angles in float (sincosf),
// as Hugging Face computes them.

#include <cstddef>

#include <fived/kernels/cuda/common.hpp>
#include <fived/context/row_positions.hpp>

namespace fived::kernels::cuda {

namespace detail {

__device__ __forceinline__ int row_position(std::size_t r, int rows_per_chunk, int chunk_length, int first0, int first1) {
  return (r < static_cast<std::size_t>(rows_per_chunk) ? first0 : first1) +
         static_cast<int>(r % static_cast<std::size_t>(chunk_length));
}

template <class T>
__global__ void rotary_forward_kernel(T* qkv, const T* raw, const float* inv_freq, std::size_t n, int H, int KV, int hd,
                                      int rows_per_chunk, int chunk_length, int first0, int first1) {
  const int half = hd / 2, G = H / KV;
  const std::size_t C = static_cast<std::size_t>(H) * hd, K = static_cast<std::size_t>(KV) * hd;
  for (std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(t % half);
    const int h = static_cast<int>((t / half) % H);
    const std::size_t r = t / (static_cast<std::size_t>(half) * H);
    const int j = h / G;
    float s, c;
    sincosf(static_cast<float>(row_position(r, rows_per_chunk, chunk_length, first0, first1)) * inv_freq[i], &s, &c);
    const T* in = raw + r * (C + 2 * K);
    T* out = qkv + r * 3 * C;
    const std::size_t q = static_cast<std::size_t>(h) * hd + i, k = C + static_cast<std::size_t>(j) * hd + i;
    float x1 = to_float(in[q]), x2 = to_float(in[q + half]);
    out[q] = from_float<T>(x1 * c - x2 * s);
    out[q + half] = from_float<T>(x2 * c + x1 * s);
    x1 = to_float(in[k]), x2 = to_float(in[k + half]);
    out[C + q] = from_float<T>(x1 * c - x2 * s);
    out[C + q + half] = from_float<T>(x2 * c + x1 * s);
    out[2 * C + q] = in[k + K];
    out[2 * C + q + half] = in[k + K + half];
  }
}

template <class T>
__global__ void rotary_backward_kernel(T* draw, const T* dqkv, const float* inv_freq, std::size_t n, int H, int KV,
                                       int hd, int rows_per_chunk, int chunk_length, int first0, int first1) {
  const int half = hd / 2, G = H / KV;
  const std::size_t C = static_cast<std::size_t>(H) * hd, K = static_cast<std::size_t>(KV) * hd;
  for (std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(t % half);
    const int h = static_cast<int>((t / half) % H);
    const std::size_t r = t / (static_cast<std::size_t>(half) * H);
    float s, c;
    sincosf(static_cast<float>(row_position(r, rows_per_chunk, chunk_length, first0, first1)) * inv_freq[i], &s, &c);
    const T* in = dqkv + r * 3 * C;
    T* out = draw + r * (C + 2 * K);
    const std::size_t q = static_cast<std::size_t>(h) * hd + i;
    float y1 = to_float(in[q]), y2 = to_float(in[q + half]);
    out[q] = from_float<T>(y1 * c + y2 * s);  // the rotation by -angle
    out[q + half] = from_float<T>(y2 * c - y1 * s);
    if (h < KV) {  // key/value head h: the sum over the query heads that read it
      float k1 = 0, k2 = 0, v1 = 0, v2 = 0;
      for (int g = 0; g < G; ++g) {
        const std::size_t e = static_cast<std::size_t>(h * G + g) * hd + i;
        k1 += to_float(in[C + e]), k2 += to_float(in[C + e + half]);
        v1 += to_float(in[2 * C + e]), v2 += to_float(in[2 * C + e + half]);
      }
      const std::size_t k = C + static_cast<std::size_t>(h) * hd + i;
      out[k] = from_float<T>(k1 * c + k2 * s);
      out[k + half] = from_float<T>(k2 * c - k1 * s);
      out[k + K] = from_float<T>(v1);
      out[k + K + half] = from_float<T>(v2);
    }
  }
}

// One thread per (row, query head, column pair): kernel(out, in, ...) for the forward or the backward.
template <class E, class Kernel>
void launch_rotary(cudaStream_t stream, Kernel kernel, const char* what, E* out, const E* in, const float* inv_freq,
                   int N, int H, int KV, int hd, RowPositions pos) {
  require(N >= 0 && H >= 1 && KV >= 1 && H % KV == 0 && hd >= 2 && hd % 2 == 0, what,
          "needs N >= 0, KV >= 1 dividing H and an even head size");
  require(pos.rows_per_chunk >= 1 && pos.chunk_length >= 1 && N <= 2 * pos.rows_per_chunk, what,
          "at most two chunks of rows");
  const std::size_t n = static_cast<std::size_t>(N) * H * (hd / 2);
  if (n == 0) return;
  kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, in, inv_freq, n, H, KV, hd, pos.rows_per_chunk, pos.chunk_length,
                                               pos.first[0], pos.first[1]);
  FIVED_CUDA_CHECK_LAUNCH(what);
}

}  // namespace detail

template <class T>
void rotary_forward(cudaStream_t stream, T* qkv, const T* raw, const float* inv_freq, int N, int H, int KV, int hd,
                    RowPositions pos) {
  static_assert(is_element_v<T>, "rotary_forward: element type must be float or fived::bf16");
  using E = device_t<T>;
  detail::launch_rotary(stream, detail::rotary_forward_kernel<E>, "rotary_forward", dev(qkv), dev(raw), inv_freq, N, H,
                        KV, hd, pos);
}

template <class T>
void rotary_backward(cudaStream_t stream, T* draw, const T* dqkv, const float* inv_freq, int N, int H, int KV, int hd,
                     RowPositions pos) {
  static_assert(is_element_v<T>, "rotary_backward: element type must be float or fived::bf16");
  using E = device_t<T>;
  detail::launch_rotary(stream, detail::rotary_backward_kernel<E>, "rotary_backward", dev(draw), dev(dqkv), inv_freq,
                        N, H, KV, hd, pos);
}

}  // namespace fived::kernels::cuda
