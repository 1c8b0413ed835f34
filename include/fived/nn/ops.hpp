#pragma once
// Per-device kernel dispatch for the model: Ops<T, Device>.
//
// The model (nn/gpt.hpp) and its layers are written once against this interface: no layer
// calls a kernel directly; each device supplies
// a specialisation whose member functions forward to its kernels, plus the few things
// that differ per device (moving token ids in, reading the loss out, staging parameters
// through host memory for initialisation, save and load).
//
//   Ops<T, Host>   this header: kernels::host, no state. Statistics (LayerNorm mean/rstd,
//                  log-sum-exp, cross-entropy max/sum-exp/target) are acc_t<T>.
//   Ops<T, Cuda>   nn/cuda/ops.hpp (nvcc only): kernels::cuda on a stream it owns, with
//                  a CublasLt for the GEMMs. Statistics are float.
//
// The interface every specialisation provides (T* are pointers into Buffer<T, Device>):
//
//   using device = ...;  using value_type = T;  using stat_t = ...;
//   template <class U> using buffer = Buffer<U, Device>;
//   kernels (contract of /kernels, without the stream / handle argument):
//     matmul, matmul_dgelu (a GELU's backward fused into the GEMM before it),
//     matmul_weight_grad (a linear layer's dW and db, the bias summed in the GEMM), each
//     with an optional strided batch last (Batch, WeightGradBatch: padded experts' GEMMs),
//     layernorm_forward, layernorm_backward, rmsnorm_forward, rmsnorm_backward,
//     residual_layernorm_forward and residual_rmsnorm_forward (the residual add before a norm,
//     fused into it), gelu_backward, swiglu_forward, swiglu_backward, rotary_forward and
//     rotary_backward (rotary positions, in place, kernels/host/rotary.hpp),
//     residual_forward, attention_forward, attention_backward (grouped key/value heads; the
//     rows' documents, context/documents.hpp, when given their starts),
//     embedding_forward and embedding_backward (over a range of the vocabulary: a TP rank's
//     shard), logits_max,
//     crossentropy_partials, crossentropy_backward, crossentropy_fused (the three in one, for
//     an unsplit vocabulary), adamw_update_chunks (a range's tensors in chunks, each with its
//     weight decay, the gradients clipped as read, the factor computed there from the norm in
//     device memory: kernels/host/adamw.hpp), sum_of_squares_chunks (a gradient's squared norm
//     over chunks into a double of device memory) and add_scalar (one double added to
//     another: the norm's parts), gelu_forward, scale,
//     to_fp32 (fp32 master weights from the parameters), from_acc (stat_t -> T), add_acc
//     (stat_t += stat_t: ring attention's share of d[k | v]), scale_acc (stat_t = stat_t ·
//     factor: the balancing loss's gradient), and ring
//     attention's pieces attention_block_forward, attention_row_dot, attention_block_backward;
//     a mixture of experts' router_scores, router_topk, dispatch_plan (counts to host memory),
//     gather_rows, moe_combine(_backward), moe_dispatch_backward, router_backward,
//     router_score_sums, expert_bias_step (auxiliary-loss-free balancing's bias step)
//   regroup(U* out, const U* in, outer, n, block, Blocks::split | join)   any U; for redistribute
//   buffer<U> make_buffer(size_t n)                       n zeroed elements, ready for use
//   buffer<U> make_buffer(size_t n, releasable_pages)     the same, its pages given back a range
//       at a time: release_pages(std::span<U>) (reads as zeros on the host; unmapped on CUDA
//       once the stream has passed, device/cuda_pages.hpp), commit_pages(std::span<U>)
//       before the range is written again (nothing to do on the host, which maps on touch),
//       trim_pages() the released memory back to the system (waits for the device)
//   void zero(buffer<U>&), zero(U* p, size_t n)           elements to 0 (stream-ordered)
//   void copy(U* dst, const U* src, size_t n)             device to device (stream-ordered)
//   void copy_rows(U* dst, dst_ld, const U* src, src_ld, width, rows)   a strided 2-D copy
//   void upload_ids(buffer<int>& dst, const int* host, size_t n)   host ids -> dst[0, n)
//   void upload(U* dst, const U* host, size_t n)   a few host values into device memory
//   double mean_loss(const stat_t* max, const stat_t* sumexp, const stat_t* target, int N)
//       mean over i of log(sumexp[i]) + max[i] - target[i], summed in double (waits for
//       the device on CUDA)
//   begin_loss_sum(); add_loss_sum(max, sumexp, target, N) ...; double loss_sum()
//       the same sum over i, accumulated on the device in double without waiting; the
//       last call waits (a pipeline's last stage must not block between its actions)
//   void write_from_host(buffer<U>& b, F f)    f(std::span<U>) fills all of b in host memory
//   void read_to_host(const buffer<U>& b, F f) f(std::span<const U>) reads b in host memory
//   std::vector<U> to_host(std::span<const U> device_span)
//   void synchronize()                         waits for the device's queued work
//   bool use_step_graph; begin_graph_step(shape), launch_graph_step(), abandon_graph_step()
//       a step captured once as a graph and replayed after (nn/step_graph.hpp: GraphStep);
//       on the host the captured calls are kept and run in order at launch
//   bool in_graph_step(); queue(what, run, args); host_wait(what)
//       for work queued outside the Ops in a step (a group's collectives:
//       MeshComm::order_after): run, kept or checked as the Ops' own calls; a wait refused
//   void follow_graph(Ops& leader)             this Ops' calls belong to leader's graph steps
//       (a trainer's communication side)
//
// Scalars that cross this interface (the loss gradient 1/N, scale factors, AdamW's
// hyperparameters) are double, and each kernel rounds them once to the precision it
// computes in: a double model is exact to a double's precision, never to a float's.
//
// On the host the staging functions hand out the buffer itself (no copy), so the host
// model does exactly what it did before this layer existed.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <span>
#include <type_traits>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/device/buffer.hpp"
#include "fived/device/host_pages.hpp"
#include "fived/kernels/host.hpp"
#include "fived/nn/ops_kernels.hpp"
#include "fived/nn/step_graph.hpp"

namespace fived {

namespace ops_detail {
template <class>
inline constexpr bool always_false = false;
}  // namespace ops_detail

// Primary template: a device without a specialisation (or Cuda without its header).
template <class T, class Device>
struct Ops {
  static_assert(ops_detail::always_false<Device>,
                "fived::Ops<T, Device>: no kernels for this device here. For fived::Cuda, include "
                "<fived/nn/cuda/ops.hpp> (in a .cu file compiled by nvcc) before using GPT<Cfg, T, fived::Cuda>");
};

template <class T>
struct Ops<T, Host> {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>,
                "fived::Ops<T, Host>: the element type must be float, double or fived::bf16");

  using device = Host;
  using value_type = T;
  using stat_t = acc_t<T>;
  template <class U>
  using buffer = Buffer<U, Host>;
  using Epilogue = kernels::host::Epilogue;
  using Batch = kernels::host::Batch;
  using WeightGradBatch = kernels::host::WeightGradBatch;

  // ---- kernels ------------------------------------------------------------------------------

  // Every kernel the devices forward alike (nn/ops_kernels.hpp), then the rest. Each is
  // queued (below): run now, or kept by a step captured as a graph.
#define FIVED_HOST_KERNEL(name, parameters, arguments) \
  void name parameters { queue(#name, [=] { kernels::host::name arguments; }, [&] { return call_hash arguments; }); }
  FIVED_OPS_KERNELS(FIVED_HOST_KERNEL)
#undef FIVED_HOST_KERNEL

  // Each GEMM takes a strided batch last (kernels/host/gemm.hpp): padded experts' products.
  void matmul(T* out, const T* a, const T* b, const T* bias, int M, int N, int K, bool trans_a, bool trans_b,
              bool accumulate = false, Epilogue ep = Epilogue::none, T* pre_act = nullptr, Batch batch = {}) {
    queue("matmul",
          [=] { kernels::host::matmul(out, a, b, bias, M, N, K, trans_a, trans_b, accumulate, ep, pre_act, batch); },
          [&] { return call_hash(out, a, b, bias, M, N, K, trans_a, trans_b, accumulate, ep, pre_act, batch); });
  }
  // out = gelu'(pre_act) * op(a) op(b): the gradient at a GELU's input from the GEMM that
  // gives its output's (kernels/host/gemm.hpp).
  void matmul_dgelu(T* out, const T* a, const T* b, const T* pre_act, int M, int N, int K, bool trans_a, bool trans_b,
                    Batch batch = {}) {
    queue("matmul_dgelu", [=] { kernels::host::matmul_dgelu(out, a, b, pre_act, M, N, K, trans_a, trans_b, batch); },
          [&] { return call_hash(out, a, b, pre_act, M, N, K, trans_a, trans_b, batch); });
  }
  // A linear layer's weight half: dW += x^T dy (transposed: dy^T x), db += dy's row sums.
  void matmul_weight_grad(T* dw, T* db, const T* dy, const T* x, int rows, int in, int out, bool transposed,
                          WeightGradBatch batch = {}) {
    queue("matmul_weight_grad",
          [=] { kernels::host::matmul_weight_grad(dw, db, dy, x, rows, in, out, transposed, batch); },
          [&] { return call_hash(dw, db, dy, x, rows, in, out, transposed, batch); });
  }
  void attention_forward(T* out, stat_t* lse, const T* qkv, int B, int T_, int C, int NH, int NKV,
                         const int* doc_first = nullptr) {
    queue("attention_forward", [=] { kernels::host::attention_forward(out, lse, qkv, B, T_, C, NH, NKV, doc_first); },
          [&] { return call_hash(out, lse, qkv, B, T_, C, NH, NKV, doc_first); });
  }
  void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const stat_t* lse, int B, int T_, int C,
                          int NH, int NKV, const int* doc_first = nullptr) {
    queue("attention_backward",
          [=] { kernels::host::attention_backward(dqkv, dout, qkv, out, lse, B, T_, C, NH, NKV, doc_first); },
          [&] { return call_hash(dqkv, dout, qkv, out, lse, B, T_, C, NH, NKV, doc_first); });
  }
  template <class U>
  void regroup(U* out, const U* in, std::int64_t outer, int n, std::int64_t block, kernels::host::Blocks how) {
    queue("regroup", [=] { kernels::host::regroup(out, in, outer, n, block, how); },
          [&] { return call_hash(out, in, outer, n, block, how); });
  }

  // A mixture of experts' plan (kernels/host/moe.hpp): the kept rows per expert in loads
  // (device memory) and, when host_counts is given, in host memory too (on CUDA it waits for
  // them: dropless routing's all-to-all sizes are host values); padded rows need neither.
  void dispatch_plan(int* token_of, int* pos, stat_t* loads, int* host_counts, const int* expert, int N, int k, int E,
                     int capacity, bool padded) {
    if (host_counts != nullptr) {
      graph().no_wait("dispatch_plan");
      return kernels::host::dispatch_plan(token_of, pos, loads, host_counts, expert, N, k, E, capacity, padded);
    }
    queue("dispatch_plan",
          [=] { kernels::host::dispatch_plan(token_of, pos, loads, static_cast<int*>(nullptr), expert, N, k, E, capacity, padded); },
          [&] { return call_hash(token_of, pos, loads, expert, N, k, E, capacity, padded); });
  }

  // The loss of every row added since begin_loss_sum(), in double.
  void begin_loss_sum() {
    queue("begin_loss_sum", [this] { loss_sum_ = 0; }, [] { return call_hash(); });
  }
  void add_loss_sum(const stat_t* max, const stat_t* sumexp, const stat_t* target, int N) {
    queue("add_loss_sum", [=, this] { loss_sum_ += kernels::host::loss_sum(max, sumexp, target, N); },
          [&] { return call_hash(max, sumexp, target, N); });
  }
  double loss_sum() const {
    graph().no_wait("loss_sum");
    return loss_sum_;
  }

  // ---- memory and staging ----------------------------------------------------------------------

  template <class U>
  Buffer<U, Host> make_buffer(std::size_t n) {
    graph().no_wait("make_buffer");
    return Buffer<U, Host>(n);
  }
  template <class U>
  Buffer<U, Host> make_buffer(std::size_t n, ReleasablePages) {
    graph().no_wait("make_buffer");
    return Buffer<U, Host>(n);
  }
  template <class U>
  void release_pages(std::span<U> range) {
    graph().no_wait("release_pages");
    fived::release_pages(range);
  }
  template <class U>
  void commit_pages(std::span<U>) {}  // the system maps a released page again when it is written
  void trim_pages() {}                // released pages went back to the system at once
  template <class U>
  void zero(Buffer<U, Host>& b) {
    zero(b.data(), b.size());
  }
  template <class U>
  void zero(U* p, std::size_t n) {
    queue("zero", [=] { std::fill_n(p, n, U{}); }, [&] { return call_hash(p, n); });
  }
  template <class U>
  void copy(U* dst, const U* src, std::size_t n) {
    queue("copy", [=] { std::copy_n(src, n, dst); }, [&] { return call_hash(dst, src, n); });
  }
  template <class U>
  void copy_rows(U* dst, std::size_t dst_ld, const U* src, std::size_t src_ld, std::size_t width, std::size_t rows) {
    queue("copy_rows",
          [=] {
            for (std::size_t r = 0; r < rows; ++r) std::copy_n(src + r * src_ld, width, dst + r * dst_ld);
          },
          [&] { return call_hash(dst, dst_ld, src, src_ld, width, rows); });
  }
  void upload_ids(Buffer<int, Host>& dst, const int* host, std::size_t n) { upload(dst.data(), host, n); }
  // n values from host memory into the device's memory (complete on return; in a graph step,
  // when the graph runs, from the step's own copy of them).
  template <class U>
  void upload(U* dst, const U* host, std::size_t n) {
    if (n == 0) return;
    const std::size_t bytes = n * sizeof(U);
    if (graph().mode() == StepMode::plain) {
      graph().plain_upload(bytes);
      return void(std::copy_n(host, n, dst));
    }
    const void* from = graph().upload("upload", call_hash(dst, bytes), host, bytes);
    if (graph().mode() == StepMode::capturing) recorded().emplace_back([=] { std::memcpy(dst, from, bytes); });
  }
  // Mean cross-entropy from the loss statistics, summed in double.
  double mean_loss(const stat_t* max, const stat_t* sumexp, const stat_t* target, int N) const {
    graph().no_wait("mean_loss");
    return kernels::host::mean_loss(max, sumexp, target, N);
  }
  template <class U, class F>
  void write_from_host(Buffer<U, Host>& b, F&& f) {
    graph().no_wait("write_from_host");
    f(b.span());
  }
  template <class U, class F>
  void read_to_host(const Buffer<U, Host>& b, F&& f) const {
    graph().no_wait("read_to_host");
    f(b.span());
  }
  template <class U>
  std::vector<std::remove_const_t<U>> to_host(std::span<U> s) const {
    graph().no_wait("to_host");
    return {s.begin(), s.end()};
  }
  void synchronize() { graph().no_wait("synchronize"); }

  // ---- a step as a graph (nn/step_graph.hpp) ----------------------------------------------------

  // The host has no queue: a captured step's calls are kept, in order, and run at its launch.
  bool use_step_graph = false;
  void begin_graph_step(std::uint64_t shape) {
    if (!use_step_graph) return abandon_graph_step();
    if (graph().begin(shape) == StepMode::capturing) recorded().clear();
  }
  void launch_graph_step() {
    const StepMode mode = graph().mode();
    graph().end();
    if (mode == StepMode::plain) return;
    try {
      for (const auto& f : recorded()) f();
    } catch (...) {
      abandon_graph_step();
      throw;
    }
  }
  void abandon_graph_step() noexcept {
    graph().forget();
    recorded().clear();
  }
  StepMode step_mode() const { return graph().mode(); }
  bool in_graph_step() const { return graph().mode() != StepMode::plain; }
  bool step_graph_captured() const { return graph().captured(); }  // a graph to replay is kept
  // This Ops' calls belong to the graph steps of `leader` (a trainer's communication side,
  // whose tasks are part of the model's step): checked, kept and launched there.
  void follow_graph(Ops& leader) { leader_ = &leader; }

  // A call that changes the device's memory: run now in a plain step; kept (capturing) or
  // checked against the kept one (replaying) in a graph step. `args` hashes its arguments.
  // Work queued outside the Ops in a step (a communicator's collectives: MeshComm::order_after)
  // comes through here too.
  template <class Run, class Args>
  void queue(const char* what, Run&& run, Args&& args) {
    if (graph().mode() == StepMode::plain) return run();
    graph().call(what, args());
    if (graph().mode() == StepMode::capturing) recorded().emplace_back(std::forward<Run>(run));
  }
  // `what` is about to wait for the device (a collective that the host reads): refused in a
  // graph step.
  void host_wait(const char* what) const { graph().no_wait(what); }

 private:
  StepGraph<std::vector<std::byte>>& graph() { return leader_ ? leader_->graph_ : graph_; }
  const StepGraph<std::vector<std::byte>>& graph() const { return leader_ ? leader_->graph_ : graph_; }
  std::vector<std::function<void()>>& recorded() { return leader_ ? leader_->recorded_ : recorded_; }

  double loss_sum_ = 0;
  StepGraph<std::vector<std::byte>> graph_;
  std::vector<std::function<void()>> recorded_;  // the captured step's calls
  Ops* leader_ = nullptr;                        // follow_graph's
};

}  // namespace fived
