#pragma once
// What fived's tensor-core attention kernels (kernels/cuda/flash_attention.hpp) are built
// from: the warp-level instructions (ldmatrix, mma.m16n8k16 in bf16 with fp32 accumulators,
// cp.async; sm_80 and later), a double-buffered loop over tiles, tiles of rows in shared
// memory and the matrix products on them, the problem the kernels see (Operands) and writing
// rows of results (bf16 rows, or float accumulators merged by log-sum-exp).

#include <cstddef>
#include <cstdint>

#include <fived/context/documents.hpp>
#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda::detail::flash {

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
  // "memory": the compiler sees no store to the shared memory the copies fill, so without it a
  // read after the wait could be moved above it (the flash kernels' __syncthreads after each
  // wait is a barrier too; the staged cross-entropy reads straight after its waits).
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
#endif
}

// The double-buffered loop of every kernel here: load(i) starts copying step i's tiles into
// buffer i % 2, one step ahead; body(i) runs once they have arrived, and buffer i % 2 is free
// again after it. Copies started before the call arrive with step 0's; with no steps (a block
// that sees nothing, packed documents) they are waited for, so none is in flight at exit.
template <class Load, class Body>
__device__ __forceinline__ void pipelined(int steps, Load&& load, Body&& body) {
  if (steps <= 0) {
    cp_async_commit();
    cp_async_wait<0>();
    return;
  }
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
// Starts copying floats (or other 4-byte words) [t0, t0 + rows) of a length-T row into
// `dst`; zero past T.
template <int rows, class W>
__device__ __forceinline__ void load_floats(W* dst, const W* src, int t0, int T) {
  static_assert(sizeof(W) == 4);
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

// One attention problem (see the top of the file). Row t of sequence b: q + (b T + t) ldq +
// h D for query head h, k (v) + (b T + t) ldkv + j D for key/value head j. Documents packed
// into the rows (context/documents.hpp): query row (b, t) sees key u only when
// docs.key_position + u >= docs.first[b T + t], a bound that never decreases along t.
struct Operands {
  const bf16x *q, *k, *v;
  std::size_t ldq, ldkv;
  int T, NH, NKV;
  bool causal;
  float scale;  // 1 / sqrt(D)
  DocumentMask docs{};
  __device__ std::size_t row(int b, int t) const { return static_cast<std::size_t>(b) * T + t; }
  // The first key query row (b, t < T) sees: 0 without documents, at most T.
  __device__ int first_key(int b, int t) const { return docs.first_key(row(b, t), T); }
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

}  // namespace fived::kernels::cuda::detail::flash
