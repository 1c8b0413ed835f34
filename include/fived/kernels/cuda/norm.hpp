#pragma once
// Global gradient norm and clipping, contract of fived/kernels/host/norm.hpp:
//   sum_of_squares(s, out_accumulate, g, n[, partials])   *out_accumulate += sum g^2 (float, device memory)
//   scale(s, g, n, factor)                     g *= factor
//   scale_acc(s, out, x, n, factor)            out = x * factor (float accumulators)
//   sum_of_squares_chunks(s, out, partials, base, chunks, count)   *out = the chunks' sum (double,
//       device memory, written): a block per chunk, then one block adds the partials in order
//   add_scalar(s, into, x)   *into += *x (doubles in device memory)
// The caller sums over tensors (calls accumulate in stream order) and mesh axes.
// sum_of_squares is deterministic: a fixed number of blocks (independent of
// the GPU) write partial sums, one block adds them in order and adds the total
// to *out_accumulate (no atomics, so the last bits do not vary run to run).

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/host/norm.hpp>  // SquaresChunk

namespace fived::kernels::cuda {

namespace detail {

inline constexpr unsigned sumsq_blocks = 512, sumsq_threads = 256;

// This thread's part of the sum of squares of g[0, n): elements first, first + step, ...,
// 16-byte pieces over the aligned part (four loads in flight), one element at a time over
// the rest. A grid-wide sum passes the grid as step; a block's, the block.
template <class T>
__device__ __forceinline__ float strided_squares(const T* g, std::size_t n, std::size_t first, std::size_t step) {
  constexpr int W = vec16<T>;
  const std::size_t nv = reinterpret_cast<std::uintptr_t>(g) % 16 == 0 ? n / W : 0;
  float s = 0.0f;
  std::size_t i = first;
  for (; i + 3 * step < nv; i += 4 * step) {
    float x[4][W];
#pragma unroll
    for (int u = 0; u < 4; ++u) load_vec16(x[u], g + (i + u * step) * W);
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int k = 0; k < W; ++k) s += x[u][k] * x[u][k];
  }
  for (; i < nv; i += step) {
    float x[W];
    load_vec16(x, g + i * W);
#pragma unroll
    for (int k = 0; k < W; ++k) s += x[k] * x[k];
  }
  for (std::size_t j = nv * W + first; j < n; j += step) {
    const float x = to_float(g[j]);
    s += x * x;
  }
  return s;
}

// Block b's part of the whole array (a thread's stride is the grid) into partials[b].
template <class T>
__global__ void sum_of_squares_partials_kernel(float* partials, const T* g, std::size_t n) {
  __shared__ float scratch[32];
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const float s = block_sum(strided_squares(g, n, first, stride), scratch);
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

// Block b: the sum of squares of chunk b, in float, into partials[b].
template <class T>
__global__ void sum_of_squares_chunks_kernel(double* partials, const T* __restrict__ base,
                                             const SquaresChunk* __restrict__ chunks) {
  __shared__ float scratch[32];
  const SquaresChunk c = chunks[blockIdx.x];
  const float s = block_sum(strided_squares(base + c.begin, c.end - c.begin, threadIdx.x, blockDim.x), scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = static_cast<double>(s);
}

// One block: *out = the partials' sum, each thread's in double, then a fixed-order tree.
template <int Threads>
__global__ void sum_chunk_partials_kernel(double* out, const double* partials, std::size_t count) {
  __shared__ double part[Threads];
  double s = 0;
  for (std::size_t i = threadIdx.x; i < count; i += Threads) s += partials[i];
  s = block_sum_in_order<Threads>(s, part);
  if (threadIdx.x == 0) *out = s;
}

template <int Dummy = 0>
__global__ void add_scalar_kernel(double* into, const double* x) {
  *into += *x;
}

struct ScaleBy {
  float factor;
  __device__ float operator()(float x) const { return x * factor; }
};

}  // namespace detail

// `partials`: sum_of_squares_partials floats of device memory the caller keeps (then the call
// allocates nothing); null: stream-ordered scratch for the call. (A trainer's norm is
// sum_of_squares_chunks, below: this is one array's, for benchmarks and checks.)
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
                                detail::MapUnary<device_t<T>, detail::ScaleBy>{dev(g), dev(g), {static_cast<float>(factor)}},
                                detail::aligned16({g}));
}

inline void scale_acc(cudaStream_t stream, float* out, const float* x, std::size_t n, double factor) {
  detail::launch_elementwise<float>(stream, "scale_acc", n,
                                    detail::MapUnary<float, detail::ScaleBy>{out, x, {static_cast<float>(factor)}},
                                    detail::aligned16({out, x}));
}

// `partials`: count doubles of device memory the caller keeps; `chunks` in device memory.
template <class T>
void sum_of_squares_chunks(cudaStream_t stream, double* out, double* partials, const T* base,
                           const SquaresChunk* chunks, std::size_t count) {
  static_assert(is_element_v<T>, "sum_of_squares_chunks: element type must be float or fived::bf16");
  detail::require(count <= 0x7fffffffu, "sum_of_squares_chunks", "more chunks than a grid has blocks");
  if (count == 0) {
    FIVED_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream));
    return;
  }
  detail::sum_of_squares_chunks_kernel<<<static_cast<unsigned>(count), 256, 0, stream>>>(partials, dev(base), chunks);
  FIVED_CUDA_CHECK_LAUNCH("sum_of_squares_chunks_kernel");
  detail::sum_chunk_partials_kernel<1024><<<1, 1024, 0, stream>>>(out, partials, count);
  FIVED_CUDA_CHECK_LAUNCH("sum_chunk_partials_kernel");
}

inline void add_scalar(cudaStream_t stream, double* into, const double* x) {
  detail::add_scalar_kernel<<<1, 1, 0, stream>>>(into, x);
  FIVED_CUDA_CHECK_LAUNCH("add_scalar_kernel");
}

}  // namespace fived::kernels::cuda
