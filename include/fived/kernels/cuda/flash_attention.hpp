#pragma once
// fived's own tensor-core attention for bf16: FlashAttention-2's algorithm on the warp-level
// mma.sync instructions (sm_80 and later). What attention_forward / attention_backward and
// ring attention's blocks (kernels/cuda/attention.hpp) run for bf16 when the shape fits
// (flash::fits) and cuDNN is not the one used.
//
// The kernels see one problem, `Operands`: B sequences of T rows, query head h reading
// key/value head h / (NH / NKV), q, k and v anywhere with their own row strides, causal (the
// diagonal: key u seen by query t only when u <= t) or not (every key), and with packed
// documents only the keys of the query's document (tiles outside them skipped; a row that
// sees no key of a ring block gets o = 0, lse = -inf from it). Where the results go
// is the output type: bf16 rows (a whole sequence: out and lse; dq, dk, dv overwritten), or
// float accumulators (a ring block: o and lse merged by log-sum-exp, dq, dk, dv added to).
//
// Forward: one block of 4 warps per (64-query tile, head, batch); each warp owns 16 query
// rows. Key/value tiles of 64 rows stream through shared memory, double-buffered with
// cp.async. S = Q K^T and O += P V run on mma.m16n8k16 (bf16 in, fp32 accumulate); the online
// softmax is fp32 in registers (exp2 with the scale folded in), and P goes from the
// accumulator registers straight back in as the A operand.
//
// Backward, deterministic (no atomics), in two kernels as the scalar one:
//   dK, dV: one block per (64-key tile, key/value head, batch); each warp owns 16 keys and
//     computes S^T = K Q^T and dP^T = V dO^T for the query tiles that see its keys, of every
//     query head of the group, so dV += P^T dO and dK += dS^T Q need no transposes;
//   dQ: one block per (64-query tile, head, batch): S = Q K^T, dP = dO V^T, dQ += dS K.
// P is recomputed from lse; dS = P (dP - D) with D_t = dout_t . out_t (precomputed).
// Head sizes 32, 64 and 128 exactly; rows of 16-byte multiples at 16-byte aligned addresses.

#include <cstddef>
#include <cstdint>

#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/cuda/flash_tiles.hpp>

namespace fived::kernels::cuda::detail {

namespace flash {

// ---- forward ------------------------------------------------------------------------------------
// Out = bf16x: o [B T, ldo] and lse [B, NH, T] are this problem's. Out = float: they are
// merged into (or, `first`, set to) o and lse.
template <int D, class Out>
__global__ void __launch_bounds__(threads) forward_kernel(Operands a, Out* o, std::size_t ldo, float* lse, bool first) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  bf16x* sQ = reinterpret_cast<bf16x*>(smem_bytes);
  bf16x* sKV = sQ + tile * stride<D>;  // 2 stages of [K | V]
  const int qt = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest rows first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z), T = a.T;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const std::size_t kvh = static_cast<std::size_t>(h / (a.NH / a.NKV)) * D;
  const bf16x* k = a.k + a.row(b, 0) * a.ldkv + kvh;
  const bf16x* v = a.v + a.row(b, 0) * a.ldkv + kvh;
  const int q0 = qt * tile, last = a.causal ? qt : (T - 1) / tile;
  const float sl2 = a.scale * log2e_f;  // scores in log2 units
  // Documents: this warp's rows' first keys (rows g and g + 8), and the tiles between the
  // tile's first row's first key and its last row's, where the bound cuts inside a key tile.
  int from[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) from[r] = a.first_key(b, min(q0 + warp * 16 + g + 8 * r, T - 1));
  const int kfirst = a.first_key(b, q0) / tile, cut = a.first_key(b, min(q0 + tile, T) - 1);

  auto stage = [&](int s) { return sKV + s * 2 * tile * stride<D>; };
  auto load_kv = [&](int i) {
    const int kt = kfirst + i;
    bf16x* st = stage(kt % 2);
    load_rows<D, tile>(st, k, a.ldkv, kt * tile, T);
    load_rows<D, tile>(st + tile * stride<D>, v, a.ldkv, kt * tile, T);
  };
  load_rows<D, tile>(sQ, a.q + a.row(b, 0) * a.ldq + static_cast<std::size_t>(h) * D, a.ldq, q0, T);
  float acc[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const bf16x* my_q = sQ + warp * 16 * stride<D>;
  pipelined(last + 1 - kfirst, load_kv, [&](int i) {
    const int kt = kfirst + i;
    const bf16x* sK = stage(kt % 2);
    const bf16x* sV = sK + tile * stride<D>;
    float s[tile / 8][4] = {};
    rows_times_rows<D, tile>(s, my_q, sK);
    // the mask (the diagonal tile, keys past T, documents' first keys), then the online softmax
    // of rows g and g + 8
    const bool edge = (a.causal && kt == qt) || (kt + 1) * tile > T || kt * tile < cut;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < tile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query = q0 + warp * 16 + g + 8 * (e / 2), key = kt * tile + 8 * n + 2 * c + e % 2;
        const bool seen = !edge || (key < T && (!a.causal || key <= query) && key >= from[e / 2]);
        s[n][e] = seen ? s[n][e] * sl2 : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
      }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      // -inf while a row has seen no key (documents): subtract 0 instead, so p and corr are 0
      const float m_new = fmaxf(m[r], mx[r]), m_use = m_new == -INFINITY ? 0.0f : m_new;
      corr[r] = exp2_approx(m[r] - m_use);
      m[r] = m_new;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int n = 0; n < tile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2_approx(s[n][e] - (m[e / 2] == -INFINITY ? 0.0f : m[e / 2]));
        l[e / 2] += s[n][e];  // this thread's part of the row sum: the quad adds at the end
      }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] *= corr[e / 2];
    regs_times_tile<D, tile>(acc, s, sV);
  });
  // lse of rows g and g + 8 (natural log); Out = float and not first: merged with the earlier
  // blocks', o = o1 exp(l1 - l) + o2 exp(l2 - l), l = log(exp(l1) + exp(l2)).
  float mul[2], keep[2] = {0.0f, 0.0f};
  float* lse_row = lse + (static_cast<std::size_t>(b) * a.NH + h) * T;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int t = q0 + warp * 16 + g + 8 * r;
    const bool any = l[r] > 0.0f;  // not so for a row that saw no key of the block (documents)
    float lse_new = any ? (m[r] + log2f(l[r])) / log2e_f : -INFINITY;
    mul[r] = any ? 1.0f / l[r] : 0.0f;
    if constexpr (std::is_same_v<Out, float>) {
      if (!first && t < T && !any) {
        keep[r] = 1.0f;  // nothing to merge: o and lse stay
        lse_new = lse_row[t];
      } else if (!first && t < T) {
        const float lo = lse_row[t], top = fmaxf(lo, lse_new);
        const float merged = top + logf(expf(lo - top) + expf(lse_new - top));
        keep[r] = expf(lo - merged);
        mul[r] *= expf(lse_new - merged);
        lse_new = merged;
      }
    }
    __syncwarp();  // every lane of the quad has read lse_row[t]
    if (c == 0 && t < T) lse_row[t] = lse_new;
  }
  put_rows<D>(o + a.row(b, 0) * ldo + static_cast<std::size_t>(h) * D, ldo, acc, q0 + warp * 16, T, mul, keep);
}

// ---- backward ---------------------------------------------------------------------------------
// What the backward reads beside the operands, and where it puts the gradients: dout [B T,
// lddo] (query heads' columns), lse and Dd [B, NH, T]; dq [B T, lddq] (query heads), dk and
// dv [B T, lddkv] (key/value heads), of type Out: bf16x (overwritten; dq and dk times the
// scale) or float (added to).
template <class Out>
struct Gradients {
  const bf16x* dout;
  std::size_t lddo;
  const float *lse, *Dd;
  Out *dq, *dk, *dv;
  std::size_t lddq, lddkv;
};

// Queries (or keys) per step of the inner loops: 64, or 32 at head size 128 (the registers of
// the accumulators are twice as many).
template <int D>
inline constexpr int step_rows = D > 64 ? 32 : 64;

// Whether query `query`, whose document's first key is `from` (0 without documents), sees key `key`.
__device__ __forceinline__ bool sees(const Operands& a, int query, int key, int from) {
  return query < a.T && key < a.T && (!a.causal || key <= query) && key >= from;
}

// Documents: the query tiles of `rows` rows whose first row sees a key before `end` (their
// first keys never decrease along the rows, so they are tiles [0, count)); without documents
// all of them.
template <int rows>
__device__ __forceinline__ int tiles_seeing(const Operands& a, int b, int end) {
  int lo = 0, hi = (a.T + rows - 1) / rows;  // the answer lies in [lo, hi]
  if (a.docs.first == nullptr) return hi;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (a.first_key(b, mid * rows) < end) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

template <int D, class Out>
__global__ void __launch_bounds__(threads, D > 64 ? 1 : 3) backward_kv_kernel(Operands a, Gradients<Out> gr) {
  constexpr int BQ = step_rows<D>;
  constexpr int stage_elems = 2 * BQ * stride<D>;  // [Q | dO], then 3 x BQ words
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  bf16x* sK = reinterpret_cast<bf16x*>(smem_bytes);
  bf16x* sV = sK + tile * stride<D>;
  bf16x* stages = sV + tile * stride<D>;
  float* stats = reinterpret_cast<float*>(stages + 2 * stage_elems);  // 2 stages of [lse | D | first keys]
  const int kt = static_cast<int>(blockIdx.x);  // tile 0 has the most work and starts first
  const int j = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z), T = a.T;
  const int group = a.NH / a.NKV;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const std::size_t kvh = static_cast<std::size_t>(j) * D;
  const int k0 = kt * tile;
  const float sl2 = a.scale * log2e_f;
  // The steps: every query head of the group, the query tiles of BQ that see these keys (from
  // the diagonal when causal; documents: up to the last whose first row's document reaches them).
  const int first = a.causal ? k0 / BQ : 0, per_head = tiles_seeing<BQ>(a, b, min(k0 + tile, T)) - first;
  const int steps = per_head > 0 ? group * per_head : 0;
  auto load_step = [&](int i) {
    const int h = j * group + i / per_head, t0 = (first + i % per_head) * BQ;
    bf16x* st = stages + (i % 2) * stage_elems;
    load_rows<D, BQ>(st, a.q + a.row(b, 0) * a.ldq + static_cast<std::size_t>(h) * D, a.ldq, t0, T);
    load_rows<D, BQ>(st + BQ * stride<D>, gr.dout + a.row(b, 0) * gr.lddo + static_cast<std::size_t>(h) * D, gr.lddo,
                     t0, T);
    const std::size_t row = (static_cast<std::size_t>(b) * a.NH + h) * T;
    float* ss = stats + (i % 2) * 3 * BQ;
    load_floats<BQ>(ss, gr.lse + row, t0, T);
    load_floats<BQ>(ss + BQ, gr.Dd + row, t0, T);
    if (a.docs.first != nullptr) load_floats<BQ>(reinterpret_cast<int*>(ss + 2 * BQ), a.docs.first + a.row(b, 0), t0, T);
  };
  load_rows<D, tile>(sK, a.k + a.row(b, 0) * a.ldkv + kvh, a.ldkv, k0, T);
  load_rows<D, tile>(sV, a.v + a.row(b, 0) * a.ldkv + kvh, a.ldkv, k0, T);
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  const bf16x* my_k = sK + warp * 16 * stride<D>;
  const bf16x* my_v = sV + warp * 16 * stride<D>;
  pipelined(steps, load_step, [&](int i) {
    const bf16x* sQ = stages + (i % 2) * stage_elems;
    const bf16x* sO = sQ + BQ * stride<D>;
    const float* sL = stats + (i % 2) * 3 * BQ;
    const float* sD = sL + BQ;
    const int* sF = reinterpret_cast<const int*>(sD + BQ);  // the queries' document starts
    const int t0 = (first + i % per_head) * BQ;
    float s[BQ / 8][4] = {}, dp[BQ / 8][4] = {};
    rows_times_rows<D, BQ>(s, my_k, sQ);   // S^T: keys x queries
    rows_times_rows<D, BQ>(dp, my_v, sO);  // dP^T
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + warp * 16 + g + 8 * (e / 2), qi = 8 * n + 2 * c + e % 2;
        const int from = a.docs.first == nullptr ? 0 : sF[qi] - static_cast<int>(a.docs.key_position);
        const float p = sees(a, t0 + qi, key, from) ? exp2_approx(s[n][e] * sl2 - sL[qi] * log2e_f) : 0.0f;
        s[n][e] = p;
        dp[n][e] = p * (dp[n][e] - sD[qi]);
      }
    regs_times_tile<D, BQ>(dv, s, sO);   // dV += P^T dO
    regs_times_tile<D, BQ>(dk, dp, sQ);  // dK += dS^T Q
  });
  const bool add = std::is_same_v<Out, float>;
  const float scale[2] = {a.scale, a.scale}, one[2] = {1.0f, 1.0f}, keep[2] = {add ? 1.0f : 0.0f, add ? 1.0f : 0.0f};
  put_rows<D>(gr.dk + a.row(b, 0) * gr.lddkv + kvh, gr.lddkv, dk, k0 + warp * 16, T, scale, keep);
  put_rows<D>(gr.dv + a.row(b, 0) * gr.lddkv + kvh, gr.lddkv, dv, k0 + warp * 16, T, one, keep);
}

template <int D, class Out>
__global__ void __launch_bounds__(threads) backward_q_kernel(Operands a, Gradients<Out> gr) {
  constexpr int BK = step_rows<D>;  // keys per step
  constexpr int stage_elems = 2 * BK * stride<D>;  // [K | V]
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  bf16x* sQ = reinterpret_cast<bf16x*>(smem_bytes);
  bf16x* sO = sQ + tile * stride<D>;
  bf16x* stages = sO + tile * stride<D>;
  const int qt = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest rows first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z), T = a.T;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const std::size_t head = static_cast<std::size_t>(h) * D, kvh = static_cast<std::size_t>(h / (a.NH / a.NKV)) * D;
  const bf16x* k = a.k + a.row(b, 0) * a.ldkv + kvh;
  const bf16x* v = a.v + a.row(b, 0) * a.ldkv + kvh;
  const int q0 = qt * tile;
  const float sl2 = a.scale * log2e_f;
  // The key steps these queries see: from their first row's document's first key, to the diagonal.
  const int keys = a.causal ? min(q0 + tile, T) : T, kfirst = a.first_key(b, q0) / BK;
  const int steps = (keys + BK - 1) / BK - kfirst;
  auto load_step = [&](int i) {
    bf16x* st = stages + (i % 2) * stage_elems;
    load_rows<D, BK>(st, k, a.ldkv, (kfirst + i) * BK, T);
    load_rows<D, BK>(st + BK * stride<D>, v, a.ldkv, (kfirst + i) * BK, T);
  };
  load_rows<D, tile>(sQ, a.q + a.row(b, 0) * a.ldq + head, a.ldq, q0, T);
  load_rows<D, tile>(sO, gr.dout + a.row(b, 0) * gr.lddo + head, gr.lddo, q0, T);

  const std::size_t row = (static_cast<std::size_t>(b) * a.NH + h) * T;
  float rl[2], rd[2];
  int from[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = q0 + warp * 16 + g + 8 * r;
    rl[r] = t < T ? gr.lse[row + t] * log2e_f : 0.0f;
    rd[r] = t < T ? gr.Dd[row + t] : 0.0f;
    from[r] = a.first_key(b, min(t, T - 1));
  }
  float dq[D / 8][4] = {};
  const bf16x* my_q = sQ + warp * 16 * stride<D>;
  const bf16x* my_o = sO + warp * 16 * stride<D>;
  pipelined(steps, load_step, [&](int i) {
    const bf16x* sK = stages + (i % 2) * stage_elems;
    const bf16x* sV = sK + BK * stride<D>;
    float s[BK / 8][4] = {}, dp[BK / 8][4] = {};
    rows_times_rows<D, BK>(s, my_q, sK);
    rows_times_rows<D, BK>(dp, my_o, sV);
#pragma unroll
    for (int n = 0; n < BK / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query = q0 + warp * 16 + g + 8 * (e / 2), key = (kfirst + i) * BK + 8 * n + 2 * c + e % 2;
        const float p = sees(a, query, key, from[e / 2]) ? exp2_approx(s[n][e] * sl2 - rl[e / 2]) : 0.0f;
        dp[n][e] = p * (dp[n][e] - rd[e / 2]);
      }
    regs_times_tile<D, BK>(dq, dp, sK);  // dQ += dS K
  });
  const bool add = std::is_same_v<Out, float>;
  const float scale[2] = {a.scale, a.scale}, keep[2] = {add ? 1.0f : 0.0f, add ? 1.0f : 0.0f};
  put_rows<D>(gr.dq + a.row(b, 0) * gr.lddq + head, gr.lddq, dq, q0 + warp * 16, T, scale, keep);
}

// ---- launch -------------------------------------------------------------------------------------

// Whether the tensor-core kernels take a problem: an sm_80+ device, head size 32, 64 or 128,
// every row stride (in elements) a multiple of 8 and every pointer 16-byte aligned.
inline bool fits(int hs, int NH, int NKV, std::initializer_list<std::size_t> strides,
                 std::initializer_list<const void*> ptrs) {
  if (hs != 32 && hs != 64 && hs != 128) return false;
  if (NKV <= 0 || NH % NKV != 0 || !aligned16(ptrs)) return false;
  for (const std::size_t ld : strides)
    if (ld % 8 != 0) return false;
  return device_is_sm80_or_later();
}

template <int D>
inline constexpr std::size_t forward_smem = sizeof(bf16x) * 5 * tile * stride<D>;
template <int D>
inline constexpr std::size_t backward_kv_smem =
    sizeof(bf16x) * (2 * tile + 4 * step_rows<D>) * stride<D> + sizeof(float) * 6 * step_rows<D>;
template <int D>
inline constexpr std::size_t backward_q_smem = sizeof(bf16x) * (2 * tile + 4 * step_rows<D>) * stride<D>;

inline dim3 grid(int T, int heads, int B) {
  return dim3(static_cast<unsigned>((T + tile - 1) / tile), static_cast<unsigned>(heads), static_cast<unsigned>(B));
}

template <int D, class Out>
void forward(cudaStream_t stream, const Operands& a, int B, Out* o, std::size_t ldo, float* lse, bool first) {
  allow_dynamic_smem(forward_kernel<D, Out>, forward_smem<D>);
  forward_kernel<D, Out><<<grid(a.T, a.NH, B), threads, forward_smem<D>, stream>>>(a, o, ldo, lse, first);
  FIVED_CUDA_CHECK_LAUNCH("flash::forward_kernel");
}

template <int D, class Out>
void backward(cudaStream_t stream, const Operands& a, int B, const Gradients<Out>& gr) {
  allow_dynamic_smem(backward_kv_kernel<D, Out>, backward_kv_smem<D>);
  backward_kv_kernel<D, Out><<<grid(a.T, a.NKV, B), threads, backward_kv_smem<D>, stream>>>(a, gr);
  FIVED_CUDA_CHECK_LAUNCH("flash::backward_kv_kernel");
  allow_dynamic_smem(backward_q_kernel<D, Out>, backward_q_smem<D>);
  backward_q_kernel<D, Out><<<grid(a.T, a.NH, B), threads, backward_q_smem<D>, stream>>>(a, gr);
  FIVED_CUDA_CHECK_LAUNCH("flash::backward_q_kernel");
}

// Runs f.template operator()<D>() with D = hs (one of fits' head sizes).
template <class F>
void with_head_size(int hs, F&& f) {
  if (hs == 32)
    f.template operator()<32>();
  else if (hs == 64)
    f.template operator()<64>();
  else
    f.template operator()<128>();
}

}  // namespace flash
}  // namespace fived::kernels::cuda::detail
