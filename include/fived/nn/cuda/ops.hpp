#pragma once
// Ops<T, Cuda>: the model's kernel dispatch on one GPU (see nn/ops.hpp for the interface).
// Device code: include it from a .cu file compiled by nvcc, before using
// GPT<Cfg, T, fived::Cuda> (nn/gpt.hpp).
//
//   #include <fived/nn/cuda/ops.hpp>
//   #include <fived/nn/gpt.hpp>
//   fived::GPT<cfg, fived::bf16, fived::Cuda> model(fived::GptInit{.seed = 1});
//   float loss = model.forward(tokens, targets, B, T);  // host token ids; waits for the loss
//   model.backward();
//   auto& ops = model.ops();  // ops.stream(), ops.lt(): queue more work in the model's order
//
// It owns a non-blocking Stream (every kernel and copy of the model is queued on it, in
// order) and a CublasLt bound to that stream. Element types float and bf16; statistics
// (LayerNorm mean/rstd, log-sum-exp, cross-entropy max/sum-exp/target) are float.
//
// Synchronisation: the kernels are asynchronous. Token ids go through pinned staging
// memory (the host pointer can be reused as soon as forward returns, and the upload does
// not wait for queued work); mean_loss, loss_sum(), to_host, read_to_host,
// write_from_host and dispatch_plan (the MoE counts) wait for the stream.

#if !defined(__CUDACC__)
#error "fived/nn/cuda/ops.hpp holds device code: include it from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fived/device/bf16.hpp>
#include <fived/device/buffer.hpp>
#include <fived/device/cuda.hpp>
#include <fived/kernels/cuda.hpp>
#include <fived/nn/ops.hpp>
#include <fived/nn/ops_kernels.hpp>
#include <fived/nn/step_graph.hpp>

namespace fived {

namespace ops_detail {

// Pinned (page-locked) host memory for asynchronous uploads, with an event marking
// when the last copy out of it has completed.
class PinnedStaging {
 public:
  PinnedStaging() : done_(cudaEventDisableTiming) {}

  // Copies host[0, bytes) to device memory dst on `stream`, without waiting for the stream.
  void upload(void* dst, const void* host, std::size_t bytes, cudaStream_t stream) {
    if (bytes == 0) return;
    done_.synchronize();  // the previous copy out of the staging memory has finished
    if (bytes > cap_ || p_.get() == nullptr) {
      p_.reset();
      cap_ = 0;
      void* p = nullptr;
      FIVED_CUDA_CHECK(cudaMallocHost(&p, bytes));
      p_.reset(p);
      cap_ = bytes;
    }
    std::memcpy(p_.get(), host, bytes);
    FIVED_CUDA_CHECK(cudaMemcpyAsync(dst, p_.get(), bytes, cudaMemcpyHostToDevice, stream));
    done_.record(stream);
  }

 private:
  cuda::UniqueHandle<void*, cudaFreeHost> p_;
  std::size_t cap_ = 0;  // bytes p_ holds
  cuda::Event done_;     // recorded after each copy; an unrecorded event counts as complete
};

// Pinned host memory of a fixed size: what a step captured as a CUDA graph copies its uploads
// from (nn/step_graph.hpp).
class PinnedBytes {
 public:
  explicit PinnedBytes(std::size_t bytes) {
    void* p = nullptr;
    FIVED_CUDA_CHECK(cudaMallocHost(&p, bytes));
    p_.reset(p);
  }
  void* data() const noexcept { return p_.get(); }

 private:
  cuda::UniqueHandle<void*, cudaFreeHost> p_;
};

}  // namespace ops_detail

template <class T>
struct Ops<T, Cuda> {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>,
                "fived::Ops<T, Cuda>: the element type must be float or fived::bf16 (double is host only)");

  using device = Cuda;
  using value_type = T;
  using stat_t = float;
  template <class U>
  using buffer = Buffer<U, Cuda>;
  using Epilogue = kernels::cuda::Epilogue;
  using Batch = kernels::cuda::Batch;
  using WeightGradBatch = kernels::cuda::WeightGradBatch;

  Ops() : lt_(stream_.get()), loss_sum_(1) {
    kernels::cuda::keep_scratch_pool();
  }
  Ops(Ops&&) noexcept = default;  // the stream handle moves with its CublasLt
  Ops& operator=(Ops&&) noexcept = default;

  cudaStream_t stream() const noexcept { return stream_.get(); }
  kernels::cuda::CublasLt& lt() noexcept { return lt_; }

  // ---- kernels ------------------------------------------------------------------------------

  // Every kernel the devices forward alike (nn/ops_kernels.hpp), on this stream; then the rest.
  // Each is queued (below): launched, captured, or left to the graph that replays it.
#define FIVED_CUDA_KERNEL(name, parameters, arguments)                                                  \
  void name parameters {                                                                               \
    queue(#name, [&] { kernels::cuda::name(stream(), FIVED_OPS_ARGS arguments); },                     \
          [&] { return call_hash arguments; });                                                        \
  }
  FIVED_OPS_KERNELS(FIVED_CUDA_KERNEL)
#undef FIVED_CUDA_KERNEL

  // Each GEMM takes a strided batch last (kernels/host/gemm.hpp): one cuBLASLt call for
  // padded experts' products.
  void matmul(T* out, const T* a, const T* b, const T* bias, int M, int N, int K, bool trans_a, bool trans_b,
              bool accumulate = false, Epilogue ep = Epilogue::none, T* pre_act = nullptr, Batch batch = {}) {
    queue("matmul",
          [&] {
            kernels::cuda::matmul(lt_, out, a, b, bias, M, N, K, trans_a, trans_b, accumulate, ep, pre_act, batch);
          },
          [&] { return call_hash(out, a, b, bias, M, N, K, trans_a, trans_b, accumulate, ep, pre_act, batch); });
  }
  // out = gelu'(pre_act) * op(a) op(b): the gradient at a GELU's input from the GEMM that
  // gives its output's (kernels/host/gemm.hpp).
  void matmul_dgelu(T* out, const T* a, const T* b, const T* pre_act, int M, int N, int K, bool trans_a, bool trans_b,
                    Batch batch = {}) {
    queue("matmul_dgelu",
          [&] { kernels::cuda::matmul_dgelu(lt_, out, a, b, pre_act, M, N, K, trans_a, trans_b, batch); },
          [&] { return call_hash(out, a, b, pre_act, M, N, K, trans_a, trans_b, batch); });
  }
  void matmul_weight_grad(T* dw, T* db, const T* dy, const T* x, int rows, int in, int out, bool transposed,
                          WeightGradBatch batch = {}) {
    queue("matmul_weight_grad",
          [&] { kernels::cuda::matmul_weight_grad(lt_, dw, db, dy, x, rows, in, out, transposed, batch); },
          [&] { return call_hash(dw, db, dy, x, rows, in, out, transposed, batch); });
  }
  // bf16 attention runs through cuDNN's fused kernel where fived was built with it
  // (FIVED_WITH_CUDNN) and it takes the shape; fived's own kernel otherwise, or when
  // use_cudnn_attention is false.
  // Rows of packed documents (doc_first, context/documents.hpp) run fived's kernel: cuDNN's
  // graph here knows whole causal rows only.
  void attention_forward(T* out, stat_t* lse, const T* qkv, int B, int T_, int C, int NH, int NKV,
                         const int* doc_first = nullptr) {
    const bool cudnn = doc_first == nullptr && attention_through_cudnn(C, NH, NKV);
    queue("attention_forward",
          [&] {
#if defined(FIVED_WITH_CUDNN)
            if constexpr (std::is_same_v<T, bf16>) {
              if (cudnn) return cudnn_.forward(out, lse, qkv, B, T_, C, NH, NKV);
            }
#endif
            kernels::cuda::attention_forward(stream(), out, lse, qkv, B, T_, C, NH, NKV, doc_first);
          },
          [&] { return call_hash(out, lse, qkv, B, T_, C, NH, NKV, doc_first, cudnn); });
  }
  void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const stat_t* lse, int B, int T_, int C,
                          int NH, int NKV, const int* doc_first = nullptr) {
    const bool cudnn = doc_first == nullptr && attention_through_cudnn(C, NH, NKV);
    queue("attention_backward",
          [&] {
#if defined(FIVED_WITH_CUDNN)
            if constexpr (std::is_same_v<T, bf16>) {
              if (cudnn) return cudnn_.backward(dqkv, dout, qkv, out, lse, B, T_, C, NH, NKV);
            }
#endif
            kernels::cuda::attention_backward(stream(), dqkv, dout, qkv, out, lse, B, T_, C, NH, NKV, doc_first);
          },
          [&] { return call_hash(dqkv, dout, qkv, out, lse, B, T_, C, NH, NKV, doc_first, cudnn); });
  }
  bool use_cudnn_attention = true;
  // Whether attention_forward/backward run cuDNN's kernel for this shape (of whole rows).
  bool attention_through_cudnn([[maybe_unused]] int C, [[maybe_unused]] int NH, [[maybe_unused]] int NKV) const {
#if defined(FIVED_WITH_CUDNN)
    if constexpr (std::is_same_v<T, bf16>) return cudnn_takes(C, NH, NKV);
#endif
    return false;
  }
  // The loss of every row added since begin_loss_sum(), accumulated in double on the device;
  // loss_sum() reads it back (waits for the stream, once).
  void begin_loss_sum() { zero(loss_sum_.data(), 1); }
  void add_loss_sum(const stat_t* max, const stat_t* sumexp, const stat_t* target, int N) {
    queue("add_loss_sum", [&] { kernels::cuda::add_loss_sum(stream(), loss_sum_.data(), max, sumexp, target, N); },
          [&] { return call_hash(max, sumexp, target, N); });
  }
  double loss_sum() const {
    graph().no_wait("loss_sum");
    double h = 0;
    copy_to_host(&h, loss_sum_.data(), 1);
    synchronize();
    return h;
  }
  template <class U>
  void regroup(U* out, const U* in, std::int64_t outer, int n, std::int64_t block, kernels::cuda::Blocks how) {
    queue("regroup", [&] { kernels::cuda::regroup(stream(), out, in, outer, n, block, how); },
          [&] { return call_hash(out, in, outer, n, block, how); });
  }

  // Mixture of experts (kernels/cuda/moe.hpp). dispatch_plan writes the kept per-expert counts
  // to device memory, and to host memory when asked, waiting for the stream (dropless
  // routing's all-to-all sizes are host values); its sort and count buffers are kept here and
  // grow only with N*k or E (a padded plan's first call of a shape grows them outside the
  // graph: the plain first step).
  void dispatch_plan(int* token_of, int* pos, float* loads, int* host_counts, const int* expert, int N, int k, int E,
                     int capacity, bool padded) {
    if (host_counts != nullptr) {
      graph().no_wait("dispatch_plan");
      return kernels::cuda::dispatch_plan(stream(), dispatch_, token_of, pos, loads, host_counts, expert, N, k, E,
                                          capacity, padded);
    }
    queue("dispatch_plan",
          [&] {
            kernels::cuda::dispatch_plan(stream(), dispatch_, token_of, pos, loads, static_cast<int*>(nullptr), expert,
                                         N, k, E, capacity, padded);
          },
          [&] { return call_hash(token_of, pos, loads, expert, N, k, E, capacity, padded); });
  }

  // ---- memory and staging ----------------------------------------------------------------------

  // Zero-filled (complete on return: see Buffer<T, Cuda>).
  template <class U>
  Buffer<U, Cuda> make_buffer(std::size_t n) {
    graph().no_wait("make_buffer");
    return Buffer<U, Cuda>(n);
  }
  template <class U>
  Buffer<U, Cuda> make_buffer(std::size_t n, ReleasablePages) {
    graph().no_wait("make_buffer");
    return Buffer<U, Cuda>(n, releasable_pages);
  }
  // After the work queued so far on this stream (device/cuda_pages.hpp).
  template <class U>
  void release_pages(std::span<U> range) {
    graph().no_wait("release_pages");
    cuda::release_pages(range, stream());
  }
  template <class U>
  void commit_pages(std::span<U> range) {
    graph().no_wait("commit_pages");
    cuda::commit_pages(range, stream());
  }
  // The released pages' memory back to the driver (waits for the device).
  void trim_pages() {
    graph().no_wait("trim_pages");
    cuda::trim_pages();
  }
  template <class U>
  void zero(Buffer<U, Cuda>& b) {
    zero(b.data(), b.size());
  }
  template <class U>
  void zero(U* p, std::size_t n) {
    if (n != 0)
      queue("zero", [&] { FIVED_CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(U), stream())); },
            [&] { return call_hash(p, n); });
  }
  template <class U>
  void copy(U* dst, const U* src, std::size_t n) {
    if (n != 0 && dst != src)
      queue("copy",
            [&] { FIVED_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(U), cudaMemcpyDeviceToDevice, stream())); },
            [&] { return call_hash(dst, src, n); });
  }
  template <class U>
  void copy_rows(U* dst, std::size_t dst_ld, const U* src, std::size_t src_ld, std::size_t width, std::size_t rows) {
    if (width != 0 && rows != 0)
      queue("copy_rows",
            [&] {
              FIVED_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_ld * sizeof(U), src, src_ld * sizeof(U), width * sizeof(U),
                                                 rows, cudaMemcpyDeviceToDevice, stream()));
            },
            [&] { return call_hash(dst, dst_ld, src, src_ld, width, rows); });
  }

  void upload_ids(Buffer<int, Cuda>& dst, const int* host, std::size_t n) {
    if (n > dst.size())
      throw std::invalid_argument("fived::Ops<T, Cuda>::upload_ids: " + std::to_string(n) +
                                  " ids for a buffer of " + std::to_string(dst.size()));
    if (n == 0) return;
    if (graph().mode() != StepMode::plain) return upload(dst.data(), host, n);
    graph().plain_upload(n * sizeof(int));
    // Two staging areas, used in turn (tokens and targets of one forward): an upload waits
    // only for the copy two uploads back, never for the kernels queued since.
    ops_detail::PinnedStaging& s = staging_[next_staging_];
    next_staging_ = 1 - next_staging_;
    s.upload(dst.data(), host, n * sizeof(int), stream());
  }
  // n values from host memory into device memory dst, ordered on the stream; `host` can be
  // reused on return. Through pinned staging memory of its own (not the ids' two): the copy
  // does not wait for the queued work, and a pinned `host` (which cudaMemcpyAsync would read
  // later, asynchronously) is safe too. An upload waits only for the previous upload's copy.
  // In a graph step, through the step's own pinned copy of the values (nn/step_graph.hpp).
  template <class U>
  void upload(U* dst, const U* host, std::size_t n) {
    static_assert(std::is_trivially_copyable_v<U>, "fived::Ops<T, Cuda>::upload copies bytes");
    if (n == 0) return;
    const std::size_t bytes = n * sizeof(U);
    if (graph().mode() == StepMode::plain) {
      graph().plain_upload(bytes);
      return upload_staging_.upload(dst, host, bytes, stream());
    }
    const void* from = graph().upload("upload", call_hash(dst, bytes), host, bytes);
    if (graph().mode() == StepMode::capturing)
      FIVED_CUDA_CHECK(cudaMemcpyAsync(dst, from, bytes, cudaMemcpyHostToDevice, stream()));
  }
  // Mean cross-entropy from the [N] statistics: downloads them (waits for the stream) and
  // sums in double on the host, as Ops<T, Host> does.
  double mean_loss(const stat_t* max, const stat_t* sumexp, const stat_t* target, int N) const {
    graph().no_wait("mean_loss");
    const std::size_t n = static_cast<std::size_t>(N);
    std::vector<float> mx(n), se(n), tg(n);
    copy_to_host(mx.data(), max, n);
    copy_to_host(se.data(), sumexp, n);
    copy_to_host(tg.data(), target, n);
    synchronize();
    double sum = 0;
    for (std::size_t i = 0; i < n; ++i)
      sum += std::log(static_cast<double>(se[i])) + static_cast<double>(mx[i]) - static_cast<double>(tg[i]);
    return sum / static_cast<double>(N);
  }
  // f(std::span<U>) fills a zeroed host copy; the copy is then uploaded (complete on return).
  template <class U, class F>
  void write_from_host(Buffer<U, Cuda>& b, F&& f) {
    graph().no_wait("write_from_host");
    std::vector<U> h(b.size());
    f(std::span<U>(h));
    b.upload(std::span<const U>(h), stream());
  }
  // Downloads b (after the queued work), then f(std::span<const U>) reads the host copy.
  template <class U, class F>
  void read_to_host(const Buffer<U, Cuda>& b, F&& f) const {
    graph().no_wait("read_to_host");
    std::vector<U> h(b.size());
    b.download(std::span<U>(h), stream());
    f(std::span<const U>(h));
  }
  // A host copy of device memory (after the queued work).
  template <class U>
  std::vector<std::remove_const_t<U>> to_host(std::span<U> device_span) const {
    graph().no_wait("to_host");
    std::vector<std::remove_const_t<U>> h(device_span.size());
    copy_to_host(h.data(), device_span.data(), h.size());
    FIVED_CUDA_CHECK(cudaStreamSynchronize(stream()));
    return h;
  }
  void synchronize() const {
    graph().no_wait("synchronize");
    stream_.synchronize();
  }

  // ---- a step as a CUDA graph (nn/step_graph.hpp) -----------------------------------------------

  bool use_step_graph = false;
  // Capturing: the stream captures the step into a graph. Replaying: no call queues anything,
  // and the stream captures all the same, so that work queued around the Ops (which would
  // run ahead of the graph) is caught at launch.
  void begin_graph_step(std::uint64_t shape) {
    if (!use_step_graph) {
      graph().forget();
      return exec_.reset();
    }
    const StepMode mode = graph().begin(shape);
    if (mode == StepMode::plain) return exec_.reset();
    try {  // a throw here leaves no step begun (GraphStep's destructor does not run)
      if (mode == StepMode::replaying) launched_.synchronize();  // the last replay has read its uploads
      // Thread-local: this thread's synchronising calls fail the capture; other threads (a
      // user's loader, a saver) are not restricted by it.
      FIVED_CUDA_CHECK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal));
    } catch (...) {
      abandon_graph_step();
      throw;
    }
  }
  // The step's work, queued: the captured graph, instantiated the first time, launched.
  void launch_graph_step() {
    const StepMode mode = graph().mode();
    if (mode == StepMode::plain) return graph().end();
    cudaGraph_t g = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream(), &g);
    cuda::UniqueHandle<cudaGraph_t, cudaGraphDestroy> owned(g);
    try {
      FIVED_CUDA_CHECK(ended);
      std::size_t nodes = 0;
      FIVED_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &nodes));
      if (mode == StepMode::replaying && nodes != 0)
        throw std::logic_error("fived::GraphStep: " + std::to_string(nodes) +
                               " operations were queued on the model's stream around its Ops during a replayed step; "
                               "they would run ahead of the graph. Queue them through the Ops, or turn the step graph "
                               "off");
      graph().end();  // every captured call made again
      if (mode == StepMode::capturing) {
        cudaGraphExec_t exec = nullptr;
        // (the communicator's high-priority stream keeps its priority in the graph)
        FIVED_CUDA_CHECK(cudaGraphInstantiate(&exec, g, cudaGraphInstantiateFlagUseNodePriority));
        exec_.reset(exec);
      }
      FIVED_CUDA_CHECK(cudaGraphLaunch(exec_.get(), stream()));
      launched_.record(stream());
    } catch (...) {
      abandon_graph_step();
      throw;
    }
  }
  // Back to plain steps, a capture in progress ended and dropped.
  void abandon_graph_step() noexcept {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
      cudaGraph_t g = nullptr;
      (void)cudaStreamEndCapture(stream(), &g);
      if (g != nullptr) (void)cudaGraphDestroy(g);
    }
    // An invalidated capture leaves its error behind, also when launch_graph_step's own
    // EndCapture failed (the stream no longer captures): a later launch's check would report it.
    (void)cudaGetLastError();
    graph().forget();
    exec_.reset();
  }
  StepMode step_mode() const { return graph().mode(); }
  bool in_graph_step() const { return graph().mode() != StepMode::plain; }
  bool step_graph_captured() const { return graph().captured(); }  // a graph to replay is kept
  // This Ops' calls belong to the graph steps of `leader`, whose stream captures them (a
  // trainer's communication side: its stream joins the capture through the events that
  // order it after the model's stream).
  void follow_graph(Ops& leader) { leader_ = &leader; }

  // A call that queues device work: launched now in a plain step, and while capturing (the
  // stream records it); left to the graph while replaying, once checked against the captured
  // call. `args` hashes its arguments. Work queued outside the Ops in a step (a
  // communicator's collectives and the events around them: MeshComm::order_after,
  // CommQueue) comes through here too.
  template <class Run, class Args>
  void queue(const char* what, Run&& run, Args&& args) {
    if (graph().mode() != StepMode::plain) {
      graph().call(what, args());
      if (graph().mode() == StepMode::replaying) return;
    }
    run();
  }
  // `what` is about to wait for the device (a collective that the host reads): refused in a
  // graph step.
  void host_wait(const char* what) const { graph().no_wait(what); }

 private:
  StepGraph<ops_detail::PinnedBytes>& graph() { return leader_ ? leader_->graph_ : graph_; }
  const StepGraph<ops_detail::PinnedBytes>& graph() const { return leader_ ? leader_->graph_ : graph_; }

  template <class U>
  void copy_to_host(U* host, const U* device, std::size_t n) const {
    if (n != 0) FIVED_CUDA_CHECK(cudaMemcpyAsync(host, device, n * sizeof(U), cudaMemcpyDeviceToHost, stream()));
  }

  cuda::Stream stream_;
  kernels::cuda::CublasLt lt_;
  Buffer<double, Cuda> loss_sum_;  // loss_sum's
  ops_detail::PinnedStaging staging_[2];
  int next_staging_ = 0;
  ops_detail::PinnedStaging upload_staging_;  // upload's
  StepGraph<ops_detail::PinnedBytes> graph_;
  cuda::UniqueHandle<cudaGraphExec_t, cudaGraphExecDestroy> exec_;  // the captured step
  cuda::Event launched_{cudaEventDisableTiming};  // recorded after each launch of exec_
  Ops* leader_ = nullptr;                          // follow_graph's
  kernels::cuda::DispatchScratch dispatch_;  // dispatch_plan's sort and count buffers
#if defined(FIVED_WITH_CUDNN)
  bool cudnn_takes(int C, int NH, int NKV) const {
    return use_cudnn_attention && cudnn_.takes(C, NH, NKV);
  }
  kernels::cuda::CudnnAttention cudnn_{stream_.get()};
#endif
};

}  // namespace fived
