#pragma once
// Ring attention's blocks (context parallelism), contract of the host block kernels
// (kernels/host/attention.hpp) with a leading stream:
//   attention_block_forward(s, o, lse, q, k, v, ldq, ldkv, B, n, C, NH, NKV, causal, docs, first)
//   attention_row_dot(s, Dd, dout, out, B, n, C, NH)
//   attention_block_backward(s, dq, dk, dv, lddkv, dout, Dd, lse, q, k, v, ldq, ldkv, B, n, C, NH, NKV, causal, docs)
// docs: the packed documents' mask (context/documents.hpp; docs.first in device memory).
// o, lse, dq, dk, dv are float. bf16 blocks that fit run on the tensor-core kernels (the
// same ones as whole sequences, merging into the float accumulators); the rest run one warp
// per query (or key) row walking the other side's rows with warp reductions: simple and
// deterministic, and far from the tile kernels in speed.

#include <cmath>
#include <cstddef>

#include <fived/context/documents.hpp>
#include <fived/kernels/cuda/attention.hpp>
#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/cuda/flash_attention.hpp>

namespace fived::kernels::cuda {

namespace detail {

inline constexpr int block_row_warps = 8;  // rows (warps) per thread block
inline constexpr int block_dims = 4;       // head size up to 4 x 32 = 128 per lane set

// Row r of B * NH * n: (b, h, t) with t fastest.
struct BlockRow {
  int b, h, t;
  __device__ BlockRow(long long r, int n, int NH)
      : b(static_cast<int>(r / (static_cast<long long>(n) * NH))), h(static_cast<int>((r / n) % NH)),
        t(static_cast<int>(r % n)) {}
};

template <class E>
__device__ __forceinline__ void load_row(float (&x)[block_dims], const E* p, int hs, int lane, float mul) {
#pragma unroll
  for (int i = 0; i < block_dims; ++i) {
    const int d = lane + 32 * i;
    x[i] = d < hs ? to_float(p[d]) * mul : 0.0f;
  }
}
__device__ __forceinline__ float row_dot(const float (&a)[block_dims], const float (&b)[block_dims]) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < block_dims; ++i) s += a[i] * b[i];
  return warp_sum(s);
}

template <class E>
__global__ void attention_block_forward_kernel(float* o, float* lse, const E* q, const E* k, const E* v, int ldq,
                                               int ldkv, int B, int n, int C, int NH, int NKV, int hs, float scale,
                                               bool causal, DocumentMask docs, bool first) {
  const long long r = static_cast<long long>(blockIdx.x) * block_row_warps + threadIdx.x / 32;
  if (r >= static_cast<long long>(B) * NH * n) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const BlockRow at(r, n, NH);
  const std::size_t base = static_cast<std::size_t>(at.b) * n, kvh = static_cast<std::size_t>(at.h / (NH / NKV)) * hs;
  float qr[block_dims], kr[block_dims], vr[block_dims], acc[block_dims] = {};
  load_row(qr, q + (base + at.t) * ldq + static_cast<std::size_t>(at.h) * hs, hs, lane, scale);
  float m = -INFINITY, l = 0.0f;
  for (int j = docs.first_key(base + at.t, n), keys = causal ? at.t + 1 : n; j < keys; ++j) {
    load_row(kr, k + (base + j) * ldkv + kvh, hs, lane, 1.0f);
    load_row(vr, v + (base + j) * ldkv + kvh, hs, lane, 1.0f);
    const float s = row_dot(qr, kr), m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), p = expf(s - m_new);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < block_dims; ++i) acc[i] = acc[i] * corr + p * vr[i];
    m = m_new;
  }
  // A row that saw no key (documents) gives o = 0 and lse = -inf, and merges as nothing.
  const bool any = l > 0.0f;
  const float l_new = any ? m + logf(l) : -INFINITY;
  const std::size_t srow = (static_cast<std::size_t>(at.b) * NH + at.h) * n + at.t;
  float* out = o + (base + at.t) * C + static_cast<std::size_t>(at.h) * hs;
  float keep = 0.0f, add = any ? 1.0f / l : 0.0f, merged = l_new;
  if (!first && !any) {
    keep = 1.0f, merged = lse[srow];
  } else if (!first) {
    const float lo = lse[srow], top = fmaxf(lo, l_new);
    merged = top + logf(expf(lo - top) + expf(l_new - top));
    keep = expf(lo - merged), add = expf(l_new - merged) / l;
  }
#pragma unroll
  for (int i = 0; i < block_dims; ++i) {
    const int d = lane + 32 * i;
    if (d < hs) out[d] = (first ? 0.0f : out[d] * keep) + acc[i] * add;
  }
  __syncwarp();  // every lane has read lse[srow]
  if (lane == 0) lse[srow] = merged;
}

// dq of one query row over the block's keys.
template <class E>
__global__ void attention_block_backward_q_kernel(float* dq, const E* dout, const float* Dd, const float* lse,
                                                  const E* q, const E* k, const E* v, int ldq, int ldkv, int B, int n,
                                                  int C, int NH, int NKV, int hs, float scale, bool causal,
                                                  DocumentMask docs) {
  const long long r = static_cast<long long>(blockIdx.x) * block_row_warps + threadIdx.x / 32;
  if (r >= static_cast<long long>(B) * NH * n) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const BlockRow at(r, n, NH);
  const std::size_t base = static_cast<std::size_t>(at.b) * n, head = static_cast<std::size_t>(at.h) * hs;
  const std::size_t kvh = static_cast<std::size_t>(at.h / (NH / NKV)) * hs;
  const std::size_t srow = (static_cast<std::size_t>(at.b) * NH + at.h) * n + at.t;
  float qr[block_dims], gr[block_dims], kr[block_dims], vr[block_dims], acc[block_dims] = {};
  load_row(qr, q + (base + at.t) * ldq + head, hs, lane, 1.0f);
  load_row(gr, dout + (base + at.t) * C + head, hs, lane, 1.0f);
  const float l = lse[srow], D = Dd[srow];
  for (int j = docs.first_key(base + at.t, n), keys = causal ? at.t + 1 : n; j < keys; ++j) {
    load_row(kr, k + (base + j) * ldkv + kvh, hs, lane, 1.0f);
    load_row(vr, v + (base + j) * ldkv + kvh, hs, lane, 1.0f);
    const float p = expf(row_dot(qr, kr) * scale - l), ds = p * (row_dot(gr, vr) - D) * scale;
#pragma unroll
    for (int i = 0; i < block_dims; ++i) acc[i] += ds * kr[i];
  }
  float* out = dq + (base + at.t) * C + head;
#pragma unroll
  for (int i = 0; i < block_dims; ++i)
    if (lane + 32 * i < hs) out[lane + 32 * i] += acc[i];
}

// dk and dv of one key row of key/value head j over the block's queries, of every query head
// that reads j.
template <class E>
__global__ void attention_block_backward_kv_kernel(float* dk, float* dv, int lddkv, const E* dout, const float* Dd,
                                                   const float* lse, const E* q, const E* k, const E* v, int ldq,
                                                   int ldkv, int B, int n, int C, int NH, int NKV, int hs, float scale,
                                                   bool causal, DocumentMask docs) {
  const long long r = static_cast<long long>(blockIdx.x) * block_row_warps + threadIdx.x / 32;
  if (r >= static_cast<long long>(B) * NKV * n) return;
  const int lane = static_cast<int>(threadIdx.x) % 32, group = NH / NKV;
  const BlockRow at(r, n, NKV);  // at.h: the key/value head j, at.t: the key row
  const std::size_t base = static_cast<std::size_t>(at.b) * n, kvh = static_cast<std::size_t>(at.h) * hs;
  float kr[block_dims], vr[block_dims], qr[block_dims], gr[block_dims], ak[block_dims] = {}, av[block_dims] = {};
  load_row(kr, k + (base + at.t) * ldkv + kvh, hs, lane, 1.0f);
  load_row(vr, v + (base + at.t) * ldkv + kvh, hs, lane, 1.0f);
  for (int h = at.h * group; h < (at.h + 1) * group; ++h) {
    const std::size_t head = static_cast<std::size_t>(h) * hs;
    const std::size_t stats = (static_cast<std::size_t>(at.b) * NH + h) * n;
    // documents: the queries' first keys never decrease, so none after the first past this key
    for (int i = causal ? at.t : 0; i < n && docs.first_key(base + i, n) <= at.t; ++i) {
      load_row(qr, q + (base + i) * ldq + head, hs, lane, 1.0f);
      load_row(gr, dout + (base + i) * C + head, hs, lane, 1.0f);
      const float p = expf(row_dot(qr, kr) * scale - lse[stats + i]);
      const float ds = p * (row_dot(gr, vr) - Dd[stats + i]) * scale;
#pragma unroll
      for (int d = 0; d < block_dims; ++d) ak[d] += ds * qr[d], av[d] += p * gr[d];
    }
  }
  float* outk = dk + (base + at.t) * lddkv + kvh;
  float* outv = dv + (base + at.t) * lddkv + kvh;
#pragma unroll
  for (int d = 0; d < block_dims; ++d)
    if (lane + 32 * d < hs) outk[lane + 32 * d] += ak[d], outv[lane + 32 * d] += av[d];
}

inline unsigned block_row_grid(int B, int n, int NH, const char* kernel) {
  const long long rows = static_cast<long long>(B) * NH * n;
  const long long blocks = (rows + block_row_warps - 1) / block_row_warps;
  require(blocks <= 0x7fffffffLL, kernel, "too many rows for one grid");
  return static_cast<unsigned>(blocks);
}

}  // namespace detail

template <class E>
void attention_block_forward(cudaStream_t stream, float* o, float* lse, const E* q, const E* k, const E* v, int ldq,
                             int ldkv, int B, int n, int C, int NH, int NKV, bool causal, DocumentMask docs,
                             bool first) {
  static_assert(is_element_v<E>, "attention_block_forward: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_block_forward", B, n, C, NH, NKV);
  if (B == 0 || n == 0) return;
  if constexpr (std::is_same_v<E, fived::bf16>) {
    const detail::flash::Operands a{dev(q), dev(k), dev(v), static_cast<std::size_t>(ldq), static_cast<std::size_t>(ldkv),
                                    n, NH, NKV, causal, 1.0f / sqrtf(static_cast<float>(hs)), docs};
    if (detail::flash::fits(hs, NH, NKV, {a.ldq, a.ldkv, static_cast<std::size_t>(C)}, {o, q, k, v})) {
      detail::flash::with_head_size(hs, [&]<int D>() {
        detail::flash::forward<D>(stream, a, B, o, static_cast<std::size_t>(C), lse, first);
      });
      return;
    }
  }
  detail::attention_block_forward_kernel<<<detail::block_row_grid(B, n, NH, "attention_block_forward"),
                                           32 * detail::block_row_warps, 0, stream>>>(
      o, lse, dev(q), dev(k), dev(v), ldq, ldkv, B, n, C, NH, NKV, hs, 1.0f / sqrtf(static_cast<float>(hs)), causal,
      docs, first);
  FIVED_CUDA_CHECK_LAUNCH("attention_block_forward_kernel");
}

template <class E>
void attention_row_dot(cudaStream_t stream, float* Dd, const E* dout, const E* out, int B, int n, int C, int NH) {
  static_assert(is_element_v<E>, "attention_row_dot: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_row_dot", B, n, C, NH, 1);
  if (B == 0 || n == 0) return;
  detail::attention_dot(stream, Dd, dev(dout), dev(out), B, n, C, NH, hs);
}

template <class E>
void attention_block_backward(cudaStream_t stream, float* dq, float* dk, float* dv, int lddkv, const E* dout,
                              const float* Dd, const float* lse, const E* q, const E* k, const E* v, int ldq, int ldkv,
                              int B, int n, int C, int NH, int NKV, bool causal, DocumentMask docs) {
  static_assert(is_element_v<E>, "attention_block_backward: element type must be float or fived::bf16");
  const int hs = detail::attention_check("attention_block_backward", B, n, C, NH, NKV);
  if (B == 0 || n == 0) return;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  if constexpr (std::is_same_v<E, fived::bf16>) {
    const detail::flash::Operands a{dev(q), dev(k), dev(v), static_cast<std::size_t>(ldq), static_cast<std::size_t>(ldkv),
                                    n, NH, NKV, causal, scale, docs};
    const std::size_t Cs = static_cast<std::size_t>(C), lds = static_cast<std::size_t>(lddkv);
    if (detail::flash::fits(hs, NH, NKV, {a.ldq, a.ldkv, Cs, lds}, {dq, dk, dv, dout, q, k, v})) {
      const detail::flash::Gradients<float> gr{dev(dout), Cs, lse, Dd, dq, dk, dv, Cs, lds};
      detail::flash::with_head_size(hs, [&]<int D>() { detail::flash::backward<D>(stream, a, B, gr); });
      return;
    }
  }
  detail::attention_block_backward_q_kernel<<<detail::block_row_grid(B, n, NH, "attention_block_backward"),
                                              32 * detail::block_row_warps, 0, stream>>>(
      dq, dev(dout), Dd, lse, dev(q), dev(k), dev(v), ldq, ldkv, B, n, C, NH, NKV, hs, scale, causal, docs);
  FIVED_CUDA_CHECK_LAUNCH("attention_block_backward_q_kernel");
  detail::attention_block_backward_kv_kernel<<<detail::block_row_grid(B, n, NKV, "attention_block_backward"),
                                               32 * detail::block_row_warps, 0, stream>>>(
      dk, dv, lddkv, dev(dout), Dd, lse, dev(q), dev(k), dev(v), ldq, ldkv, B, n, C, NH, NKV, hs, scale, causal, docs);
  FIVED_CUDA_CHECK_LAUNCH("attention_block_backward_kv_kernel");
}

}  // namespace fived::kernels::cuda
