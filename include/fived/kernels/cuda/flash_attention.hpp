#pragma once
// fived's own tensor-core attention for bf16: FlashAttention-2's algorithm on the warp-level
// mma.sync instructions (sm_80 and later). What attention_forward / attention_backward and
// ring attention's blocks (kernels/cuda/attention.hpp) run for bf16 when the shape fits
// (flash::fits) and cuDNN is not the one used.
//
// The kernels see one problem, `Operands`: B sequences of T rows, query head h reading
// key/value head h / (NH / NKV), q, k and v anywhere with their own row strides, causal (the
// diagonal: key u seen by query t only when u <= t) or not (every key). Where the results go
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

namespace fived::kernels::cuda::detail {

namespace flash {

using bf16x = __nv_bfloat16;
inline constexpr int threads = 128;  // 4 warps
inline constexpr int tile = 64;      // rows a block owns: 16 a warp

// ---- warp-level instructions (sm_80+) -------------------------------------------------------
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FIVED_FLASH_ARCH 1
#else
#define FIVED_FLASH_ARCH 0
#endif

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of bf16 from shared memory, lane l naming the row of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
#if FIVED_FLASH_ARCH
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
#if FIVED_FLASH_ARCH
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
#endif
}

// c += a b: a 16x16 (row), b 16x8 (col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if FIVED_FLASH_ARCH
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// 16 (or 4) bytes global -> shared without passing through registers; zeros when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if FIVED_FLASH_ARCH
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
#if FIVED_FLASH_ARCH
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 4 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if FIVED_FLASH_ARCH
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
#if FIVED_FLASH_ARCH
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
#endif
}

// The double-buffered loop of every kernel here: load(i) starts copying step i's tiles into
// buffer i % 2, one step ahead; body(i) runs once they have arrived, and buffer i % 2 is free
// again after it. Copies started before the call arrive with step 0's.
template <class Load, class Body>
__device__ __forceinline__ void pipelined(int steps, Load&& load, Body&& body) {
  load(0);
  cp_async_commit();
  for (int i = 0; i < steps; ++i) {
    if (i + 1 < steps) {
      load(i + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    body(i);
    __syncthreads();
  }
}

// ---- tiles in shared memory -------------------------------------------------------------------
// A tile of rows x D bf16, row stride D + 8: the 16 extra bytes put the 8 rows one ldmatrix
// reads on different banks.
template <int D>
inline constexpr int stride = D + 8;

// Starts copying rows [t0, t0 + rows) of a [T, ld] row-major head slice into `dst`; rows past
// T read as zero.
template <int D, int rows>
__device__ __forceinline__ void load_rows(bf16x* dst, const bf16x* src, std::size_t ld, int t0, int T) {
  constexpr int chunks = D / 8;  // 16 bytes each
  for (int i = static_cast<int>(threadIdx.x); i < rows * chunks; i += threads) {
    const int r = i / chunks, c = i % chunks, t = t0 + r;
    const bool valid = t < T;
    cp_async16(dst + r * stride<D> + c * 8, src + (valid ? static_cast<std::size_t>(t) * ld + c * 8 : 0), valid);
  }
}
// Starts copying floats [t0, t0 + rows) of a length-T row into `dst`; zero past T.
template <int rows>
__device__ __forceinline__ void load_floats(float* dst, const float* src, int t0, int T) {
  for (int i = static_cast<int>(threadIdx.x); i < rows; i += threads) {
    const bool valid = t0 + i < T;
    cp_async4(dst + i, src + (valid ? t0 + i : 0), valid);
  }
}

// The A operand (16 rows x 16 columns from column k0) of a row-major tile.
template <int D>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const bf16x* tile_rows, int k0) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  ldmatrix_x4(a, tile_rows + (lane % 16) * stride<D> + k0 + (lane / 16) * 8);
}
// The B operands of two n-tiles (rows n0..n0+15 of the tile as columns of B, k from column k0):
// b = rows^T. r[0], r[1] are n-tile n0; r[2], r[3] n-tile n0 + 8.
template <int D>
__device__ __forceinline__ void load_b_rows(unsigned (&r)[4], const bf16x* t, int n0, int k0) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  ldmatrix_x4(r, t + (n0 + lane % 8 + (lane / 16) * 8) * stride<D> + k0 + ((lane / 8) % 2) * 8);
}
// The B operands of two n-tiles where the tile is B itself (rows = k from row k0, columns =
// n from column n0): r[0], r[1] are n-tile n0; r[2], r[3] n-tile n0 + 8.
template <int D>
__device__ __forceinline__ void load_b_cols(unsigned (&r)[4], const bf16x* t, int k0, int n0) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  ldmatrix_x4_trans(r, t + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * stride<D> + n0 + (lane / 16) * 8);
}

// acc[n] (16 x N, n-tiles of 8) += A (16 rows of `a_rows`, K = D) x rows^T (N rows of `b_rows`).
template <int D, int N>
__device__ __forceinline__ void rows_times_rows(float (&acc)[N / 8][4], const bf16x* a_rows, const bf16x* b_rows) {
#pragma unroll
  for (int k = 0; k < D; k += 16) {
    unsigned a[4];
    load_a<D>(a, a_rows, k);
#pragma unroll
    for (int n = 0; n < N; n += 16) {
      unsigned b[4];
      load_b_rows<D>(b, b_rows, n, k);
      mma(acc[n / 8], a, b[0], b[1]);
      mma(acc[n / 8 + 1], a, b[2], b[3]);
    }
  }
}
// acc[n] (16 x D) += P (16 x K, accumulator registers) x tile (K rows x D).
template <int D, int K>
__device__ __forceinline__ void regs_times_tile(float (&acc)[D / 8][4], const float (&p)[K / 8][4], const bf16x* t) {
#pragma unroll
  for (int k = 0; k < K; k += 16) {
    const unsigned a[4] = {pack_bf16(p[k / 8][0], p[k / 8][1]), pack_bf16(p[k / 8][2], p[k / 8][3]),
                           pack_bf16(p[k / 8 + 1][0], p[k / 8 + 1][1]), pack_bf16(p[k / 8 + 1][2], p[k / 8 + 1][3])};
#pragma unroll
    for (int n = 0; n < D; n += 16) {
      unsigned b[4];
      load_b_cols<D>(b, t, k, n);
      mma(acc[n / 8], a, b[0], b[1]);
      mma(acc[n / 8 + 1], a, b[2], b[3]);
    }
  }
}

inline constexpr float log2e = 1.4426950408889634f;

// One attention problem (see the top of the file). Row t of sequence b: q + (b T + t) ldq +
// h D for query head h, k (v) + (b T + t) ldkv + j D for key/value head j.
struct Operands {
  const bf16x *q, *k, *v;
  std::size_t ldq, ldkv;
  int T, NH, NKV;
  bool causal;
  float scale;  // 1 / sqrt(D)
  __device__ std::size_t row(int b, int t) const { return static_cast<std::size_t>(b) * T + t; }
};

// Rows r0 + g and r0 + g + 8 of a warp's 16 x D accumulator into dst (row stride ld, rows
// past T skipped), times mul[0] / mul[1]: stored as bf16; or into float as
// dst = dst keep + acc mul (keep 0: dst is not read).
template <int D, class Out>
__device__ __forceinline__ void put_rows(Out* dst, std::size_t ld, const float (&acc)[D / 8][4], int r0, int T,
                                         const float (&mul)[2], const float (&keep)[2]) {
  const int lane = static_cast<int>(threadIdx.x) % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = r0 + g + 8 * half;
    if (t >= T) continue;
    Out* row = dst + static_cast<std::size_t>(t) * ld;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const float x = acc[n][2 * half] * mul[half], y = acc[n][2 * half + 1] * mul[half];
      if constexpr (std::is_same_v<Out, float>) {
        float2* p = reinterpret_cast<float2*>(row + 8 * n + 2 * c);
        if (keep[half] == 0.0f) {
          *p = make_float2(x, y);
        } else {
          const float2 old = *p;
          *p = make_float2(old.x * keep[half] + x, old.y * keep[half] + y);
        }
      } else {
        *reinterpret_cast<unsigned*>(row + 8 * n + 2 * c) = pack_bf16(x, y);
      }
    }
  }
}

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
  const float sl2 = a.scale * log2e;  // scores in log2 units

  auto stage = [&](int s) { return sKV + s * 2 * tile * stride<D>; };
  auto load_kv = [&](int kt) {
    bf16x* st = stage(kt % 2);
    load_rows<D, tile>(st, k, a.ldkv, kt * tile, T);
    load_rows<D, tile>(st + tile * stride<D>, v, a.ldkv, kt * tile, T);
  };
  load_rows<D, tile>(sQ, a.q + a.row(b, 0) * a.ldq + static_cast<std::size_t>(h) * D, a.ldq, q0, T);
  float acc[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const bf16x* my_q = sQ + warp * 16 * stride<D>;
  pipelined(last + 1, load_kv, [&](int kt) {
    const bf16x* sK = stage(kt % 2);
    const bf16x* sV = sK + tile * stride<D>;
    float s[tile / 8][4] = {};
    rows_times_rows<D, tile>(s, my_q, sK);
    // the mask (the diagonal tile, keys past T), then the online softmax of rows g and g + 8
    const bool edge = (a.causal && kt == qt) || (kt + 1) * tile > T;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < tile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query = q0 + warp * 16 + g + 8 * (e / 2), key = kt * tile + 8 * n + 2 * c + e % 2;
        const bool seen = !edge || (key < T && (!a.causal || key <= query));
        s[n][e] = seen ? s[n][e] * sl2 : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
      }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r]);  // finite: every row sees key 0 in tile 0
      corr[r] = exp2f(m[r] - m_new);
      m[r] = m_new;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int n = 0; n < tile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - m[e / 2]);
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
    float lse_new = (m[r] + log2f(l[r])) / log2e;
    mul[r] = 1.0f / l[r];
    if constexpr (std::is_same_v<Out, float>) {
      if (!first && t < T) {
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

// Whether query `query` sees key `key`.
__device__ __forceinline__ bool sees(const Operands& a, int query, int key) {
  return query < a.T && key < a.T && (!a.causal || key <= query);
}

template <int D, class Out>
__global__ void __launch_bounds__(threads, D > 64 ? 1 : 3) backward_kv_kernel(Operands a, Gradients<Out> gr) {
  constexpr int BQ = step_rows<D>;
  constexpr int stage_elems = 2 * BQ * stride<D>;  // [Q | dO], then 2 x BQ floats
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  bf16x* sK = reinterpret_cast<bf16x*>(smem_bytes);
  bf16x* sV = sK + tile * stride<D>;
  bf16x* stages = sV + tile * stride<D>;
  float* stats = reinterpret_cast<float*>(stages + 2 * stage_elems);  // 2 stages of [lse | D]
  const int kt = static_cast<int>(blockIdx.x);  // tile 0 has the most work and starts first
  const int j = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z), T = a.T;
  const int group = a.NH / a.NKV;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const std::size_t kvh = static_cast<std::size_t>(j) * D;
  const int k0 = kt * tile;
  const float sl2 = a.scale * log2e;
  // The steps: every query head of the group, the query tiles of BQ that see these keys.
  const int first = a.causal ? k0 / BQ : 0, per_head = (T + BQ - 1) / BQ - first, steps = group * per_head;
  auto load_step = [&](int i) {
    const int h = j * group + i / per_head, t0 = (first + i % per_head) * BQ;
    bf16x* st = stages + (i % 2) * stage_elems;
    load_rows<D, BQ>(st, a.q + a.row(b, 0) * a.ldq + static_cast<std::size_t>(h) * D, a.ldq, t0, T);
    load_rows<D, BQ>(st + BQ * stride<D>, gr.dout + a.row(b, 0) * gr.lddo + static_cast<std::size_t>(h) * D, gr.lddo,
                     t0, T);
    const std::size_t row = (static_cast<std::size_t>(b) * a.NH + h) * T;
    float* ss = stats + (i % 2) * 2 * BQ;
    load_floats<BQ>(ss, gr.lse + row, t0, T);
    load_floats<BQ>(ss + BQ, gr.Dd + row, t0, T);
  };
  load_rows<D, tile>(sK, a.k + a.row(b, 0) * a.ldkv + kvh, a.ldkv, k0, T);
  load_rows<D, tile>(sV, a.v + a.row(b, 0) * a.ldkv + kvh, a.ldkv, k0, T);
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  const bf16x* my_k = sK + warp * 16 * stride<D>;
  const bf16x* my_v = sV + warp * 16 * stride<D>;
  pipelined(steps, load_step, [&](int i) {
    const bf16x* sQ = stages + (i % 2) * stage_elems;
    const bf16x* sO = sQ + BQ * stride<D>;
    const float* sL = stats + (i % 2) * 2 * BQ;
    const float* sD = sL + BQ;
    const int t0 = (first + i % per_head) * BQ;
    float s[BQ / 8][4] = {}, dp[BQ / 8][4] = {};
    rows_times_rows<D, BQ>(s, my_k, sQ);   // S^T: keys x queries
    rows_times_rows<D, BQ>(dp, my_v, sO);  // dP^T
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + warp * 16 + g + 8 * (e / 2), qi = 8 * n + 2 * c + e % 2;
        const float p = sees(a, t0 + qi, key) ? exp2f(s[n][e] * sl2 - sL[qi] * log2e) : 0.0f;
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
  const float sl2 = a.scale * log2e;
  const int keys = a.causal ? min(q0 + tile, T) : T, steps = (keys + BK - 1) / BK;  // the key steps these queries see
  auto load_step = [&](int i) {
    bf16x* st = stages + (i % 2) * stage_elems;
    load_rows<D, BK>(st, k, a.ldkv, i * BK, T);
    load_rows<D, BK>(st + BK * stride<D>, v, a.ldkv, i * BK, T);
  };
  load_rows<D, tile>(sQ, a.q + a.row(b, 0) * a.ldq + head, a.ldq, q0, T);
  load_rows<D, tile>(sO, gr.dout + a.row(b, 0) * gr.lddo + head, gr.lddo, q0, T);

  const std::size_t row = (static_cast<std::size_t>(b) * a.NH + h) * T;
  float rl[2], rd[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = q0 + warp * 16 + g + 8 * r;
    rl[r] = t < T ? gr.lse[row + t] * log2e : 0.0f;
    rd[r] = t < T ? gr.Dd[row + t] : 0.0f;
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
        const int query = q0 + warp * 16 + g + 8 * (e / 2), key = i * BK + 8 * n + 2 * c + e % 2;
        const float p = sees(a, query, key) ? exp2f(s[n][e] * sl2 - rl[e / 2]) : 0.0f;
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
    sizeof(bf16x) * (2 * tile + 4 * step_rows<D>) * stride<D> + sizeof(float) * 4 * step_rows<D>;
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
