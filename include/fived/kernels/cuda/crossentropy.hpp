#pragma once
// Fused softmax cross-entropy over a (possibly sharded) vocabulary, contract of
// fived/kernels/host/crossentropy.hpp with a leading stream. logits are [N, Vs]:
// columns [offset, offset + Vs) of the padded vocabulary; global columns >= V
// are padding and never count; targets are global ids in [0, V) (device memory).
//   logits_max(s, max, logits, N, Vs, offset, V)                           max = local max (-inf if none valid)
//   crossentropy_partials(s, sumexp, target_logit, logits, targets, max, N, Vs, offset, V)
//   crossentropy_backward(s, losses, dlogits, logits, targets, max, sumexp, target_logit, N, Vs, offset, V, dloss)
//   crossentropy_forward_backward(s, losses, dlogits, logits, targets, N, Vp, V, dloss)
//   crossentropy_fused(s, losses, dlogits, max, sumexp, target_logit, logits, targets, N, Vp, V, dloss)
//     the single-shard loss in one kernel that also leaves the three statistics (any output
//     may be null): what a model without a vocabulary split runs.
//   add_loss_sum(s, sum, max, sumexp, target_logit, N)   *sum += host::loss_sum(...) (double, device memory)
// dlogits may alias logits (each element is read, then overwritten, by one
// thread). losses or dlogits may be null (that output is skipped). One block per row, float accumulation.
// The single-shard calls are one fused kernel (online max / sum-of-exp in one read, then
// the gradient), not three launches; where the row fits, it is staged in shared memory and
// read from HBM once. A target outside [0, V) cannot throw from
// the device: its loss is NaN (and its row gets no one-hot term).

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/cuda/flash_tiles.hpp>  // cp.async (flash::cp_async16, FIVED_FLASH_ARCH)

namespace fived::kernels::cuda {

namespace detail {

inline constexpr int ce_block = 512;

template <class T>
__global__ void logits_max_kernel(float* max, const T* logits, int Vs, int offset, int V) {
  __shared__ float scratch[32];
  const int row = static_cast<int>(blockIdx.x);
  const T* l = logits + static_cast<std::size_t>(row) * Vs;
  const int valid = min(Vs, V - offset);  // local columns whose global index is < V
  float m = -INFINITY;
  for (int j = static_cast<int>(threadIdx.x); j < valid; j += static_cast<int>(blockDim.x)) m = fmaxf(m, to_float(l[j]));
  m = block_max(m, scratch);
  if (threadIdx.x == 0) max[row] = m;
}

template <class T>
__global__ void crossentropy_partials_kernel(float* sumexp, float* target_logit, const T* logits, const int* targets,
                                             const float* max, int Vs, int offset, int V) {
  __shared__ float scratch[32];
  const int row = static_cast<int>(blockIdx.x);
  const T* l = logits + static_cast<std::size_t>(row) * Vs;
  const int valid = min(Vs, V - offset);
  const float m = max[row];
  float s = 0.0f;
  for (int j = static_cast<int>(threadIdx.x); j < valid; j += static_cast<int>(blockDim.x)) s += expf(to_float(l[j]) - m);
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) {
    sumexp[row] = s;
    const int local = targets[row] - offset;
    target_logit[row] = (targets[row] < V && local >= 0 && local < Vs) ? to_float(l[local]) : 0.0f;
  }
}

template <class T>
__global__ void crossentropy_backward_kernel(float* losses, T* dlogits, const T* logits, const int* targets,
                                             const float* max, const float* sumexp, const float* target_logit, int Vs,
                                             int offset, int V, float dloss) {
  const int row = static_cast<int>(blockIdx.x);
  const std::size_t base = static_cast<std::size_t>(row) * Vs;
  const float m = max[row], s = sumexp[row];
  const int tgt = targets[row];
  if (threadIdx.x == 0 && losses != nullptr)
    losses[row] = (tgt >= 0 && tgt < V) ? logf(s) + m - target_logit[row] : NAN;
  if (dlogits == nullptr) return;
  const float inv = 1.0f / s;
  for (int j = static_cast<int>(threadIdx.x); j < Vs; j += static_cast<int>(blockDim.x)) {
    const int g = offset + j;
    float d = 0.0f;
    if (g < V) d = dloss * (expf(to_float(logits[base + j]) - m) * inv - (g == tgt ? 1.0f : 0.0f));
    dlogits[base + j] = from_float<T>(d);
  }
}

// The two passes of the single-shard kernels below over one 16-byte piece x of a row (piece i,
// columns i * W ...; padding columns, >= V, count as -inf and get a zero gradient).
// fold: the thread's running max m and sum of exp(x - m) s take the piece in (one rescale per
// piece). Each exp is one FFMA and one exp2_approx (ncu had these kernels issue-bound, and
// exp2f spends three more instructions on subnormals); the max stays in natural units: it is
// a statistic, equal to the host's bit for bit.
template <int W>
__device__ __forceinline__ void ce_fold(float (&x)[W], int i, int V, float& m, float& s) {
  if ((i + 1) * W > V) {  // the piece holding column V: padding past it
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = i * W + k < V ? x[k] : -INFINITY;
  }
  float vm = x[0];
#pragma unroll
  for (int k = 1; k < W; ++k) vm = fmaxf(vm, x[k]);
  if (vm == -INFINITY) return;  // padding only
  const float nm = fmaxf(m, vm), nm2 = nm * log2e_f;
  float add = 0.0f;
#pragma unroll
  for (int k = 0; k < W; ++k) add += exp2_approx(fmaf(x[k], log2e_f, -nm2));
  s = s * exp2_approx((m - nm) * log2e_f) + add;
  m = nm;
}
// The gradient of the piece, in place: dloss * (softmax - onehot(tgt)); scale = dloss / sum,
// gm2 = the row's max * log2(e).
template <int W>
__device__ __forceinline__ void ce_grad(float (&x)[W], int i, int V, int tgt, bool tgt_ok, float scale, float gm2,
                                        float dloss) {
#pragma unroll
  for (int k = 0; k < W; ++k) x[k] = scale * exp2_approx(fmaf(x[k], log2e_f, -gm2));
  if ((i + 1) * W > V) {  // padding columns get 0
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = i * W + k < V ? x[k] : 0.0f;
  }
  if (tgt_ok && static_cast<unsigned>(tgt - i * W) < static_cast<unsigned>(W)) {  // the piece holding the target
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] -= i * W + k == tgt ? dloss : 0.0f;
  }
}
// The block's row of the single-shard kernels: where it starts, its target and the target's
// logit, read before any thread writes dlogits (which may alias the logits).
struct CeRow {
  int row;
  std::size_t base;
  int tgt;
  bool tgt_ok;
  float tl;
  template <class T>
  __device__ __forceinline__ CeRow(const T* logits, const int* targets, int Vp, int V)
      : row(static_cast<int>(blockIdx.x)), base(static_cast<std::size_t>(row) * Vp), tgt(targets[row]),
        tgt_ok(tgt >= 0 && tgt < V), tl(tgt_ok ? to_float(logits[base + tgt]) : 0.0f) {}
};
// The row's statistics from each thread's (m, s): the block's max and sum, written by thread 0
// (where the outputs are not null) with the loss. Synchronises the block.
__device__ __forceinline__ void ce_row_stats(float& gm, float& gs, float m, float s, float* scratch, const CeRow& r,
                                             float* losses, float* max_out, float* sumexp_out, float* target_out) {
  gm = block_max(m, scratch);
  gs = block_sum(m == -INFINITY ? 0.0f : s * exp2_approx((m - gm) * log2e_f), scratch);
  if (threadIdx.x == 0) {
    if (losses != nullptr) losses[r.row] = r.tgt_ok ? logf(gs) + gm - r.tl : NAN;
    if (max_out != nullptr) max_out[r.row] = gm;
    if (sumexp_out != nullptr) sumexp_out[r.row] = gs;
    if (target_out != nullptr) target_out[r.row] = r.tl;
  }
}

// The single-shard loss, one block per row, 16-byte accesses: the first pass keeps a running
// max and sum of exp per thread, the second reads the row again and writes the gradient.
// Keeping the row in registers between the passes was slower on an H200 (0.89 ms against 0.67
// for GPT-2's 8192 x 50304: one block per SM). Vp % vec16<T> == 0 (rows stay 16-byte aligned).
template <class T, int Threads>
__global__ void __launch_bounds__(Threads)
    crossentropy_rows_kernel(float* losses, T* dlogits, float* max_out, float* sumexp_out, float* target_out,
                             const T* logits, const int* targets, int Vp, int V, float dloss) {
  constexpr int W = vec16<T>;
  __shared__ float scratch[32];
  const CeRow r(logits, targets, Vp, V);
  const int nvec = Vp / W;
  float m = -INFINITY, s = 0.0f;  // running max and sum of exp(x - m) over this thread's columns
  for (int i = static_cast<int>(threadIdx.x); i < nvec; i += Threads) {
    float x[W];
    load_vec16(x, logits + r.base + static_cast<std::size_t>(i) * W);
    ce_fold(x, i, V, m, s);
  }
  float gm, gs;
  ce_row_stats(gm, gs, m, s, scratch, r, losses, max_out, sumexp_out, target_out);
  if (dlogits == nullptr) return;
  const float scale = dloss / gs, gm2 = gm * log2e_f;
  for (int i = static_cast<int>(threadIdx.x); i < nvec; i += Threads) {
    float x[W];
    load_vec16(x, logits + r.base + static_cast<std::size_t>(i) * W);
    ce_grad(x, i, V, r.tgt, r.tgt_ok, scale, gm2, dloss);
    store_vec16(dlogits + r.base + static_cast<std::size_t>(i) * W, x);
  }
}

// A 16-byte piece from global to shared memory: cp.async from sm_80 on (the copy in flight
// until the thread waits for its group), else through a register (done when the call returns,
// so the waits below have nothing to wait for): the kernel is correct whatever it was built for.
__device__ __forceinline__ void stage16(uint4* dst, const uint4* src) {
#if FIVED_FLASH_ARCH
  flash::cp_async16(dst, src, true);
#else
  *dst = *src;
#endif
}

// The same loss with the row staged in shared memory, so HBM is read once: the kernel above
// reads each row twice, and GPT-2's rows in flight (8 KiB short of 100 KiB each, four blocks an
// SM) outgrow the L2, so its second pass reads HBM again (ncu: DRAM 74% busy, the kernel at 70%
// of HBM counting one read and one write). Here each thread copies its own pieces in with
// cp.async (sm_80 and later), in two groups so the first half's max and sum start while the
// second half lands, and both passes read them there; a thread touches only the pieces it
// copied, so the reductions' are the only barriers. Two blocks an SM (one loads while the other
// computes); dlogits is written with streaming stores (nothing reads it again here). Where a
// row does not leave room for two blocks an SM, crossentropy_fused runs the kernel above.
template <class T, int Threads>
__global__ void __launch_bounds__(Threads, 2)
    crossentropy_staged_kernel(float* losses, T* dlogits, float* max_out, float* sumexp_out, float* target_out,
                               const T* logits, const int* targets, int Vp, int V, float dloss) {
  constexpr int W = vec16<T>;
  extern __shared__ uint4 staged[];  // the row: Vp / W pieces of 16 bytes
  __shared__ float scratch[32];
  const CeRow r(logits, targets, Vp, V);
  const int nvec = Vp / W, t = static_cast<int>(threadIdx.x);
  const int mine = t < nvec ? (nvec - 1 - t) / Threads + 1 : 0, half = (mine + 1) / 2;  // this thread's pieces
  const uint4* src = reinterpret_cast<const uint4*>(logits + r.base);
  for (int k = 0; k < half; ++k) stage16(staged + t + k * Threads, src + t + k * Threads);
  flash::cp_async_commit();
  for (int k = half; k < mine; ++k) stage16(staged + t + k * Threads, src + t + k * Threads);
  flash::cp_async_commit();
  float m = -INFINITY, s = 0.0f;
  const auto fold = [&](int first, int last) {
    for (int k = first; k < last; ++k) {
      float x[W];
      to_floats(x, reinterpret_cast<const Piece<T, W>*>(staged)[t + k * Threads]);
      ce_fold(x, t + k * Threads, V, m, s);
    }
  };
  flash::cp_async_wait<1>();
  fold(0, half);
  flash::cp_async_wait<0>();
  fold(half, mine);
  float gm, gs;
  ce_row_stats(gm, gs, m, s, scratch, r, losses, max_out, sumexp_out, target_out);
  if (dlogits == nullptr) return;
  const float scale = dloss / gs, gm2 = gm * log2e_f;
  uint4* dst = reinterpret_cast<uint4*>(dlogits + r.base);
  for (int k = 0; k < mine; ++k) {
    const int i = t + k * Threads;
    float x[W];
    to_floats(x, reinterpret_cast<const Piece<T, W>*>(staged)[i]);
    ce_grad(x, i, V, r.tgt, r.tgt_ok, scale, gm2, dloss);
    __stcs(dst + i, pack_vec16<T>(x));
  }
}

// The bytes of dynamic shared memory crossentropy_staged_kernel takes for rows of Vp, or 0
// where it does not run: before sm_80 (no cp.async), or where two blocks do not fit an SM.
template <class T>
int staged_row_bytes(int Vp) {
  const long bytes = static_cast<long>(Vp) * static_cast<long>(sizeof(T));
  int device = 0, per_sm = 0;
  FIVED_CUDA_CHECK(cudaGetDevice(&device));
  static thread_local long asked = -1;  // the last row size and device asked about, and the answer
  static thread_local int asked_device = -1, answer = 0;
  if (bytes == asked && device == asked_device) return answer;
  asked = bytes, asked_device = device, answer = 0;
  FIVED_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  // Two blocks, each with its static scratch and the 1 KiB the SM reserves a block, must fit an
  // SM; that also keeps the request under the opt-in limit less the static shared memory, which
  // cudaFuncSetAttribute would refuse (an error, not the fallback).
  const long static_bytes = 32 * static_cast<long>(sizeof(float)) + 1024;
  const long largest = per_sm / 2 - static_bytes;
  if (!device_is_sm80_or_later() || bytes > largest) return answer;
  const auto kernel = crossentropy_staged_kernel<T, ce_block>;
  // The kernel's limit is the device's and shared by every thread: set to the largest row any
  // of them stages, not this one's, so that a thread asking for a shorter row cannot lower it
  // under another's cached answer.
  allow_dynamic_smem(kernel, static_cast<std::size_t>(largest));
  if (resident_blocks(kernel, ce_block, static_cast<int>(bytes)) >= 2) answer = static_cast<int>(bytes);
  return answer;
}

// One block: each thread sums its rows in double, then a fixed-order tree (no atomics, so the
// result does not vary run to run).
template <int Threads>
__global__ void add_loss_sum_kernel(double* sum, const float* max, const float* sumexp, const float* target_logit, int N) {
  __shared__ double part[Threads];
  double s = 0;
  for (int i = static_cast<int>(threadIdx.x); i < N; i += Threads)
    s += log(static_cast<double>(sumexp[i])) + static_cast<double>(max[i]) - static_cast<double>(target_logit[i]);
  s = block_sum_in_order<Threads>(s, part);
  if (threadIdx.x == 0) *sum += s;
}

inline void check_ce_sizes(const char* kernel, int N, int Vs, int offset, int V) {
  require_non_negative(kernel, "N", N);
  require_non_negative(kernel, "Vs", Vs);
  require_positive(kernel, "V", V);
  require(offset >= 0, kernel, "offset must be non-negative (got " + std::to_string(offset) + ")");
}

}  // namespace detail

template <class T>
void logits_max(cudaStream_t stream, float* max, const T* logits, int N, int Vs, int offset, int V) {
  static_assert(is_element_v<T>, "logits_max: element type must be float or fived::bf16");
  detail::check_ce_sizes("logits_max", N, Vs, offset, V);
  if (N == 0) return;
  detail::logits_max_kernel<<<static_cast<unsigned>(N), detail::ce_block, 0, stream>>>(max, dev(logits), Vs, offset, V);
  FIVED_CUDA_CHECK_LAUNCH("logits_max_kernel");
}

template <class T>
void crossentropy_partials(cudaStream_t stream, float* sumexp, float* target_logit, const T* logits, const int* targets,
                           const float* max, int N, int Vs, int offset, int V) {
  static_assert(is_element_v<T>, "crossentropy_partials: element type must be float or fived::bf16");
  detail::check_ce_sizes("crossentropy_partials", N, Vs, offset, V);
  if (N == 0) return;
  detail::crossentropy_partials_kernel<<<static_cast<unsigned>(N), detail::ce_block, 0, stream>>>(
      sumexp, target_logit, dev(logits), targets, max, Vs, offset, V);
  FIVED_CUDA_CHECK_LAUNCH("crossentropy_partials_kernel");
}

template <class T>
void crossentropy_backward(cudaStream_t stream, float* losses, T* dlogits, const T* logits, const int* targets,
                           const float* max, const float* sumexp, const float* target_logit, int N, int Vs, int offset,
                           int V, double dloss) {
  static_assert(is_element_v<T>, "crossentropy_backward: element type must be float or fived::bf16");
  detail::check_ce_sizes("crossentropy_backward", N, Vs, offset, V);
  if (N == 0 || (losses == nullptr && dlogits == nullptr)) return;
  detail::crossentropy_backward_kernel<<<static_cast<unsigned>(N), detail::ce_block, 0, stream>>>(
      losses, dev(dlogits), dev(logits), targets, max, sumexp, target_logit, Vs, offset, V, static_cast<float>(dloss));
  FIVED_CUDA_CHECK_LAUNCH("crossentropy_backward_kernel");
}

// The loss of N rows from their statistics, added to *sum on the device: the host reads it
// once, after the work that needs no wait (a pipeline stage keeps issuing its schedule).
inline void add_loss_sum(cudaStream_t stream, double* sum, const float* max, const float* sumexp,
                         const float* target_logit, int N) {
  if (N <= 0) return;
  detail::add_loss_sum_kernel<256><<<1, 256, 0, stream>>>(sum, max, sumexp, target_logit, N);
  FIVED_CUDA_CHECK_LAUNCH("add_loss_sum_kernel");
}

// The single-shard loss and its gradient in one kernel; max, sumexp and target_logit (the
// statistics add_loss_sum reads) are written where not null, as are losses and dlogits.
template <class T>
void crossentropy_fused(cudaStream_t stream, float* losses, T* dlogits, float* max, float* sumexp, float* target_logit,
                        const T* logits, const int* targets, int N, int Vp, int V, double dloss) {
  static_assert(is_element_v<T>, "crossentropy_fused: element type must be float or fived::bf16");
  detail::check_ce_sizes("crossentropy_fused", N, Vp, 0, V);
  if (N == 0) return;
  detail::require(V <= Vp, "crossentropy_fused",
                  "the real vocabulary V (" + std::to_string(V) + ") exceeds the padded one Vp (" + std::to_string(Vp) + ")");
  const bool aligned = Vp % vec16<T> == 0 && reinterpret_cast<std::uintptr_t>(logits) % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(dlogits) % 16 == 0;
  if (aligned) {
    using E = device_t<T>;
    const int staged = detail::staged_row_bytes<E>(Vp);  // 0: the row is read twice
    const auto kernel = staged > 0 ? detail::crossentropy_staged_kernel<E, detail::ce_block>
                                   : detail::crossentropy_rows_kernel<E, detail::ce_block>;
    kernel<<<static_cast<unsigned>(N), detail::ce_block, staged, stream>>>(
        losses, dev(dlogits), max, sumexp, target_logit, dev(logits), targets, Vp, V, static_cast<float>(dloss));
    FIVED_CUDA_CHECK_LAUNCH(staged > 0 ? "crossentropy_staged_kernel" : "crossentropy_rows_kernel");
    return;
  }
  // Rows that are not 16-byte multiples: the statistics, then the gradient, one element at a time.
  Scratch<float> m(max == nullptr ? static_cast<std::size_t>(N) : 0, stream),
      s(sumexp == nullptr ? static_cast<std::size_t>(N) : 0, stream),
      t(target_logit == nullptr ? static_cast<std::size_t>(N) : 0, stream);
  float* mx = max != nullptr ? max : m.get();
  float* se = sumexp != nullptr ? sumexp : s.get();
  float* tg = target_logit != nullptr ? target_logit : t.get();
  logits_max(stream, mx, logits, N, Vp, 0, V);
  crossentropy_partials(stream, se, tg, logits, targets, mx, N, Vp, 0, V);
  crossentropy_backward(stream, losses, dlogits, logits, targets, mx, se, tg, N, Vp, 0, V, dloss);
}

template <class T>
void crossentropy_forward_backward(cudaStream_t stream, float* losses, T* dlogits, const T* logits, const int* targets,
                                   int N, int Vp, int V, double dloss) {
  static_assert(is_element_v<T>, "crossentropy_forward_backward: element type must be float or fived::bf16");
  if (losses == nullptr && dlogits == nullptr) return;
  crossentropy_fused(stream, losses, dlogits, static_cast<float*>(nullptr), static_cast<float*>(nullptr),
                     static_cast<float*>(nullptr), logits, targets, N, Vp, V, dloss);
}

}  // namespace fived::kernels::cuda
