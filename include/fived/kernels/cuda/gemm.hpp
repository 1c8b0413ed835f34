#pragma once
// GEMM through cuBLASLt, in the row-major contract of fived/kernels/host/gemm.hpp:
//
//   CublasLt lt(stream);                       // handle + 32 MiB workspace + stream
//   matmul(lt, out, a, b, bias, M, N, K, trans_a, trans_b, accumulate, ep, pre_act);
//     out[M,N] (= or +=) op(a)[M,K] * op(b)[K,N] (+ bias[N] on every row)
//     op(a): a is [M,K], or [K,M] stored when trans_a; op(b): b is [K,N], or [N,K] when trans_b.
//     Epilogue::gelu: pre_act[M,N] = product + bias (required), out = gelu(pre_act).
//   matmul_dgelu(lt, out, a, b, pre_act, M, N, K, trans_a, trans_b);
//     out[M,N] = gelu'(pre_act) * op(a) op(b): a GELU's backward in the GEMM that gives its
//     output's gradient (cuBLASLt's DGELU epilogue, pre_act as its aux input).
//   bias_backward(stream or lt, dbias, dout, M, N);   // dbias[N] += column sums of dout[M,N]
//   matmul_weight_grad(lt, dw, db, dy, x, rows, in, out, transposed);
//     a linear layer's dW and db "+=", db summed by the GEMM's BGRADA/BGRADB epilogue.
//   Each takes a strided batch last (Batch, WeightGradBatch: `count` products of one shape,
//   padded experts'), run as one cuBLASLt call (its layouts' BATCH_COUNT and
//   STRIDED_BATCH_OFFSET, the bias's and aux matrix's batch strides); where cuBLASLt has no
//   batched algorithm for an epilogue, the products one at a time, each as the plain call.
//
// Row-major X is column-major X^T, so out^T = op(b)^T op(a)^T is computed with
// cuBLASLt's A = b and B = a (no copies). Element types float and bf16, fp32
// compute (CUBLAS_COMPUTE_32F; TF32 only when lt.allow_tf32 is set). Bias and
// GELU go through cuBLASLt epilogues (BIAS, GELU_AUX, GELU_AUX_BIAS, DGELU; the GELU
// epilogue needs pre_act, as on the host); when cuBLASLt has no algorithm for an epilogue (alignment,
// leading dimension of the aux matrix) the product is computed alone and a
// separate kernel applies bias and GELU (or GELU's backward): same result, one more pass.
// Algorithms chosen by the heuristic are cached per shape in the CublasLt object.

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/cuda/gelu.hpp>
#include <fived/kernels/host/gemm.hpp>

namespace fived::kernels::cuda {

// One enum for both backends (the model code names it once).
using ::fived::kernels::host::Epilogue;
using ::fived::kernels::host::Batch;
using ::fived::kernels::host::WeightGradBatch;

namespace detail {

inline void cublas_check(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call +
                           " failed: " + cublasLtGetStatusName(s) + ": " + cublasLtGetStatusString(s));
}

}  // namespace detail

#define FIVED_CUBLAS_CHECK(call) ::fived::kernels::cuda::detail::cublas_check((call), #call, __FILE__, __LINE__)

// cuBLASLt handle, workspace (device memory, 32 MiB by default: what Hopper's
// fastest kernels ask for) and the stream the GEMMs run on. Move-only.
class CublasLt {
 public:
  explicit CublasLt(cudaStream_t stream = nullptr, std::size_t workspace_bytes = std::size_t{32} << 20)
      : stream_(stream), workspace_bytes_(workspace_bytes) {
    FIVED_CUBLAS_CHECK(cublasLtCreate(&handle_));
    if (workspace_bytes_ != 0) {
      const cudaError_t e = cudaMalloc(&workspace_, workspace_bytes_);
      if (e != cudaSuccess) {
        (void)cublasLtDestroy(handle_);
        ::fived::cuda::check(e, "cudaMalloc(&workspace_, workspace_bytes_)", __FILE__, __LINE__);
      }
    }
  }
  CublasLt(CublasLt&& o) noexcept
      : handle_(std::exchange(o.handle_, nullptr)),
        workspace_(std::exchange(o.workspace_, nullptr)),
        stream_(o.stream_),
        workspace_bytes_(std::exchange(o.workspace_bytes_, 0)),
        allow_tf32(o.allow_tf32),
        algos_(std::move(o.algos_)) {}
  CublasLt& operator=(CublasLt&& o) noexcept {
    if (this != &o) {
      release();
      handle_ = std::exchange(o.handle_, nullptr);
      workspace_ = std::exchange(o.workspace_, nullptr);
      stream_ = o.stream_;
      workspace_bytes_ = std::exchange(o.workspace_bytes_, 0);
      allow_tf32 = o.allow_tf32;
      algos_ = std::move(o.algos_);
    }
    return *this;
  }
  CublasLt(const CublasLt&) = delete;
  CublasLt& operator=(const CublasLt&) = delete;
  ~CublasLt() { release(); }

  cublasLtHandle_t handle() const noexcept { return handle_; }
  void* workspace() const noexcept { return workspace_; }
  std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }
  cudaStream_t stream() const noexcept { return stream_; }
  void set_stream(cudaStream_t s) noexcept { stream_ = s; }

  // fp32 GEMMs use TF32 tensor cores when true (faster, ~1e-3 relative error).
  bool allow_tf32 = false;

  // Heuristic results, keyed by everything the choice depends on. An entry
  // with ok == false records that no algorithm exists for that configuration.
  struct AlgoKey {
    int dtype, compute, epilogue, m, n, k, ta, tb, align_a, align_b, align_c, align_bias, align_aux;
    std::int64_t count = 1, stride_a = 0, stride_b = 0, stride_c = 0, stride_bias = 0, stride_aux = 0;  // a batch
    auto tie() const {
      return std::tie(dtype, compute, epilogue, m, n, k, ta, tb, align_a, align_b, align_c, align_bias, align_aux, count,
                      stride_a, stride_b, stride_c, stride_bias, stride_aux);
    }
    bool operator<(const AlgoKey& o) const { return tie() < o.tie(); }
  };
  struct AlgoEntry {
    bool ok = false;
    cublasLtMatmulAlgo_t algo{};
  };
  std::map<AlgoKey, AlgoEntry>& algo_cache() noexcept { return algos_; }

 private:
  void release() noexcept {
    if (workspace_ != nullptr) (void)cudaFree(workspace_);
    if (handle_ != nullptr) (void)cublasLtDestroy(handle_);
    workspace_ = nullptr;
    handle_ = nullptr;
  }

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  std::map<AlgoKey, AlgoEntry> algos_;
};

namespace detail {

struct MatmulDescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const noexcept { (void)cublasLtMatmulDescDestroy(d); }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayoutOpaque_t* d) const noexcept { (void)cublasLtMatrixLayoutDestroy(d); }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* d) const noexcept { (void)cublasLtMatmulPreferenceDestroy(d); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, MatmulDescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter>;

// A column-major [rows, cols] matrix, `count` of them `stride` elements apart.
inline Layout make_layout(cudaDataType_t type, std::uint64_t rows, std::uint64_t cols, std::int64_t ld,
                          std::int64_t count = 1, std::int64_t stride = 0) {
  cublasLtMatrixLayout_t l = nullptr;
  FIVED_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
  Layout layout(l);
  if (count > 1) {
    const std::int32_t n = static_cast<std::int32_t>(count);
    FIVED_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n)));
    FIVED_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return layout;
}

// Largest power of two (up to 256) dividing the address, and in a batch the stride's bytes
// too (every product's operand must have it): cuBLASLt's heuristic must not pick a kernel
// that assumes more alignment than the pointers have.
inline std::uint32_t alignment_of(const void* p, std::int64_t stride_bytes = 0) {
  const auto a = reinterpret_cast<std::uintptr_t>(p) | static_cast<std::uintptr_t>(stride_bytes);
  std::uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

template <class T>
__global__ void bias_gelu_kernel(T* out, const T* bias, T* pre_act, int M, int N, bool gelu) {
  const std::size_t n = static_cast<std::size_t>(M) * N;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float x = to_float(out[i]);
    if (bias != nullptr) x += to_float(bias[i % static_cast<std::size_t>(N)]);
    if (gelu) {
      if (pre_act != nullptr) pre_act[i] = from_float<T>(x);
      x = gelu_f(x);
    }
    out[i] = from_float<T>(x);
  }
}

// dbias[p·stride + j] += sums[p·n + j] for the count products p of a batch: the float sums a
// bias-gradient epilogue wrote.
template <class T>
__global__ void add_sums_kernel(T* dbias, const float* sums, int n, std::int64_t count, std::int64_t stride) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count * n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    T* d = dbias + i / n * stride + i % n;
    *d = from_float<T>(to_float(*d) + sums[i]);
  }
}

// dbias[c] += s.x
template <class T>
struct AddColumnSum {
  T* dbias;
  __device__ void operator()(int c, float2 s) const { dbias[c] = from_float<T>(to_float(dbias[c]) + s.x); }
};
template <class T>
struct ReadMatrix {
  const T* m;
  int N;
  __device__ float2 operator()(int r, int c) const {
    return make_float2(to_float(m[static_cast<std::size_t>(r) * N + c]), 0.0f);
  }
  template <int W>
  __device__ void at(int r, int c, float2 (&v)[W]) const {
    float x[W];
    load_elems<W>(x, m + static_cast<std::size_t>(r) * N + c);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = make_float2(x[k], 0.0f);
  }
};

// One cuBLASLt matmul out = op(a) op(b) with epilogue e (its bias, its aux matrix aux[M,N]
// where it has one, or for BGRADA / BGRADB the float vector bias_grad it writes: the sums over
// K of our b (cuBLASLt's A, [N]) or of our a (its B, [M])), over a strided batch (batch.bias
// also the bias gradient's stride, batch.pre_act the aux matrix's), the algorithm cached per
// shape: false when cuBLASLt has none for this epilogue (a plain product always has one, or
// this throws).
template <class T>
bool lt_matmul(CublasLt& lt, T* out, const T* a, const T* b, const std::type_identity_t<T>* bias,
               const std::type_identity_t<T>* aux, int M, int N, int K, bool trans_a, bool trans_b, bool accumulate,
               cublasLtEpilogue_t e, float* bias_grad = nullptr, const Batch& batch = {}) {
  constexpr cudaDataType_t dtype = std::is_same_v<T, float> ? CUDA_R_32F : CUDA_R_16BF;
  const cublasComputeType_t compute =
      (std::is_same_v<T, float> && lt.allow_tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const cublasOperation_t op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our b
  const cublasOperation_t op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B is our a
  // Column-major shapes: D is [N, M] (ld N); A = b is [N,K] or stored [K,N]; B = a is [K,M] or stored [M,K].
  const std::int64_t count = batch.count;
  const Layout la = op_a == CUBLAS_OP_N ? make_layout(dtype, N, K, N, count, batch.b)
                                        : make_layout(dtype, K, N, K, count, batch.b);
  const Layout lb = op_b == CUBLAS_OP_N ? make_layout(dtype, K, M, K, count, batch.a)
                                        : make_layout(dtype, M, K, M, count, batch.a);
  const Layout lc = make_layout(dtype, N, M, N, count, batch.out);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;

  cublasLtMatmulDesc_t raw = nullptr;
  FIVED_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw, compute, CUDA_R_32F));
  const MatmulDesc desc(raw);
  FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
  const bool has_bias = e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
                        e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  const bool has_aux = e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
                       e == CUBLASLT_EPILOGUE_DGELU;
  const bool grads_bias = e == CUBLASLT_EPILOGUE_BGRADA || e == CUBLASLT_EPILOGUE_BGRADB;
  // cuBLASLt's heuristic sees the first product's bias and aux matrix only: a batch whose
  // strides would leave a later product's less aligned (16 bytes) runs one product at a time.
  if (count > 1) {
    const std::size_t bias_bytes = grads_bias ? sizeof(float) : sizeof(T);
    if ((has_bias || grads_bias) && batch.bias * static_cast<std::int64_t>(bias_bytes) % 16 != 0) return false;
    if (has_aux && batch.pre_act * static_cast<std::int64_t>(sizeof(T)) % 16 != 0) return false;
  }
  if (has_bias) {
    const void* bp = bias;
    FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
  }
  if ((has_bias || grads_bias) && count > 1)
    FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &batch.bias,
                                                      sizeof(batch.bias)));
  if (grads_bias) {  // in float, whatever T: the caller adds it to the gradient it accumulates
    void* bp = bias_grad;
    const cudaDataType_t bt = CUDA_R_32F;
    FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
    FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  if (has_aux) {
    // One attribute for both directions: GELU_AUX writes the matrix, DGELU reads it.
    void* ap = const_cast<T*>(aux);
    const std::int64_t ld = N;
    FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ap, sizeof(ap)));
    FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    if (count > 1)
      FIVED_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(raw, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE,
                                                        &batch.pre_act, sizeof(batch.pre_act)));
  }

  const auto bytes = [count](std::int64_t stride, std::size_t element) {
    return count > 1 ? stride * static_cast<std::int64_t>(element) : std::int64_t{0};
  };
  const std::uint32_t al_a = alignment_of(b, bytes(batch.b, sizeof(T))), al_b = alignment_of(a, bytes(batch.a, sizeof(T)));
  const std::uint32_t al_c = alignment_of(out, bytes(batch.out, sizeof(T)));
  const CublasLt::AlgoKey key{static_cast<int>(dtype), static_cast<int>(compute), static_cast<int>(e), M, N, K,
                              trans_a ? 1 : 0, trans_b ? 1 : 0, static_cast<int>(al_a), static_cast<int>(al_b),
                              static_cast<int>(al_c),
                              has_bias     ? static_cast<int>(alignment_of(bias, bytes(batch.bias, sizeof(T))))
                              : grads_bias ? static_cast<int>(alignment_of(bias_grad, bytes(batch.bias, sizeof(float))))
                                           : 0,
                              has_aux ? static_cast<int>(alignment_of(aux, bytes(batch.pre_act, sizeof(T)))) : 0,
                              count,
                              count > 1 ? batch.a : 0,
                              count > 1 ? batch.b : 0,
                              count > 1 ? batch.out : 0,
                              count > 1 && (has_bias || grads_bias) ? batch.bias : 0,
                              count > 1 && has_aux ? batch.pre_act : 0};
  auto& cache = lt.algo_cache();
  auto it = cache.find(key);
  if (it == cache.end()) {
    CublasLt::AlgoEntry entry;
    // An aux matrix whose leading dimension (or batch stride) is not a multiple of 8 is not
    // supported by the epilogues.
    if (!has_aux || (N % 8 == 0 && (count == 1 || batch.pre_act % 8 == 0))) {
      cublasLtMatmulPreference_t praw = nullptr;
      FIVED_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&praw));
      const Preference pref(praw);
      const std::size_t ws = lt.workspace_bytes();
      FIVED_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(praw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
      FIVED_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(praw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
      FIVED_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(praw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
      FIVED_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(praw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
      FIVED_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(praw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt.handle(), raw, la.get(), lb.get(), lc.get(), lc.get(),
                                                               praw, 1, &result, &found);
      if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
        entry.ok = true;
        entry.algo = result.algo;
      } else if (e == CUBLASLT_EPILOGUE_DEFAULT && count == 1) {
        FIVED_CUBLAS_CHECK(st);  // a plain GEMM must have an algorithm (a batch runs one at a time without)
        bad_argument("matmul", "cuBLASLt found no algorithm for M=" + std::to_string(M) + " N=" + std::to_string(N) +
                                   " K=" + std::to_string(K));
      }
    }
    it = cache.emplace(key, entry).first;
  }
  if (!it->second.ok) return false;
  FIVED_CUBLAS_CHECK(cublasLtMatmul(lt.handle(), raw, &alpha, b, la.get(), a, lb.get(), &beta, out, lc.get(), out,
                                    lc.get(), &it->second.algo, lt.workspace(), lt.workspace_bytes(), lt.stream()));
  return true;
}

inline void check_sizes(const char* fn, int M, int N, int K, std::int64_t count = 1) {
  require_non_negative(fn, "M", M);
  require_non_negative(fn, "N", N);
  require_non_negative(fn, "K", K);
  require(count >= 1, fn, "a batch holds at least one product (count=" + std::to_string(count) + ")");
}

// Product i's operand in a batch: p advanced by i strides, a null pointer left null.
using ::fived::kernels::host::detail_gemm::nth;

// cuBLASLt's epilogue for a forward product with these operands.
inline cublasLtEpilogue_t forward_epilogue(Epilogue ep, bool bias, bool pre_act) {
  if (ep == Epilogue::gelu) {
    if (bias) return pre_act ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS;
    return pre_act ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_GELU;
  }
  return bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

}  // namespace detail

template <class T>
void matmul(CublasLt& lt, T* out, const T* a, const T* b, const std::type_identity_t<T>* bias, int M, int N, int K,
            bool trans_a, bool trans_b, bool accumulate = false, Epilogue ep = Epilogue::none,
            std::type_identity_t<T>* pre_act = nullptr, Batch batch = {}) {
  static_assert(is_element_v<T>, "matmul: element type must be float or fived::bf16");
  detail::check_sizes("matmul", M, N, K, batch.count);
  detail::require(!(accumulate && ep == Epilogue::gelu), "matmul",
                  "the GELU epilogue cannot be combined with accumulate (+=)");
  detail::require(!(ep == Epilogue::gelu && pre_act == nullptr && M > 0 && N > 0), "matmul",
                  "the GELU epilogue needs pre_act[M,N] to store the pre-activation");
  if (M == 0 || N == 0) return;
  const cublasLtEpilogue_t epi = detail::forward_epilogue(ep, bias != nullptr, pre_act != nullptr);
  if (batch.count > 1) {  // one call, or else one product at a time
    if (K > 0 && detail::lt_matmul(lt, out, a, b, bias, pre_act, M, N, K, trans_a, trans_b, accumulate, epi, nullptr,
                                   batch))
      return;
    using detail::nth;
    for (std::int64_t i = 0; i < batch.count; ++i)
      matmul(lt, nth(out, batch.out, i), nth(a, batch.a, i), nth(b, batch.b, i), nth(bias, batch.bias, i), M, N, K,
             trans_a, trans_b, accumulate, ep, nth(pre_act, batch.pre_act, i));
    return;
  }
  const bool gelu = ep == Epilogue::gelu;
  const std::size_t n = static_cast<std::size_t>(M) * N;
  if (K == 0) {  // empty product: out = (out if accumulate, else 0) + bias, then GELU
    if (!accumulate) FIVED_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(T) * n, lt.stream()));
    if (bias != nullptr || gelu) {
      detail::bias_gelu_kernel<<<detail::grid_for(n, 256), 256, 0, lt.stream()>>>(dev(out), dev(bias), dev(pre_act),
                                                                                   M, N, gelu);
      FIVED_CUDA_CHECK_LAUNCH("bias_gelu_kernel");
    }
    return;
  }
  if (detail::lt_matmul(lt, out, a, b, bias, pre_act, M, N, K, trans_a, trans_b, accumulate, epi)) return;
  // Fallback: the plain product, then bias and GELU in one elementwise pass.
  detail::lt_matmul(lt, out, a, b, nullptr, nullptr, M, N, K, trans_a, trans_b, accumulate, CUBLASLT_EPILOGUE_DEFAULT);
  detail::bias_gelu_kernel<<<detail::grid_for(n, 256), 256, 0, lt.stream()>>>(dev(out), dev(bias), dev(pre_act), M,
                                                                               N, gelu);
  FIVED_CUDA_CHECK_LAUNCH("bias_gelu_kernel");
}

// out[M,N] = gelu'(pre_act) * op(a) op(b), the GELU's backward fused into the GEMM by
// cuBLASLt's DGELU epilogue (pre_act, the GELU's input the forward stored, read as its aux
// matrix): the product is never written and read back. Without an algorithm for it, the
// product and then gelu_backward, as the host does.
template <class T>
void matmul_dgelu(CublasLt& lt, T* out, const T* a, const T* b, const std::type_identity_t<T>* pre_act, int M, int N,
                  int K, bool trans_a, bool trans_b, Batch batch = {}) {
  static_assert(is_element_v<T>, "matmul_dgelu: element type must be float or fived::bf16");
  detail::check_sizes("matmul_dgelu", M, N, K, batch.count);
  detail::require(!(pre_act == nullptr && M > 0 && N > 0), "matmul_dgelu", "needs pre_act[M,N], the GELU's input");
  if (M == 0 || N == 0) return;
  if (batch.count > 1) {  // one call, or else one product at a time
    if (K > 0 && detail::lt_matmul(lt, out, a, b, nullptr, pre_act, M, N, K, trans_a, trans_b, false,
                                   CUBLASLT_EPILOGUE_DGELU, nullptr, batch))
      return;
    using detail::nth;
    for (std::int64_t i = 0; i < batch.count; ++i)
      matmul_dgelu(lt, nth(out, batch.out, i), nth(a, batch.a, i), nth(b, batch.b, i), nth(pre_act, batch.pre_act, i),
                   M, N, K, trans_a, trans_b);
    return;
  }
  const std::size_t n = static_cast<std::size_t>(M) * N;
  if (K == 0) {  // an empty product: a zero gradient
    FIVED_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(T) * n, lt.stream()));
    return;
  }
  if (detail::lt_matmul(lt, out, a, b, nullptr, pre_act, M, N, K, trans_a, trans_b, false, CUBLASLT_EPILOGUE_DGELU))
    return;
  detail::lt_matmul(lt, out, a, b, nullptr, nullptr, M, N, K, trans_a, trans_b, false, CUBLASLT_EPILOGUE_DEFAULT);
  gelu_backward(lt.stream(), out, pre_act, out, n);
}

// dbias[N] += column sums of dout[M, N] (deterministic two-pass reduction, float accumulation).
template <class T>
void bias_backward(cudaStream_t stream, T* dbias, const T* dout, int M, int N) {
  static_assert(is_element_v<T>, "bias_backward: element type must be float or fived::bf16");
  detail::require_non_negative("bias_backward", "M", M);
  detail::require_non_negative("bias_backward", "N", N);
  if (M == 0 || N == 0) return;
  column_reduce<vec16<T>>(stream, detail::ReadMatrix<device_t<T>>{dev(dout), N},
                          detail::AddColumnSum<device_t<T>>{dev(dbias)}, M, N,
                          N % vec16<T> == 0 && detail::aligned16({dout}));
}
template <class T>
void bias_backward(CublasLt& lt, T* dbias, const T* dout, int M, int N) {
  bias_backward(lt.stream(), dbias, dout, M, N);
}

// A linear layer's weight half, the contract of kernels/host/gemm.hpp: dW += x^T dy (W [in,
// out]) or dy^T x (transposed: W [out, in]), db += the sum of dy's rows. The GEMM reads every
// row of dy, so cuBLASLt's bias-gradient epilogue sums them there (BGRADA where dy is its A,
// GPT-2's Conv1D; BGRADB where it is its B, torch.nn.Linear's) into a float scratch that is
// then added to db: db's own pass over dy (bias_backward) is gone. Where cuBLASLt has no
// algorithm for that epilogue, the plain GEMM and bias_backward. A batch is one call where
// cuBLASLt has a batched algorithm, else its products one at a time. Returns whether every
// product's bias was summed in its GEMM.
template <class T>
bool matmul_weight_grad(CublasLt& lt, T* dw, T* db, const T* dy, const T* x, int rows, int in, int out,
                        bool transposed, WeightGradBatch batch = {}) {
  static_assert(is_element_v<T>, "matmul_weight_grad: element type must be float or fived::bf16");
  detail::check_sizes("matmul_weight_grad", in, out, rows, batch.count);
  const T* none = nullptr;
  const std::int64_t count = batch.count;
  // cuBLASLt's operands: ours are (dy, x) transposed, (x, dy) not; the bias gradient's sums,
  // [out] a product, follow one another.
  const Batch gemm = transposed ? Batch{count, batch.dw, batch.dy, batch.x, out, 0}
                                : Batch{count, batch.dw, batch.x, batch.dy, out, 0};
  if (in > 0 && out > 0 && rows > 0) {
    if (db != nullptr) {
      const std::size_t n = static_cast<std::size_t>(count) * static_cast<std::size_t>(out);
      Scratch<float> sums(n, lt.stream());
      const bool fused = transposed ? detail::lt_matmul(lt, dw, dy, x, none, none, out, in, rows, true, false, true,
                                                        CUBLASLT_EPILOGUE_BGRADB, sums.get(), gemm)
                                    : detail::lt_matmul(lt, dw, x, dy, none, none, in, out, rows, true, false, true,
                                                        CUBLASLT_EPILOGUE_BGRADA, sums.get(), gemm);
      if (fused) {
        detail::add_sums_kernel<<<detail::grid_for(n, 256), 256, 0, lt.stream()>>>(dev(db), sums.get(), out, count,
                                                                                    batch.db);
        FIVED_CUDA_CHECK_LAUNCH("add_sums_kernel");
        return true;
      }
    } else if (count > 1) {
      const bool batched = transposed ? detail::lt_matmul(lt, dw, dy, x, none, none, out, in, rows, true, false, true,
                                                          CUBLASLT_EPILOGUE_DEFAULT, nullptr, gemm)
                                      : detail::lt_matmul(lt, dw, x, dy, none, none, in, out, rows, true, false, true,
                                                          CUBLASLT_EPILOGUE_DEFAULT, nullptr, gemm);
      if (batched) return false;
    }
  }
  if (count > 1) {  // one product at a time
    using detail::nth;
    bool fused = true;
    for (std::int64_t i = 0; i < count; ++i)
      fused = matmul_weight_grad(lt, nth(dw, batch.dw, i), nth(db, batch.db, i), nth(dy, batch.dy, i),
                                 nth(x, batch.x, i), rows, in, out, transposed) &&
              fused;
    return fused;
  }
  if (transposed) matmul(lt, dw, dy, x, none, out, in, rows, true, false, true);
  else matmul(lt, dw, x, dy, none, in, out, rows, true, false, true);
  if (db != nullptr) bias_backward(lt, db, dy, rows, out);
  return false;
}

}  // namespace fived::kernels::cuda
