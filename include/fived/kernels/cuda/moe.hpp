#pragma once
// Mixture of experts: the permutations around the experts, contract of
// fived/kernels/host/moe.hpp with a leading stream (the router: kernels/cuda/router.hpp):
//   dispatch_plan(s, scratch, token_of, pos, loads, host_counts, expert, N, k, E, capacity, padded)
//       CUB's stable radix sort of the assignments by expert (so by assignment within an
//       expert, the host's order), per-expert counts, then every sorted assignment writes its
//       own pos / token_of; loads (device memory) the kept counts. With host_counts, the kept
//       counts go to host memory too and it waits for the stream (and reports expert ids
//       outside [0, E)); without (padded rows: sizes that do not depend on the counts), it
//       waits for nothing, and an assignment with a bad id is dropped (pos -1).
//   gather_rows(s, out, x, index, rows, C)                     one thread per output element
//                                                              (zeros where index < 0)
//   moe_combine(s, out, y, pos, gate, N, k, C)                 one thread per (t, c), j in order
//   moe_combine_backward(s, dy, dgate, dout, y, pos, gate, N, k, C)   one block per assignment
//   moe_dispatch_backward(s, dx, dxp, pos, N, k, C)            one thread per (t, c): dx + rows, j in order
//
// Deterministic: every output element is written by one thread (or one block) that sums its
// terms in a fixed order (block reductions are fixed trees, never float atomics). The only
// atomics are the integer per-expert counts of dispatch_plan, whose result does not depend on
// their order. N = 0 (or rows = 0) launches nothing.

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <fived/device/buffer.hpp>
#include <fived/device/cuda.hpp>
#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/cuda/router.hpp>

namespace fived::kernels::cuda {

// Device memory dispatch_plan works in, kept between calls (one per caller, e.g. per
// Ops<T, Cuda>, whose calls share one stream): it grows when a larger N*k or E arrives and is
// reused as it is otherwise, so a steady-state step allocates nothing. Growing waits for the
// stream first (the padded plan does not wait, so the previous call's sort may still read the
// old buffers), and is refused while the stream is captured: a graph cannot allocate or wait.
struct DispatchScratch {
  Buffer<int, Cuda> keys;            // [N*k] expert ids, an id outside [0, E) as E (sorted last)
  Buffer<int, Cuda> keys_sorted;     // [N*k] those, sorted
  Buffer<int, Cuda> values;          // [N*k] 0, 1, ..., N*k-1: the assignments
  Buffer<int, Cuda> values_sorted;   // [N*k] the assignments in dispatch order
  Buffer<unsigned char, Cuda> temp;  // CUB's temporary storage
  Buffer<int, Cuda> meta;            // [4E+1]: counts, bad ids, kept counts, offsets of both

  void reserve(cudaStream_t stream, std::size_t n, int E) {
    if (keys_sorted.size() < n) {
      before_growing(stream, "N*k = " + std::to_string(n));
      keys = Buffer<int, Cuda>(n);
      keys_sorted = Buffer<int, Cuda>(n);
      values = Buffer<int, Cuda>(n);
      values_sorted = Buffer<int, Cuda>(n);
    }
    const std::size_t m = 4 * static_cast<std::size_t>(E) + 1;
    if (meta.size() < m) {
      before_growing(stream, "E = " + std::to_string(E));
      meta = Buffer<int, Cuda>(m);
    }
  }
  void reserve_temp(cudaStream_t stream, std::size_t bytes) {
    if (temp.size() < bytes) {
      before_growing(stream, std::to_string(bytes) + " bytes of sort storage");
      temp = Buffer<unsigned char, Cuda>(bytes);
    }
  }

 private:
  static void before_growing(cudaStream_t stream, const std::string& what) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    FIVED_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    if (status != cudaStreamCaptureStatusNone)
      throw std::logic_error("fived::kernels::cuda::dispatch_plan: its scratch must grow (" + what +
                             ") while the stream is captured into a CUDA graph; run one plain step of the largest "
                             "shape before capturing");
    FIVED_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
};

namespace detail {

// counts[e] += assignments to expert e, counts[E] += ids outside [0, E) (reported after the
// sync). A block histogram in shared memory when E is small, else straight to global memory.
// Integer atomics: the counts do not depend on their order. (I = int.)
template <class I>
__global__ void moe_histogram_kernel(I* counts, const I* expert, I n, I E, bool in_shared) {
  extern __shared__ int moe_hist[];
  I* h = in_shared ? reinterpret_cast<I*>(moe_hist) : counts;
  if (in_shared) {
    for (int e = static_cast<int>(threadIdx.x); e <= E; e += static_cast<int>(blockDim.x)) h[e] = 0;
    __syncthreads();
  }
  for (int a = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); a < n;
       a += static_cast<int>(gridDim.x * blockDim.x)) {
    const I e = expert[a];
    atomicAdd(&h[e >= 0 && e < E ? e : E], I(1));
  }
  if (in_shared) {
    __syncthreads();
    for (int e = static_cast<int>(threadIdx.x); e <= E; e += static_cast<int>(blockDim.x))
      if (h[e] != 0) atomicAdd(&counts[e], h[e]);
  }
}

// The capacity and the exclusive offsets, E values in order on one thread (E is small).
// meta = [counts (E) | bad (1) | kept (E) | offset (E) | kept_offset (E)]. (I = int.)
// padded: expert e's rows start at e * capacity whatever it took; loads[e] = kept[e].
template <class I>
__global__ void moe_offsets_kernel(I* meta, float* loads, I E, I capacity, bool padded) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const int* counts = meta;
  int* kept = meta + E + 1;
  int* offset = kept + E;
  int* kept_offset = offset + E;
  int o = 0, ko = 0;
  for (int e = 0; e < E; ++e) {
    const int c = counts[e];
    const int kc = capacity < 0 ? c : min(c, capacity);
    offset[e] = o;
    kept_offset[e] = padded ? e * capacity : ko;
    kept[e] = kc;
    loads[e] = static_cast<float>(kc);
    o += c;
    ko += kc;
  }
}

// Sorted assignment i: its rank within its expert decides whether the capacity keeps it and
// which row it gets. Ids outside [0, E) are skipped here (dispatch_plan throws after the
// sync); every write stays inside pos[0, n) and token_of[0, sum of kept) regardless. (I = int.)
template <class I>
__global__ void moe_positions_kernel(I* token_of, I* pos, const I* keys_sorted, const I* values_sorted, const I* meta,
                                     I n, I k, I E) {
  const int* kept = meta + E + 1;
  const int* offset = kept + E;
  const int* kept_offset = offset + E;
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * blockDim.x)) {
    const int e = keys_sorted[i];
    const int a = values_sorted[i];
    if (e < 0 || e >= E) {
      pos[a] = -1;  // reported after the sync, or dropped where nothing waits
      continue;
    }
    const int r = i - offset[e];
    if (r < 0 || r >= kept[e]) {
      pos[a] = -1;  // over capacity: dropped
      continue;
    }
    const int p = kept_offset[e] + r;
    pos[a] = p;
    token_of[p] = a / k;
  }
}

template <class T>
__global__ void gather_rows_kernel(T* out, const T* x, const int* index, int rows, int C) {
  const std::size_t n = static_cast<std::size_t>(rows) * C;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t p = i / C, c = i % C;
    if (index[p] < 0) {  // a padded expert's empty slot
      T zero;
      memset(&zero, 0, sizeof(T));
      out[i] = zero;
    } else {
      out[i] = x[static_cast<std::size_t>(index[p]) * C + c];
    }
  }
}

template <class T>
__global__ void moe_combine_kernel(T* out, const T* y, const int* pos, const float* gate, int N, int k, int C) {
  const std::size_t n = static_cast<std::size_t>(N) * C;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t t = i / C, c = i % C;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const std::size_t a = t * k + j;
      const int p = pos[a];
      if (p < 0) continue;
      acc += gate[a] * to_float(y[static_cast<std::size_t>(p) * C + c]);
    }
    out[i] = from_float<T>(acc);
  }
}

// One block per assignment a: dy's row pos[a] and the dot product dgate[a] (each thread sums
// its columns in order, then block_sum's fixed tree).
template <class T>
__global__ void moe_combine_backward_kernel(T* dy, float* dgate, const T* dout, const T* y, const int* pos,
                                            const float* gate, int k, int C) {
  __shared__ float scratch[32];
  const std::size_t a = blockIdx.x;
  const int p = pos[a];
  if (p < 0) {  // the whole block leaves together: no block_sum below
    if (threadIdx.x == 0) dgate[a] = 0.0f;
    return;
  }
  const std::size_t t = a / static_cast<std::size_t>(k);
  const T* d = dout + t * C;
  const T* yr = y + static_cast<std::size_t>(p) * C;
  T* dyr = dy + static_cast<std::size_t>(p) * C;
  const float g = gate[a];
  float acc = 0.0f;
  for (int c = static_cast<int>(threadIdx.x); c < C; c += static_cast<int>(blockDim.x)) {
    const float dc = to_float(d[c]);
    acc += dc * to_float(yr[c]);
    dyr[c] = from_float<T>(g * dc);
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) dgate[a] = acc;
}

template <class T>
__global__ void moe_dispatch_backward_kernel(T* dx, const T* dxp, const int* pos, int N, int k, int C) {
  const std::size_t n = static_cast<std::size_t>(N) * C;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t t = i / C, c = i % C;
    float s = to_float(dx[i]);
    for (int j = 0; j < k; ++j) {
      const int p = pos[t * k + j];
      if (p >= 0) s += to_float(dxp[static_cast<std::size_t>(p) * C + c]);
    }
    dx[i] = from_float<T>(s);
  }
}

inline void check_assignment_sizes(const char* kernel, int N, int k) {
  require_non_negative(kernel, "N", N);
  require_positive(kernel, "k", k);
  require(static_cast<long long>(N) * k <= 0x7fffffffLL, kernel, "N*k must fit in an int");
}
inline unsigned moe_block_for(int C) {  // one block per row / assignment: a multiple of 32, at most 256
  return C >= 256 ? 256u : 32u * static_cast<unsigned>((C + 31) / 32);
}

}  // namespace detail

// host_counts: E ints of host memory, the kept count of each expert. Waits for the stream
// (the counts are the all-to-all's sizes, host values). The offsets are computed on the
// device (one thread, E values), so the only transfer is the counts coming back.
inline void dispatch_plan(cudaStream_t stream, DispatchScratch& scratch, int* token_of, int* pos, float* loads,
                          int* host_counts, const int* expert, int N, int k, int E, int capacity, bool padded) {
  detail::check_assignment_sizes("dispatch_plan", N, k);
  detail::require_positive("dispatch_plan", "E", E);
  detail::require(E <= (0x7fffffff - 1) / 4, "dispatch_plan", "E is too large");
  detail::require(!padded || capacity >= 0, "dispatch_plan", "padded rows need a capacity (capacity_factor > 0)");
  const int n = N * k;
  if (padded && static_cast<long long>(E) * capacity > 0)  // every slot empty (-1) until an assignment takes it
    FIVED_CUDA_CHECK(cudaMemsetAsync(token_of, 0xff, static_cast<std::size_t>(E) * capacity * sizeof(int), stream));
  if (n == 0) {
    FIVED_CUDA_CHECK(cudaMemsetAsync(loads, 0, static_cast<std::size_t>(E) * sizeof(float), stream));
    if (host_counts != nullptr) std::fill_n(host_counts, E, 0);
    return;
  }
  scratch.reserve(stream, static_cast<std::size_t>(n), E);
  const int bits = detail::row_key_bits(E);  // keys 0 .. E (E: a bad id)
  std::size_t temp_bytes = 0;
  FIVED_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, scratch.keys.data(), scratch.keys_sorted.data(),
                                                   scratch.values.data(), scratch.values_sorted.data(), n, 0, bits,
                                                   stream));
  scratch.reserve_temp(stream, temp_bytes);
  int* meta = scratch.meta.data();

  FIVED_CUDA_CHECK(cudaMemsetAsync(meta, 0, (static_cast<std::size_t>(E) + 1) * sizeof(int), stream));
  const bool in_shared = E < 8192;
  const std::size_t smem = in_shared ? (static_cast<std::size_t>(E) + 1) * sizeof(int) : 0;
  detail::moe_histogram_kernel<<<detail::grid_for(static_cast<std::size_t>(n), 256, 1024), 256, smem, stream>>>(
      meta, expert, n, E, in_shared);
  FIVED_CUDA_CHECK_LAUNCH("moe_histogram_kernel");
  detail::moe_offsets_kernel<<<1, 1, 0, stream>>>(meta, loads, E, capacity, padded);
  FIVED_CUDA_CHECK_LAUNCH("moe_offsets_kernel");

  detail::row_sort_keys(stream, scratch.keys.data(), scratch.values.data(), static_cast<int*>(nullptr), expert, n, 0, E);
  // Stable: equal experts keep their assignment order, the host's dispatch order.
  FIVED_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch.temp.data(), temp_bytes, scratch.keys.data(), scratch.keys_sorted.data(),
                                                   scratch.values.data(), scratch.values_sorted.data(), n, 0, bits,
                                                   stream));
  detail::moe_positions_kernel<<<detail::grid_for(static_cast<std::size_t>(n), 256), 256, 0, stream>>>(
      token_of, pos, scratch.keys_sorted.data(), scratch.values_sorted.data(), meta, n, k, E);
  FIVED_CUDA_CHECK_LAUNCH("moe_positions_kernel");

  if (host_counts == nullptr) return;  // nothing waits
  int bad = 0;
  FIVED_CUDA_CHECK(cudaMemcpyAsync(host_counts, meta + E + 1, static_cast<std::size_t>(E) * sizeof(int),
                                   cudaMemcpyDeviceToHost, stream));
  FIVED_CUDA_CHECK(cudaMemcpyAsync(&bad, meta + E, sizeof(int), cudaMemcpyDeviceToHost, stream));
  FIVED_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bad != 0)
    detail::bad_argument("dispatch_plan", std::to_string(bad) + " expert ids are not in [0, E) (E=" +
                                              std::to_string(E) + "); pos and token_of are not valid");
}

template <class T>
void gather_rows(cudaStream_t stream, T* out, const T* x, const int* index, int rows, int C) {
  static_assert(std::is_trivially_copyable_v<T>, "gather_rows copies elements: T must be trivially copyable");
  detail::require_non_negative("gather_rows", "rows", rows);
  detail::require_positive("gather_rows", "C", C);
  if (rows == 0) return;
  const std::size_t n = static_cast<std::size_t>(rows) * C;
  detail::gather_rows_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(out), dev(x), index, rows, C);
  FIVED_CUDA_CHECK_LAUNCH("gather_rows_kernel");
}

template <class T>
void moe_combine(cudaStream_t stream, T* out, const T* y, const int* pos, const float* gate, int N, int k, int C) {
  static_assert(is_element_v<T>, "moe_combine: element type must be float or fived::bf16");
  detail::check_assignment_sizes("moe_combine", N, k);
  detail::require_positive("moe_combine", "C", C);
  if (N == 0) return;
  const std::size_t n = static_cast<std::size_t>(N) * C;
  detail::moe_combine_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(out), dev(y), pos, gate, N, k, C);
  FIVED_CUDA_CHECK_LAUNCH("moe_combine_kernel");
}

template <class T>
void moe_combine_backward(cudaStream_t stream, T* dy, float* dgate, const T* dout, const T* y, const int* pos,
                          const float* gate, int N, int k, int C) {
  static_assert(is_element_v<T>, "moe_combine_backward: element type must be float or fived::bf16");
  detail::check_assignment_sizes("moe_combine_backward", N, k);
  detail::require_positive("moe_combine_backward", "C", C);
  if (N == 0) return;
  detail::moe_combine_backward_kernel<<<static_cast<unsigned>(N * k), detail::moe_block_for(C), 0, stream>>>(
      dev(dy), dgate, dev(dout), dev(y), pos, gate, k, C);
  FIVED_CUDA_CHECK_LAUNCH("moe_combine_backward_kernel");
}

template <class T>
void moe_dispatch_backward(cudaStream_t stream, T* dx, const T* dxp, const int* pos, int N, int k, int C) {
  static_assert(is_element_v<T>, "moe_dispatch_backward: element type must be float or fived::bf16");
  detail::check_assignment_sizes("moe_dispatch_backward", N, k);
  detail::require_positive("moe_dispatch_backward", "C", C);
  if (N == 0) return;
  const std::size_t n = static_cast<std::size_t>(N) * C;
  detail::moe_dispatch_backward_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(dev(dx), dev(dxp), pos, N, k, C);
  FIVED_CUDA_CHECK_LAUNCH("moe_dispatch_backward_kernel");
}

}  // namespace fived::kernels::cuda
