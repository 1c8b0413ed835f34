#pragma once
// Global gradient norm and clipping, contract of fived/kernels/host/norm.hpp:
//   sum_of_squares(s, out_accumulate, g, n[, partials])   *out_accumulate += sum g^2 (float, device memory)
//   scale(s, g, n, factor)                     g *= factor
//   clip_factor(total_sum_of_squares, max_norm) = min(1, max_norm / (sqrt(total) + 1e-6))   (host)
//   clip_scale(s, g, n, total_sum_of_squares_on_device, max_norm)   the same without a host round trip
// The caller sums over tensors (calls accumulate in stream order) and mesh axes.
// sum_of_squares is deterministic: a fixed number of blocks (independent of
// the GPU) write partial sums, one block adds them in order and adds the total
// to *out_accumulate (no atomics, so the last bits do not vary run to run).

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

inline constexpr unsigned sumsq_blocks = 512, sumsq_threads = 256;

// 16-byte accesses over the aligned part (a thread's stride is the grid; four loads issued
// before they are added), one element at a time over the rest.
template <class T>
__global__ void sum_of_squares_partials_kernel(float* partials, const T* g, std::size_t n) {
  constexpr int W = vec16<T>;
  __shared__ float scratch[32];
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t nv = reinterpret_cast<std::uintptr_t>(g) % 16 == 0 ? n / W : 0;
  float s = 0.0f;
  std::size_t i = first;
  for (; i + 3 * stride < nv; i += 4 * stride) {  // four 16-byte loads in flight a thread
    float x[4][W];
#pragma unroll
    for (int u = 0; u < 4; ++u) load_vec16(x[u], g + (i + u * stride) * W);
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int k = 0; k < W; ++k) s += x[u][k] * x[u][k];
  }
  for (; i < nv; i += stride) {
    float x[W];
    load_vec16(x, g + i * W);
#pragma unroll
    for (int k = 0; k < W; ++k) s += x[k] * x[k];
  }
  for (std::size_t i = nv * W + first; i < n; i += stride) {
    const float x = to_float(g[i]);
    s += x * x;
  }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

template <int Dummy = 0>
__global__ void sum_partials_kernel(float* out_accumulate, const float* partials, unsigned count) {
  __shared__ float scratch[32];
  float s = 0.0f;
  for (unsigned i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) *out_accumulate += s;
}

// x * factor, or, with total_sumsq, x * the clip factor computed from it on the device.
struct ScaleBy {
  float factor;
  const float* total_sumsq;
  float max_norm;
  __device__ float operator()(float x) const {
    return x * (total_sumsq != nullptr ? fminf(1.0f, max_norm / (sqrtf(*total_sumsq) + 1e-6f)) : factor);
  }
};

}  // namespace detail

// `partials`: sum_of_squares_partials floats of device memory the caller keeps (Ops does, so a
// step allocates nothing); null: stream-ordered scratch for the call.
inline constexpr std::size_t sum_of_squares_partials = detail::sumsq_blocks;

template <class T>
void sum_of_squares(cudaStream_t stream, float* out_accumulate, const T* g, std::size_t n, float* partials = nullptr) {
  static_assert(is_element_v<T>, "sum_of_squares: element type must be float or fived::bf16");
  if (n == 0) return;
  Scratch<float> scratch(partials == nullptr ? detail::sumsq_blocks : 0, stream);
  float* p = partials != nullptr ? partials : scratch.get();
  detail::sum_of_squares_partials_kernel<<<detail::sumsq_blocks, detail::sumsq_threads, 0, stream>>>(p, dev(g), n);
  FIVED_CUDA_CHECK_LAUNCH("sum_of_squares_partials_kernel");
  detail::sum_partials_kernel<<<1, detail::sumsq_threads, 0, stream>>>(out_accumulate, p, detail::sumsq_blocks);
  FIVED_CUDA_CHECK_LAUNCH("sum_partials_kernel");
}

template <class T>
void scale(cudaStream_t stream, T* g, std::size_t n, double factor) {  // rounded once to float, the compute type
  static_assert(is_element_v<T>, "scale: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::launch_elementwise<T>(stream, "scale", n,
                                detail::MapUnary<device_t<T>, detail::ScaleBy>{dev(g), dev(g), {static_cast<float>(factor), nullptr, 0.0f}},
                                detail::aligned16({g}));
}

inline double clip_factor(double total_sum_of_squares, double max_norm) {
  const double f = max_norm / (std::sqrt(total_sum_of_squares) + 1e-6);
  return f < 1.0 ? f : 1.0;
}

// g *= clip_factor(*total_sum_of_squares, max_norm), the factor computed on the device.
template <class T>
void clip_scale(cudaStream_t stream, T* g, std::size_t n, const float* total_sum_of_squares, float max_norm) {
  static_assert(is_element_v<T>, "clip_scale: element type must be float or fived::bf16");
  if (n == 0) return;
  detail::launch_elementwise<T>(stream, "clip_scale", n,
                                detail::MapUnary<device_t<T>, detail::ScaleBy>{dev(g), dev(g), {1.0f, total_sum_of_squares, max_norm}},
                                detail::aligned16({g}));
}

}  // namespace fived::kernels::cuda
