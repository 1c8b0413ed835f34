#pragma once
// Shared pieces of the CUDA kernels (namespace fived::kernels::cuda):
// element-type mapping (fived::bf16 <-> __nv_bfloat16, same bits), float
// load/store, warp and block reductions, launch helpers, argument checks and
// stream-ordered scratch memory. Device code: compile with nvcc.
//
// Conventions of every kernel header in this folder: raw device pointers,
// row-major contiguous arrays, the contract of the host kernels
// (fived/kernels/host/<name>.hpp) with a leading cudaStream_t; element types
// float and fived::bf16 with float accumulation. Every launch is checked; an
// impossible size throws std::invalid_argument before anything is launched.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <fived/device/bf16.hpp>
#include <fived/device/cuda.hpp>

namespace fived::kernels::cuda {

static_assert(sizeof(fived::bf16) == sizeof(__nv_bfloat16) && alignof(fived::bf16) == alignof(__nv_bfloat16),
              "fived::bf16 and __nv_bfloat16 share one layout");

// Element types the CUDA kernels accept.
template <class T>
inline constexpr bool is_element_v = std::is_same_v<T, float> || std::is_same_v<T, fived::bf16>;

// The device-side type of an element type: bf16 -> __nv_bfloat16.
template <class T> struct device_type { using type = T; };
template <> struct device_type<fived::bf16> { using type = __nv_bfloat16; };
template <> struct device_type<const fived::bf16> { using type = const __nv_bfloat16; };
template <class T> using device_t = typename device_type<T>::type;

template <class T> inline device_t<T>* dev(T* p) { return reinterpret_cast<device_t<T>*>(p); }
template <class T> inline const device_t<T>* dev(const T* p) { return reinterpret_cast<const device_t<T>*>(p); }

// float <-> element conversions (round to nearest even, as fived::bf16).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions; every thread of the block must call them (blockDim.x
// a multiple of 32, at most 1024) and every thread gets the result. `scratch`
// is __shared__ float[32]; the call synchronises before reusing it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int warps = static_cast<int>(blockDim.x) / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}
// The sum of every thread's double over a block of Threads threads (a power of two), as a
// fixed-order tree: the same bits run to run. `part` is __shared__ double[Threads]; every
// thread gets the result.
template <int Threads>
__device__ __forceinline__ double block_sum_in_order(double v, double* part) {
  __syncthreads();  // part[0] may still be read by a previous call
  part[threadIdx.x] = v;
  __syncthreads();
  for (int half = Threads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  return part[0];
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int warps = static_cast<int>(blockDim.x) / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

// Sixteen bytes of elements (8 bf16 or 4 float) moved as one access, converted to and
// from float: the widest load a thread issues. p must be 16-byte aligned.
template <class E>
inline constexpr int vec16 = static_cast<int>(16 / sizeof(E));

// W elements as they are in memory, read in one access (16 bytes when W == vec16<E>): what a
// kernel holds in registers between loading and converting (half the registers of the
// floats for bf16). p must be aligned to the piece's size.
template <class E, int W>
struct alignas(W * sizeof(E)) Piece {
  E e[W];
};
template <class E, int W>
__device__ __forceinline__ Piece<E, W> load_piece(const E* p) {
  return *reinterpret_cast<const Piece<E, W>*>(p);
}
// A piece's elements as floats.
template <class E, int W>
__device__ __forceinline__ void to_floats(float (&out)[W], const Piece<E, W>& piece) {
  if constexpr (std::is_same_v<E, __nv_bfloat16> && W % 2 == 0) {
    // A bf16 is the top half of its float: the low one of a pair shifted up, the high one
    // masked (two instructions a pair, where converting element by element took three).
    const auto* words = reinterpret_cast<const unsigned*>(piece.e);
#pragma unroll
    for (int k = 0; k < W / 2; ++k) {
      out[2 * k] = __uint_as_float(words[k] << 16);
      out[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = to_float(piece.e[k]);
  }
}

template <class E>
__device__ __forceinline__ void load_vec16(float (&out)[vec16<E>], const E* p) {
  to_floats(out, load_piece<E, vec16<E>>(p));
}
// Sixteen bytes of E from floats, as they go to memory.
template <class E>
__device__ __forceinline__ uint4 pack_vec16(const float (&in)[vec16<E>]) {
  uint4 raw;
  E* e = reinterpret_cast<E*>(&raw);
#pragma unroll
  for (int k = 0; k < vec16<E>; ++k) e[k] = from_float<E>(in[k]);
  return raw;
}
template <class E>
__device__ __forceinline__ void store_vec16(E* p, const float (&in)[vec16<E>]) {
  *reinterpret_cast<uint4*>(p) = pack_vec16<E>(in);
}

// W elements from p: one 16-byte access when W == vec16<E>, one element when W == 1.
template <int W, class E>
__device__ __forceinline__ void load_elems(float (&out)[W], const E* p) {
  to_floats(out, load_piece<E, W>(p));
}
template <int W, class E>
__device__ __forceinline__ void store_elems(E* p, const float (&in)[W]) {
  if constexpr (W == 1)
    *p = from_float<E>(in[0]);
  else
    store_vec16(p, in);
}

inline constexpr float log2e_f = 1.4426950408889634f;

// 2^x in one instruction (PTX ex2.approx.ftz.f32, MUFU.EX2), and a result below 2^-126 is 0.
// exp2f is that instruction too where its result is normal (so equally accurate there), with
// three more around it for subnormal results, which no kernel here needs: such a term is lost
// in any sum it joins, and a probability or gradient that small is as good as 0. ncu had the
// cross-entropy issue-bound with them.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / (1 + e^-x) from exp2_approx and a fast reciprocal (within 2 ulp): 0 where e^-x overflows.
__device__ __forceinline__ float sigmoid_f(float x) { return __fdividef(1.0f, 1.0f + exp2_approx(-log2e_f * x)); }

// GELU, tanh approximation (GPT-2), and its derivative, through 0.5 (1 + tanh u) = sigmoid(2u):
// one exponential and one reciprocal (tanhf is about twenty instructions), and no cancellation
// where tanh u nears -1. u = sqrt(2/pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_f(float x) {
  constexpr float k2 = 2.0f * 0.7978845608028654f;
  return x * sigmoid_f(k2 * x * fmaf(0.044715f * x, x, 1.0f));
}
// The derivative s + x s (1 - s) 2u' with s = 1 / (1 + e), e = e^-2u, and s (1 - s) as e s^2:
// 1 - s would cancel where s nears 1 (3x the tanh form's error); e is clamped at 2^126, where
// the gradient is 0 to float precision, so that e s^2 stays finite.
__device__ __forceinline__ float gelu_grad_f(float x) {
  constexpr float k2 = 2.0f * 0.7978845608028654f;
  const float x2 = x * x;
  const float e = exp2_approx(fminf(-log2e_f * k2 * x * fmaf(0.044715f, x2, 1.0f), 126.0f));
  const float s = __fdividef(1.0f, 1.0f + e);
  return fmaf(x * (e * s * s), k2 * fmaf(3.0f * 0.044715f, x2, 1.0f), s);
}

namespace detail {

// Elementwise work over n elements: f.template at<W>(i) handles elements [i, i + W). W is
// vec16<E> (16-byte accesses) when the launcher was told that is safe, else 1; the last
// n % W elements go one at a time. One piece per thread where the grid allows.
template <int W, class F>
__global__ void elementwise_kernel(F f, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t pieces = n / W;
  for (std::size_t p = first; p < pieces; p += stride) f.template at<W>(p * W);
  if constexpr (W > 1)
    for (std::size_t i = pieces * W + first; i < n; i += stride) f.template at<1>(i);
}

// The two shapes of an elementwise kernel for launch_elementwise, in float: out = op(a) and
// out = op(a, b), element by element (out may alias an input: each piece is read first).
template <class T, class Op>
struct MapUnary {
  T* out;
  const T* a;
  Op op;
  template <int W>
  __device__ void at(std::size_t i) const {
    float x[W];
    load_elems<W>(x, a + i);
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = op(x[k]);
    store_elems<W>(out + i, x);
  }
};
template <class T, class Op>
struct MapBinary {
  T* out;
  const T* a;
  const T* b;
  Op op;
  template <int W>
  __device__ void at(std::size_t i) const {
    float x[W], y[W];
    load_elems<W>(x, a + i);
    load_elems<W>(y, b + i);
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = op(x[k], y[k]);
    store_elems<W>(out + i, x);
  }
};

inline unsigned grid_for(std::size_t n, unsigned block, unsigned max_blocks = 65535u * 32u) {
  std::size_t g = (n + block - 1) / block;
  if (g == 0) g = 1;
  if (g > max_blocks) g = max_blocks;  // kernels use grid-stride loops
  return static_cast<unsigned>(g);
}

// The keys and values of a stable radix sort of ids by their row of a range (the embedding's
// rows of wte, a mixture's experts): key = id - begin for an id in [begin, begin + rows), else
// rows (sorted after every row's, which it cannot shift); value = the id's position. `reset`
// (may be null) is zeroed, for a count the kernels after the sort fill. begin >= 0, so id -
// begin cannot overflow once id >= begin.
template <class I>
__global__ void row_sort_keys_kernel(I* keys, I* positions, I* reset, const I* ids, I n, I begin, I rows) {
  if (reset != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *reset = 0;
  for (I i = static_cast<I>(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += static_cast<I>(gridDim.x * blockDim.x)) {
    const I id = ids[i];
    keys[i] = id >= begin && id - begin < rows ? id - begin : rows;
    positions[i] = i;
  }
}
// The bits a key in [0, rows] has: the sort looks at no others.
inline int row_key_bits(int rows) {
  int bits = 1;
  while (bits < 31 && (rows >> bits) != 0) ++bits;
  return bits;
}
template <class I>
void row_sort_keys(cudaStream_t stream, I* keys, I* positions, I* reset, const I* ids, I n, I begin, I rows) {
  row_sort_keys_kernel<<<grid_for(static_cast<std::size_t>(n), 256), 256, 0, stream>>>(keys, positions, reset, ids, n,
                                                                                       begin, rows);
  FIVED_CUDA_CHECK_LAUNCH("row_sort_keys_kernel");
}

inline int sm_count() {
  int dev = 0, n = 0;
  FIVED_CUDA_CHECK(cudaGetDevice(&dev));
  FIVED_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// Whether every pointer allows 16-byte accesses.
inline bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// f(std::integral_constant<int, W>) with W = vec16<E> (16-byte accesses) when rows of C
// elements starting at these pointers allow them, else W = 1.
template <class E, class F>
decltype(auto) with_width(int C, std::initializer_list<const void*> rows, F&& f) {
  if (C % vec16<E> == 0 && aligned16(rows)) return f(std::integral_constant<int, vec16<E>>{});
  return f(std::integral_constant<int, 1>{});
}

// Launches elementwise_kernel over n elements of E: 16 bytes a thread when `wide` (every
// pointer f touches is 16-byte aligned, and a piece never straddles what f treats as a row).
template <class E, class F>
void launch_elementwise(cudaStream_t stream, const char* name, std::size_t n, const F& f, bool wide) {
  if (n == 0) return;
  constexpr unsigned block = 256;
  if (wide)
    elementwise_kernel<vec16<E>><<<grid_for((n + vec16<E> - 1) / vec16<E>, block), block, 0, stream>>>(f, n);
  else
    elementwise_kernel<1><<<grid_for(n, block), block, 0, stream>>>(f, n);
  FIVED_CUDA_CHECK_LAUNCH(name);
}

// Whether the current device is sm_80 or later (bf16 tensor-core instructions, cuDNN's fused
// attention): asked of the driver once per device, since attention asks on every call.
inline bool device_is_sm80_or_later() {
  constexpr int cached = 64;
  static std::atomic<signed char> known[cached] = {};  // 0: not asked yet, 1: no, 2: yes
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device >= 0 && device < cached && known[device].load(std::memory_order_relaxed) != 0)
    return known[device].load(std::memory_order_relaxed) == 2;
  const bool yes = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 8;
  if (device >= 0 && device < cached) known[device].store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
}

// Lets `kernel` take `bytes` of dynamic shared memory (past the default 48 KB).
template <class Kernel>
void allow_dynamic_smem(Kernel kernel, std::size_t bytes) {
  FIVED_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

[[noreturn]] inline void bad_argument(const char* kernel, const std::string& what) {
  throw std::invalid_argument(std::string("fived::kernels::cuda::") + kernel + ": " + what);
}
inline void require(bool ok, const char* kernel, const std::string& what) {
  if (!ok) bad_argument(kernel, what);
}
inline void require_non_negative(const char* kernel, const char* name, long long v) {
  if (v < 0) bad_argument(kernel, std::string(name) + " must not be negative (got " + std::to_string(v) + ")");
}
inline void require_positive(const char* kernel, const char* name, long long v) {
  if (v <= 0) bad_argument(kernel, std::string(name) + " must be positive (got " + std::to_string(v) + ")");
}

}  // namespace detail

// Scratch (below) comes from the device's default memory pool, which by default hands its
// free memory back to the driver at every synchronisation: the next step would allocate
// from the driver again. Keeping it makes a steady-state step's scratch a suballocation of
// memory the pool already holds. Ops<T, Cuda> calls this once.
inline cudaMemPool_t scratch_pool() {  // the current device's default pool
  int device = 0;
  FIVED_CUDA_CHECK(cudaGetDevice(&device));
  cudaMemPool_t pool = nullptr;
  FIVED_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  return pool;
}
inline void keep_scratch_pool() {
  std::uint64_t keep = ~std::uint64_t{0};
  FIVED_CUDA_CHECK(cudaMemPoolSetAttribute(scratch_pool(), cudaMemPoolAttrReleaseThreshold, &keep));
}
// Bytes the default pool holds from the driver now (constant over steady-state steps).
inline std::uint64_t scratch_pool_reserved() {
  std::uint64_t bytes = 0;
  FIVED_CUDA_CHECK(cudaMemPoolGetAttribute(scratch_pool(), cudaMemPoolAttrReservedMemCurrent, &bytes));
  return bytes;
}

// Stream-ordered scratch memory (cudaMallocAsync / cudaFreeAsync on one
// stream): freed, in stream order, after the work queued before destruction.
template <class U>
class Scratch {
 public:
  Scratch(std::size_t n, cudaStream_t stream) : stream_(stream) {
    if (n != 0) FIVED_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&p_), n * sizeof(U), stream));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (p_ != nullptr) (void)cudaFreeAsync(p_, stream_);
  }
  U* get() const noexcept { return p_; }

 private:
  U* p_ = nullptr;
  cudaStream_t stream_;
};

// Column sums of a row-major [M, N] matrix of values produced by `f(row, col)`
// (a float2: two sums at once), deterministic: blocks of 32 x W columns x `splits` row
// ranges write partial sums, then a second kernel adds the partials in a fixed order and
// calls `out(col, float2)`. With W > 1 a thread reads W neighbouring columns of a row as one
// 16-byte access through `f.template at<W>(row, col, float2 (&)[W])`: a warp then reads
// 512 bytes of a row, not 64, and about eight blocks per SM keep HBM busy.
template <int W, class F>
__device__ __forceinline__ void column_values(const F& f, int r, int col, float2 (&v)[W]) {
  if constexpr (W == 1)
    v[0] = f(r, col);
  else
    f.template at<W>(r, col, v);
}

template <int W, class F>
__global__ void column_partials_kernel(float2* partials, F f, int M, int N, int rows_per_split) {
  __shared__ float2 tile[8][32 * W + 1];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int first_col = static_cast<int>(blockIdx.x) * 32 * W;
  const int col = first_col + tx * W;
  const int r0 = static_cast<int>(blockIdx.y) * rows_per_split;
  const int r1 = min(M, r0 + rows_per_split);
  float2 acc[W];
#pragma unroll
  for (int k = 0; k < W; ++k) acc[k] = make_float2(0.0f, 0.0f);
  if (col < N) {
    int r = r0 + ty;
    for (; r + 24 < r1; r += 32) {  // four rows' loads in flight
      float2 a[4][W];
#pragma unroll
      for (int u = 0; u < 4; ++u) column_values<W>(f, r + 8 * u, col, a[u]);
#pragma unroll
      for (int k = 0; k < W; ++k)
        acc[k].x += (a[0][k].x + a[1][k].x) + (a[2][k].x + a[3][k].x),
            acc[k].y += (a[0][k].y + a[1][k].y) + (a[2][k].y + a[3][k].y);
    }
    for (; r < r1; r += 8) {
      float2 a[W];
      column_values<W>(f, r, col, a);
#pragma unroll
      for (int k = 0; k < W; ++k) acc[k].x += a[k].x, acc[k].y += a[k].y;
    }
  }
#pragma unroll
  for (int k = 0; k < W; ++k) tile[ty][tx * W + k] = acc[k];
  __syncthreads();
  for (int j = ty * 32 + tx; j < 32 * W; j += 256) {  // the 8 row groups added in order
    if (first_col + j >= N) continue;
    float2 s = tile[0][j];
#pragma unroll
    for (int y = 1; y < 8; ++y) s.x += tile[y][j].x, s.y += tile[y][j].y;
    partials[static_cast<std::size_t>(blockIdx.y) * N + first_col + j] = s;
  }
}

// Blocks of 32 columns x 32 threads: thread y adds splits y, y + 32, ...; then the 32 in order.
template <class Out>
__global__ void column_finish_kernel(const float2* partials, Out out, int N, int splits) {
  __shared__ float2 tile[32][33];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int col = static_cast<int>(blockIdx.x) * 32 + tx;
  float2 s = make_float2(0.0f, 0.0f);
  if (col < N)
    for (int k = ty; k < splits; k += 32) {
      const float2 v = partials[static_cast<std::size_t>(k) * N + col];
      s.x += v.x, s.y += v.y;
    }
  tile[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && col < N) {
#pragma unroll
    for (int y = 1; y < 32; ++y) s.x += tile[y][tx].x, s.y += tile[y][tx].y;
    out(col, s);
  }
}

// out(col, the sum over s of partials[s * N + col]) for each of the N columns, in a fixed order.
template <class Out>
void finish_columns(cudaStream_t stream, const float2* partials, Out out, int N, int splits) {
  column_finish_kernel<<<(N + 31) / 32, dim3(32, 32), 0, stream>>>(partials, out, N, splits);
  FIVED_CUDA_CHECK_LAUNCH("column_finish_kernel");
}

// Blocks of `kernel` with `threads` threads (and `smem` bytes of dynamic shared memory) each
// that one SM holds at once.
template <class Kernel>
int resident_blocks(Kernel kernel, int threads, int smem = 0) {
  int n = 0;
  FIVED_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, static_cast<std::size_t>(smem)));
  return n > 0 ? n : 1;
}

// Wide > 1 with `wide` true: 16-byte reads (f has at<Wide>; the caller checked that N is a
// multiple of Wide and every row pointer f reads is 16-byte aligned). Otherwise one column a thread.
// M and N are positive: what an empty sum leaves in `out` (stored zeros, or nothing added) is the
// caller's to say.
template <int Wide = 1, class F, class Out>
void column_reduce(cudaStream_t stream, F f, Out out, int M, int N, bool wide = false) {
  detail::require(M > 0 && N > 0, "column_reduce",
                  "needs M > 0 and N > 0 (M=" + std::to_string(M) + ", N=" + std::to_string(N) + ")");
  auto launch = [&](auto width) {
    constexpr int W = decltype(width)::value;
    const int col_blocks = (N + 32 * W - 1) / (32 * W);
    // As many blocks as the SMs hold at once, not more: a second, partial wave left SMs idle
    // (1,056 blocks at 6 an SM on an H200 for GPT-2's bias gradient: 1.33 waves).
    static const int per_sm = resident_blocks(column_partials_kernel<W, F>, 256);
    int splits = per_sm * detail::sm_count() / col_blocks;
    const int max_splits = (M + 63) / 64;  // at least 64 rows per split
    if (splits > max_splits) splits = max_splits;
    if (splits < 1) splits = 1;
    const int rows = (M + splits - 1) / splits;
    splits = (M + rows - 1) / rows;
    Scratch<float2> partials(static_cast<std::size_t>(splits) * N, stream);
    column_partials_kernel<W><<<dim3(col_blocks, splits), dim3(32, 8), 0, stream>>>(partials.get(), f, M, N, rows);
    FIVED_CUDA_CHECK_LAUNCH("column_partials_kernel");
    finish_columns(stream, partials.get(), out, N, splits);
  };
  if constexpr (Wide > 1)
    if (wide) return launch(std::integral_constant<int, Wide>{});
  launch(std::integral_constant<int, 1>{});
}

}  // namespace fived::kernels::cuda
