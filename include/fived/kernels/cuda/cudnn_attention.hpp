#pragma once
// Causal attention through cuDNN's fused scaled-dot-product attention (cudnn-frontend
// graphs), for bf16: the contract of attention_forward / attention_backward in
// attention.hpp, so Ops<bf16, Cuda> calls one or the other.
//
//   CudnnAttention att(stream);
//   att.forward(out, lse, qkv, B, T, C, NH, NKV);                 // lse: float [B,NH,T]
//   att.backward(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV);    // dqkv overwritten
//
// Q, K and V are read where the QKV GEMM left them, as strided views of the [B,T,C+2Ckv]
// buffer (no transposes; grouped key/value heads are cuDNN's own GQA), and dQ, dK, dV are
// written into the same layout. The statistics cuDNN returns are fived's log-sum-exp (the
// natural log of sum_j exp(q.k_j/sqrt(hs)), float), so the backward, recomputation and
// the context-parallel merges read them as they read fived's own kernel's.
//
// A graph is built once per shape (on the first call; cuDNN compiles its kernel then) and
// kept with its workspace; later calls only execute it. The backward asks for cuDNN's
// deterministic algorithm, so runs repeat bit for bit as with fived's kernel.
//
// Present when FIVED_WITH_CUDNN is defined (CMake defines it when it finds cudnn.h,
// libcudnn and the cudnn-frontend headers: cmake/FindCUDNN.cmake); otherwise Ops runs
// fived's own kernel.

#if defined(FIVED_WITH_CUDNN)

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include <fived/device/bf16.hpp>
#include <fived/device/cuda.hpp>
#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace cudnn_detail {

namespace fe = cudnn_frontend;

inline void check(cudnnStatus_t s, const char* call) {
  if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error(std::string(call) + " failed: " + cudnnGetErrorString(s));
}

inline void check(fe::error_t e, const char* what) {
  if (e.is_bad()) throw std::runtime_error(std::string("cuDNN attention: ") + what + ": " + e.get_message());
}

struct HandleDeleter {
  void operator()(cudnnContext* h) const noexcept { (void)cudnnDestroy(h); }
};
struct DeviceDeleter {
  void operator()(void* p) const noexcept { (void)cudaFree(p); }
};

enum Uid : std::int64_t { q_uid = 1, k_uid, v_uid, o_uid, stats_uid, do_uid, dq_uid, dk_uid, dv_uid };

// The shape a graph is built for.
struct Shape {
  int B, T, C, NH, NKV;
  bool backward;
  auto tie() const { return std::tie(B, T, C, NH, NKV, backward); }
  bool operator<(const Shape& o) const { return tie() < o.tie(); }
  std::int64_t hs() const { return C / NH; }
  std::int64_t row() const { return C + 2 * std::int64_t{NKV} * hs(); }  // q|k|v row length
};

// [B, heads, T, hs] views of rows `row` elements long (q, k, v, dq, dk, dv in q|k|v; o, do in
// [B,T,C]), and the statistics, [B, NH, T, 1] contiguous float.
inline fe::graph::Tensor_attributes& rows_layout(fe::graph::Tensor_attributes& t, Uid uid, const Shape& s,
                                                 std::int64_t heads, std::int64_t row) {
  return t.set_uid(uid).set_dim({s.B, heads, s.T, s.hs()}).set_stride({s.T * row, s.hs(), row, 1});
}
inline std::shared_ptr<fe::graph::Tensor_attributes> rows_view(fe::graph::Graph& g, const char* name, Uid uid,
                                                               const Shape& s, std::int64_t heads, std::int64_t row) {
  fe::graph::Tensor_attributes t;
  return g.tensor(rows_layout(t.set_name(name), uid, s, heads, row));
}
inline fe::graph::Tensor_attributes& stats_layout(fe::graph::Tensor_attributes& t, const Shape& s) {
  return t.set_uid(stats_uid).set_data_type(fe::DataType_t::FLOAT).set_dim({s.B, s.NH, s.T, 1}).set_stride(
      {std::int64_t{s.NH} * s.T, s.T, 1, 1});
}

// The forward graph: O and the log-sum-exp statistics from strided Q, K, V.
inline void describe_forward(fe::graph::Graph& g, const Shape& s) {
  const std::int64_t row = s.row();
  auto q = rows_view(g, "q", q_uid, s, s.NH, row);
  auto k = rows_view(g, "k", k_uid, s, s.NKV, row);
  auto v = rows_view(g, "v", v_uid, s, s.NKV, row);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("fived_attention")
                     .set_generate_stats(true)
                     .set_causal_mask(true)
                     .set_attn_scale(1.0f / std::sqrt(static_cast<float>(s.hs())));
  auto [o, stats] = g.sdpa(q, k, v, options);
  rows_layout(*o, o_uid, s, s.NH, s.C).set_output(true);
  stats_layout(*stats, s).set_output(true);
}

// The backward graph: dQ, dK, dV (summed over each key/value head's query heads) from
// Q, K, V, O, dO and the statistics.
inline void describe_backward(fe::graph::Graph& g, const Shape& s, bool deterministic) {
  const std::int64_t row = s.row();
  auto q = rows_view(g, "q", q_uid, s, s.NH, row);
  auto k = rows_view(g, "k", k_uid, s, s.NKV, row);
  auto v = rows_view(g, "v", v_uid, s, s.NKV, row);
  auto o = rows_view(g, "o", o_uid, s, s.NH, s.C);
  auto dout = rows_view(g, "do", do_uid, s, s.NH, s.C);
  fe::graph::Tensor_attributes stats_in;
  auto stats = g.tensor(stats_layout(stats_in.set_name("stats"), s));
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("fived_attention_backward")
                     .set_causal_mask(true)
                     .set_deterministic_algorithm(deterministic)
                     .set_attn_scale(1.0f / std::sqrt(static_cast<float>(s.hs())));
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, options);
  rows_layout(*dq, dq_uid, s, s.NH, row).set_output(true);
  rows_layout(*dk, dk_uid, s, s.NKV, row).set_output(true);
  rows_layout(*dv, dv_uid, s, s.NKV, row).set_output(true);
}

}  // namespace cudnn_detail

class CudnnAttention {
 public:
  // The GPU is asked once, here (the stream's device): no runtime call per attention.
  explicit CudnnAttention(cudaStream_t stream = nullptr) : stream_(stream), device_ok_(device_supported()) {}

  // Whether cuDNN runs this shape here: a head size that is a multiple of 8 and at most 128,
  // on an Ampere or newer GPU. Ops runs fived's own kernel elsewhere.
  bool takes(int C, int NH, int NKV) const { return device_ok_ && shape_supported(C, NH, NKV); }
  static bool shape_supported(int C, int NH, int NKV) {
    return NH > 0 && NKV > 0 && C % NH == 0 && NH % NKV == 0 && (C / NH) % 8 == 0 && C / NH <= 128;
  }

  void forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int NKV) {
    using namespace cudnn_detail;
    const Shape s{B, T, C, NH, NKV, false};
    const auto [q, k, v] = parts(s, qkv);
    std::unordered_map<std::int64_t, void*> pack{{q_uid, q}, {k_uid, k}, {v_uid, v}, {o_uid, out}, {stats_uid, lse}};
    execute(plan(s), pack);
  }

  void backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B, int T, int C,
                int NH, int NKV) {
    using namespace cudnn_detail;
    const Shape s{B, T, C, NH, NKV, true};
    const auto [q, k, v] = parts(s, qkv);
    const auto [dq, dk, dv] = parts(s, dqkv);
    std::unordered_map<std::int64_t, void*> pack{
        {q_uid, q},   {k_uid, k},   {v_uid, v},   {o_uid, const_cast<bf16*>(out)}, {stats_uid, const_cast<float*>(lse)},
        {dq_uid, dq}, {dk_uid, dk}, {dv_uid, dv}, {do_uid, const_cast<bf16*>(dout)}};
    execute(plan(s), pack);
  }

  // Whether the backward graphs built so far run cuDNN's deterministic algorithm (false
  // where this cuDNN has none for the shape and the default one runs instead).
  bool deterministic() const noexcept { return deterministic_; }

 private:
  // Where q, k and v (or their gradients) start in a [B,T,C+2Ckv] q|k|v buffer.
  static std::array<void*, 3> parts(const cudnn_detail::Shape& s, const bf16* qkv) {
    bf16* q = const_cast<bf16*>(qkv);
    const std::int64_t kv = std::int64_t{s.NKV} * s.hs();
    return {q, q + s.C, q + s.C + kv};
  }
  static bool device_supported() { return detail::device_is_sm80_or_later(); }

  struct Plan {
    std::unique_ptr<cudnn_frontend::graph::Graph> graph;
    std::unique_ptr<void, cudnn_detail::DeviceDeleter> workspace;
  };

  cudnnHandle_t handle() {
    if (!handle_) {
      cudnnHandle_t h = nullptr;
      cudnn_detail::check(cudnnCreate(&h), "cudnnCreate");
      handle_.reset(h);
      cudnn_detail::check(cudnnSetStream(h, stream_), "cudnnSetStream");
    }
    return handle_.get();
  }

  // Builds (once per shape) the graph and its workspace.
  const Plan& plan(const cudnn_detail::Shape& s) {
    namespace fe = cudnn_frontend;
    if (auto it = plans_.find(s); it != plans_.end()) return it->second;
    auto build = [&](bool deterministic) {
      auto g = std::make_unique<fe::graph::Graph>();
      g->set_io_data_type(fe::DataType_t::BFLOAT16)
          .set_intermediate_data_type(fe::DataType_t::FLOAT)
          .set_compute_data_type(fe::DataType_t::FLOAT);
      if (s.backward)
        cudnn_detail::describe_backward(*g, s, deterministic);
      else
        cudnn_detail::describe_forward(*g, s);
      const fe::error_t e = g->build(handle(), {fe::HeurMode_t::A});
      return std::make_pair(std::move(g), e);
    };
    auto [graph, error] = build(true);
    if (error.is_bad() && s.backward) {  // no deterministic kernel for this shape here
      std::tie(graph, error) = build(false);
      if (!error.is_bad()) deterministic_ = false;
    }
    cudnn_detail::check(error, s.backward ? "building the backward graph" : "building the forward graph");
    std::int64_t bytes = 0;
    cudnn_detail::check(graph->get_workspace_size(bytes), "workspace size");
    void* ws = nullptr;
    if (bytes > 0) ::fived::cuda::check(cudaMalloc(&ws, static_cast<std::size_t>(bytes)), "cudaMalloc(workspace)",
                                        __FILE__, __LINE__);
    Plan p{std::move(graph), std::unique_ptr<void, cudnn_detail::DeviceDeleter>(ws)};
    return plans_.emplace(s, std::move(p)).first->second;
  }

  void execute(const Plan& p, std::unordered_map<std::int64_t, void*>& pack) {
    cudnn_detail::check(p.graph->execute(handle(), pack, p.workspace.get()), "execute");
  }

  cudaStream_t stream_;
  bool device_ok_;
  std::unique_ptr<cudnnContext, cudnn_detail::HandleDeleter> handle_;
  std::map<cudnn_detail::Shape, Plan> plans_;
  bool deterministic_ = true;
};

}  // namespace fived::kernels::cuda

#endif  // FIVED_WITH_CUDNN
