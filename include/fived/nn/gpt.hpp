#pragma once
// GPT-2 style decoder on one device: explicit forward and backward over the kernels of the
// device (dispatched by Ops<T, Device>, nn/ops.hpp), parameters and gradients in one flat
// buffer each, laid out at compile time (nn/layout.hpp).
//
//   struct tiny : fived::gpt_config { static constexpr int layers = 2, d_model = 64, heads = 4,
//                                     vocab = 256, max_seq = 64; };
//   fived::GPT<tiny> model(fived::GptInit{.seed = 42});
//   float loss = model.forward(tokens, targets, B, T);   // mean cross-entropy over B*T
//   model.zero_grad(); model.backward();                 // grads accumulate until zero_grad()
//   // update model.params() from model.grads() (e.g. model.ops().adamw_update)
//
// Blocks are pre-LayerNorm:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x));
// logits = ln_f(x) · wte^T (tied; lm_head^T when untied), over the padded vocabulary.
// Linear weights are Hugging Face Conv1D [in, out] (y = x W + b), so the forward GEMMs use
// no transpose, dW = x^T dy uses trans_a and dx = dy W^T uses trans_b.
//
// Activations are sized for B*T at run time: allocated on the first forward and reallocated
// only when a larger B*T comes (a smaller one reuses the buffers, e.g. for generation).
//
// The loss is fused with its gradient (crossentropy_backward writes d-logits over the
// logits, as llm.c does): forward(tokens, targets) leaves d-logits behind for backward();
// forward(tokens, nullptr) computes no loss and leaves the logits readable (logits()).
//
// Device: Host (default; T = float, double or bf16) or Cuda (T = float or bf16). The
// algorithm is written once; every kernel call goes through ops() (Ops<T, Device>), and
// parameters, gradients and activations are Buffer<T, Device>. GPT<Cfg, T, Cuda> needs
// <fived/nn/cuda/ops.hpp> included first, in a .cu file compiled by nvcc:
//
//   #include <fived/nn/cuda/ops.hpp>
//   #include <fived/nn/gpt.hpp>
//   fived::GPT<cfg, fived::bf16, fived::Cuda> model;  // kernels queued on model.ops().stream()
//
// On Cuda, forward() takes host token ids (copied to the device through pinned memory) and
// waits for the device to return the loss (enqueue_forward() does not wait); params(),
// grads(), param(), grad() and logits() are spans over DEVICE memory (pass them to kernels
// on ops().stream(); never dereference them on the host); params_to_host(),
// grads_to_host() and logits_to_host() copy to the host. init, save and load stage through
// host memory. Statistics buffers are Ops::stat_t: acc_t<T> on the host, float on Cuda.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/device/buffer.hpp"
#include "fived/io/safetensors.hpp"
#include "fived/nn/checkpoint.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/init.hpp"
#include "fived/nn/layout.hpp"
#include "fived/nn/ops.hpp"
#include "fived/nn/unit_hooks.hpp"

namespace fived {

// A named tensor inside a flat buffer (device memory when the model is on Cuda: data is
// then for passing on, not for indexing on the host).
template <class T>
struct TensorView {
  const ParamInfo* info = nullptr;
  std::span<T> data;

  std::string name() const { return info->name(); }
  std::int64_t rows() const { return info->rows; }
  std::int64_t cols() const { return info->cols; }
  int rank() const { return info->rank; }
  std::size_t size() const { return data.size(); }
  T& operator[](std::size_t i) const { return data[i]; }
  T& operator()(std::int64_t r, std::int64_t c) const { return data[static_cast<std::size_t>(r * info->cols + c)]; }
};

template <class Cfg, class T = float, class Device = Host>
class GPT {
  static_assert(std::is_same_v<Device, Host> || std::is_same_v<Device, Cuda>,
                "GPT<Cfg, T, Device>: the device must be fived::Host or fived::Cuda");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>,
                "GPT<Cfg, T>: the element type must be float, double (gradient checks) or fived::bf16");
  static_assert(!(std::is_same_v<Device, Cuda> && std::is_same_v<T, double>),
                "GPT<Cfg, double, Cuda>: double is for host gradient checks; on Cuda use float or fived::bf16");

 public:
  using config = Cfg;
  using dims = gpt_dims<Cfg>;
  using layout = GptLayout<Cfg>;
  using value_type = T;
  using device = Device;
  using acc = acc_t<T>;
  using ops_type = Ops<T, Device>;                  // the device's kernels (nn/ops.hpp, nn/cuda/ops.hpp)
  using stat_t = typename ops_type::stat_t;         // statistics: acc_t<T> on Host, float on Cuda
  static constexpr bool on_host = std::is_same_v<Device, Host>;

  static constexpr int L = dims::layers;
  static constexpr int C = dims::d_model;
  static constexpr int NH = dims::heads;
  static constexpr int V = dims::vocab;
  static constexpr int Vp = dims::padded_vocab;
  static constexpr int F = dims::d_ff;
  static constexpr int max_seq = dims::max_seq;
  static constexpr std::size_t num_params = layout::size;  // buffer elements, padding included

  explicit GPT(const GptInit& init = {})
      : params_(ops_.template make_buffer<T>(num_params)), grads_(ops_.template make_buffer<T>(num_params)) {
    ops_.write_from_host(params_, [&](std::span<T> p) { init_gpt<Cfg>(p, init); });
  }

  // The device's kernel dispatch: on Cuda, ops().stream() is the stream every kernel of the
  // model runs on (queue optimizer steps there), ops().lt() its cuBLASLt handle.
  ops_type& ops() { return ops_; }
  const ops_type& ops() const { return ops_; }

  // ---- parameters and gradients ----------------------------------------------------------
  // On Cuda these spans and views are device memory (see the top of this file).

  std::span<T> params() { return params_.span(); }
  std::span<const T> params() const { return params_.span(); }
  std::span<T> grads() { return grads_.span(); }
  std::span<const T> grads() const { return grads_.span(); }
  Buffer<T, Device>& param_buffer() { return params_; }
  Buffer<T, Device>& grad_buffer() { return grads_; }

  TensorView<T> param(ParamKind k, int layer = -1) { return view(params_, layout::index(k, layer)); }
  TensorView<T> grad(ParamKind k, int layer = -1) { return view(grads_, layout::index(k, layer)); }
  TensorView<const T> param(ParamKind k, int layer = -1) const { return view(params_, layout::index(k, layer)); }
  TensorView<const T> grad(ParamKind k, int layer = -1) const { return view(grads_, layout::index(k, layer)); }
  // By Hugging Face name ("h.1.attn.c_attn.weight"); std::invalid_argument if there is none.
  TensorView<T> param(std::string_view name) { return view(params_, index_of(name)); }
  TensorView<T> grad(std::string_view name) { return view(grads_, index_of(name)); }
  TensorView<const T> param(std::string_view name) const { return view(params_, index_of(name)); }
  TensorView<const T> grad(std::string_view name) const { return view(grads_, index_of(name)); }

  void zero_grad() { ops_.zero(grads_); }

  // Host copies (wait for the queued work on Cuda). On the host: plain copies.
  std::vector<T> params_to_host() const { return ops_.to_host(params_.span()); }
  std::vector<T> grads_to_host() const { return ops_.to_host(grads_.span()); }

  // ---- forward / backward ------------------------------------------------------------------

  // tokens and targets are [B, T] token ids in [0, vocab), in host memory. Returns the mean
  // loss over B*T (0 when targets is nullptr). With targets, d-logits for backward() are
  // computed too. On Cuda this waits for the device (the loss is read back); see
  // enqueue_forward() for the variant that does not. hooks: before_forward/after_forward
  // around each unit's use of its parameters (nn/unit_hooks.hpp).
  float forward(const int* tokens, const int* targets, int B, int T_, const UnitHooks& hooks = {}) {
    enqueue_forward(tokens, targets, B, T_, hooks);
    if (targets == nullptr) return 0.0f;
    return static_cast<float>(loss());
  }

  // forward() without reading the loss back: on Cuda it returns as soon as the work is
  // queued (loss() then waits for it). On the host it is forward() with the result dropped.
  void enqueue_forward(const int* tokens, const int* targets, int B, int T_, const UnitHooks& hooks = {}) {
    if (B < 1 || T_ < 1 || T_ > max_seq)
      throw std::invalid_argument("GPT::forward: needs B >= 1 and 1 <= T <= max_seq = " + std::to_string(max_seq) +
                                  " (got B=" + std::to_string(B) + ", T=" + std::to_string(T_) + ")");
    if (tokens == nullptr) throw std::invalid_argument("GPT::forward: tokens is nullptr");
    const int N = B * T_;
    const std::size_t sN = static_cast<std::size_t>(N);
    if constexpr (!on_host) {  // the device kernels cannot report a bad id: check here
      check_ids("tokens", tokens, sN);
      if (targets != nullptr) check_ids("targets", targets, sN);
    }
    reserve(B, T_);
    B_ = B;
    Tseq_ = T_;
    ops_.upload_ids(a_.tokens, tokens, sN);
    if (targets != nullptr) ops_.upload_ids(a_.targets, targets, sN);
    has_dlogits_ = false;
    loss_pending_ = false;
    loss_ = 0;

    const T* p = params_.data();
    auto P = [&](ParamKind k, int l = -1) { return p + layout::offset(k, l); };
    const int* tok = a_.tokens.data();

    detail::call(hooks.before_forward, 0);
    ops_.embedding_forward(a_.encoded.data(), tok, P(ParamKind::wte), P(ParamKind::wpe), B, T_, C, V);
    detail::call(hooks.after_forward, 0);
    const T* x = a_.encoded.data();
    for (int l = 0; l < L; ++l) {
      detail::call(hooks.before_forward, 1 + l);
      LayerActs& A = a_.layer[static_cast<std::size_t>(l)];
      ops_.layernorm_forward(A.ln1.data(), A.ln1_mean.data(), A.ln1_rstd.data(), x, P(ParamKind::ln_1_weight, l),
                             P(ParamKind::ln_1_bias, l), N, C);
      ops_.matmul(A.qkv.data(), A.ln1.data(), P(ParamKind::attn_c_attn_weight, l), P(ParamKind::attn_c_attn_bias, l),
                  N, 3 * C, C, false, false);
      ops_.attention_forward(A.atty.data(), A.lse.data(), A.qkv.data(), B, T_, C, NH);
      ops_.matmul(a_.scratch.data(), A.atty.data(), P(ParamKind::attn_c_proj_weight, l),
                  P(ParamKind::attn_c_proj_bias, l), N, C, C, false, false);
      ops_.residual_forward(A.res2.data(), x, a_.scratch.data(), sN * C);
      ops_.layernorm_forward(A.ln2.data(), A.ln2_mean.data(), A.ln2_rstd.data(), A.res2.data(),
                             P(ParamKind::ln_2_weight, l), P(ParamKind::ln_2_bias, l), N, C);
      ops_.matmul(A.fch_gelu.data(), A.ln2.data(), P(ParamKind::mlp_c_fc_weight, l), P(ParamKind::mlp_c_fc_bias, l),
                  N, F, C, false, false, false, ops_type::Epilogue::gelu, A.fch.data());
      ops_.matmul(a_.scratch.data(), A.fch_gelu.data(), P(ParamKind::mlp_c_proj_weight, l),
                  P(ParamKind::mlp_c_proj_bias, l), N, C, F, false, false);
      ops_.residual_forward(A.res3.data(), A.res2.data(), a_.scratch.data(), sN * C);
      x = A.res3.data();
      detail::call(hooks.after_forward, 1 + l);
    }
    detail::call(hooks.before_forward, L + 1);
    if constexpr (layout::tied) detail::call(hooks.before_forward, 0);  // the head is wte
    ops_.layernorm_forward(a_.lnf.data(), a_.lnf_mean.data(), a_.lnf_rstd.data(), x, P(ParamKind::ln_f_weight),
                           P(ParamKind::ln_f_bias), N, C);
    // logits[N, Vp] = lnf[N, C] · head^T, head stored [Vp, C]
    ops_.matmul(a_.logits.data(), a_.lnf.data(), P(layout::head_kind), static_cast<const T*>(nullptr), N, Vp, C, false,
                true);
    if constexpr (layout::tied) detail::call(hooks.after_forward, 0);
    detail::call(hooks.after_forward, L + 1);
    if (targets == nullptr) return;

    // Fused loss + d-logits (written over the logits), in the three steps of the
    // vocab-parallel contract so the loss keeps stat_t precision (double in gradient checks).
    const int* tgt = a_.targets.data();
    ops_.logits_max(a_.ce_max.data(), a_.logits.data(), N, Vp, 0, V);
    ops_.crossentropy_partials(a_.ce_sumexp.data(), a_.ce_target.data(), a_.logits.data(), tgt, a_.ce_max.data(), N,
                               Vp, 0, V);
    const float dloss = 1.0f / static_cast<float>(N);
    ops_.crossentropy_backward(a_.losses.data(), a_.logits.data(), a_.logits.data(), tgt, a_.ce_max.data(),
                               a_.ce_sumexp.data(), a_.ce_target.data(), N, Vp, 0, V, dloss);
    loss_pending_ = true;
    has_dlogits_ = true;
    if constexpr (on_host) loss();  // the host computes it at once (as before enqueue_forward existed)
  }

  // The mean loss of the last forward with targets, in stat_t precision summed in double
  // (double for T = double). On Cuda the first call after a forward waits for the device.
  double loss() const {
    if (loss_pending_) {
      loss_ = ops_.mean_loss(a_.ce_max.data(), a_.ce_sumexp.data(), a_.ce_target.data(), B_ * Tseq_);
      loss_pending_ = false;
    }
    return loss_;
  }

  // Accumulates the gradient of the last forward's mean loss into grads().
  //
  // hooks (nn/unit_hooks.hpp): before_backward(u) before unit u's parameters are read or its
  // gradients written, after_backward(u) as soon as unit u's gradients are final. Units
  // finish from the last to the first: L+1 (ln_f, an untied head), the layers from L to 1,
  // then 0 (the embeddings, which a tied head also wrote). A data-parallel trainer reduces a
  // unit's buckets there, while the rest of backward runs.
  void backward(const UnitHooks& hooks = {}) {
    if (!has_dlogits_)
      throw std::logic_error("GPT::backward: call forward(tokens, targets, B, T) with targets first (once per backward)");
    has_dlogits_ = false;
    const int B = B_, T_ = Tseq_, N = B * T_;
    const T* p = params_.data();
    T* g = grads_.data();
    auto P = [&](ParamKind k, int l = -1) { return p + layout::offset(k, l); };
    auto G = [&](ParamKind k, int l = -1) { return g + layout::offset(k, l); };
    const T* dlogits = a_.logits.data();
    T* dres = a_.dres.data();
    T* dln = a_.dln.data();

    // logits = lnf · head^T:  dlnf = dlogits · head,  dhead += dlogits^T · lnf
    detail::call(hooks.before_backward, L + 1);
    if constexpr (layout::tied) detail::call(hooks.before_backward, 0);  // the head is wte
    ops_.matmul(dln, dlogits, P(layout::head_kind), static_cast<const T*>(nullptr), N, C, Vp, false, false);
    ops_.matmul(G(layout::head_kind), dlogits, a_.lnf.data(), static_cast<const T*>(nullptr), Vp, C, N, true, false,
                true);
    ops_.zero(a_.dres);
    const T* x_last = L > 0 ? a_.layer[static_cast<std::size_t>(L - 1)].res3.data() : a_.encoded.data();
    ops_.layernorm_backward(dres, G(ParamKind::ln_f_weight), G(ParamKind::ln_f_bias), dln, x_last,
                            P(ParamKind::ln_f_weight), a_.lnf_mean.data(), a_.lnf_rstd.data(), N, C);
    detail::call(hooks.after_backward, L + 1);  // ln_f (and an untied lm_head)

    for (int l = L - 1; l >= 0; --l) {
      detail::call(hooks.before_backward, 1 + l);
      LayerActs& A = a_.layer[static_cast<std::size_t>(l)];
      const T* x = l == 0 ? a_.encoded.data() : a_.layer[static_cast<std::size_t>(l - 1)].res3.data();
      // dres holds d(res3). MLP projection: y = fch_gelu · Wp + bp
      linear_backward(a_.dfch.data(), G(ParamKind::mlp_c_proj_weight, l), G(ParamKind::mlp_c_proj_bias, l), dres,
                      A.fch_gelu.data(), P(ParamKind::mlp_c_proj_weight, l), N, F, C);
      ops_.gelu_backward(a_.dfch.data(), A.fch.data(), a_.dfch.data(), static_cast<std::size_t>(N) * F);
      linear_backward(dln, G(ParamKind::mlp_c_fc_weight, l), G(ParamKind::mlp_c_fc_bias, l), a_.dfch.data(),
                      A.ln2.data(), P(ParamKind::mlp_c_fc_weight, l), N, C, F);
      ops_.layernorm_backward(dres, G(ParamKind::ln_2_weight, l), G(ParamKind::ln_2_bias, l), dln, A.res2.data(),
                              P(ParamKind::ln_2_weight, l), A.ln2_mean.data(), A.ln2_rstd.data(), N, C);
      // dres holds d(res2). Attention projection, attention, qkv projection.
      linear_backward(a_.scratch.data(), G(ParamKind::attn_c_proj_weight, l), G(ParamKind::attn_c_proj_bias, l), dres,
                      A.atty.data(), P(ParamKind::attn_c_proj_weight, l), N, C, C);
      ops_.attention_backward(a_.dqkv.data(), a_.scratch.data(), A.qkv.data(), A.atty.data(), A.lse.data(), B, T_, C,
                              NH);
      linear_backward(dln, G(ParamKind::attn_c_attn_weight, l), G(ParamKind::attn_c_attn_bias, l), a_.dqkv.data(),
                      A.ln1.data(), P(ParamKind::attn_c_attn_weight, l), N, C, 3 * C);
      ops_.layernorm_backward(dres, G(ParamKind::ln_1_weight, l), G(ParamKind::ln_1_bias, l), dln, x,
                              P(ParamKind::ln_1_weight, l), A.ln1_mean.data(), A.ln1_rstd.data(), N, C);
      detail::call(hooks.after_backward, 1 + l);
      // dres holds d(x) = d(res3 of layer l-1)
    }
    detail::call(hooks.before_backward, 0);
    ops_.embedding_backward(G(ParamKind::wte), G(ParamKind::wpe), dres, a_.tokens.data(), B, T_, C);
    detail::call(hooks.after_backward, 0);  // wte (which a tied head also wrote) and wpe
  }

  // [B, T, Vp] logits of the last forward WITHOUT targets (with targets they were replaced
  // by d-logits). Columns >= vocab are padding. Device memory on Cuda: logits_to_host().
  std::span<const T> logits() const {
    if (has_dlogits_)
      throw std::logic_error("GPT::logits: the last forward had targets, its logits were replaced by d-logits");
    return {a_.logits.data(), static_cast<std::size_t>(B_) * static_cast<std::size_t>(Tseq_) * Vp};
  }
  std::vector<T> logits_to_host() const { return ops_.to_host(logits()); }
  int batch() const { return B_; }
  int seq() const { return Tseq_; }

  // ---- safetensors, with Hugging Face GPT-2 names and shapes -------------------------------

  // Writes every tensor with its HF name in T's dtype (F32, F64 or BF16); wte (and lm_head)
  // without the padded vocabulary rows. Atomic (write "<path>.tmp", rename). See
  // nn/checkpoint.hpp.
  void save(const std::filesystem::path& path, const std::map<std::string, std::string>& metadata = {}) const {
    ops_.read_to_host(params_, [&](std::span<const T> params) { save_gpt<layout>(path, params, metadata); });
  }

  // Reads HF GPT-2 weights (names with or without "transformer.", any floating dtype; see
  // nn/checkpoint.hpp). A missing, mis-shaped or unknown tensor is an io::SafetensorsError
  // naming it, and the model is left unchanged.
  void load(const std::filesystem::path& path) { load(io::SafetensorsFile::read(path)); }
  void load(const io::SafetensorsFile& f) {
    // Every element is written (the tensors tile the buffer): on Cuda the host copy is
    // uploaded only once all of it has been read, and not at all when the file is refused.
    ops_.write_from_host(params_, [&](std::span<T> params) { load_gpt<layout>(f, params, describe()); });
  }

  static std::string describe() {
    return std::to_string(L) + " layers, d_model " + std::to_string(C) + ", " + std::to_string(NH) + " heads, vocab " +
           std::to_string(V) + ", max_seq " + std::to_string(max_seq) + (layout::tied ? ", tied" : ", untied");
  }

 private:
  struct LayerActs {
    Buffer<T, Device> ln1, qkv, atty, res2, ln2, fch, fch_gelu, res3;
    Buffer<stat_t, Device> ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, lse;
  };
  struct Acts {
    std::size_t capacity = 0;  // B*T the buffers hold
    Buffer<int, Device> tokens, targets;  // the last forward's ids (backward needs the tokens)
    Buffer<T, Device> encoded, lnf, logits, scratch, dres, dln, dqkv, dfch;
    Buffer<stat_t, Device> lnf_mean, lnf_rstd, ce_max, ce_sumexp, ce_target;
    Buffer<float, Device> losses;
    std::vector<LayerActs> layer;
  };

  void reserve(int B, int T_) {
    const std::size_t n = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    if (n <= a_.capacity) return;
    const std::size_t c = static_cast<std::size_t>(C), f = static_cast<std::size_t>(F);
    Acts a;
    a.capacity = n;
    a.tokens = make<int>(n);
    a.targets = make<int>(n);
    a.encoded = make<T>(n * c);
    a.lnf = make<T>(n * c);
    a.logits = make<T>(n * static_cast<std::size_t>(Vp));
    a.scratch = make<T>(n * c);
    a.dres = make<T>(n * c);
    a.dln = make<T>(n * c);
    a.dqkv = make<T>(n * 3 * c);
    a.dfch = make<T>(n * f);
    a.lnf_mean = make<stat_t>(n);
    a.lnf_rstd = make<stat_t>(n);
    a.ce_max = make<stat_t>(n);
    a.ce_sumexp = make<stat_t>(n);
    a.ce_target = make<stat_t>(n);
    a.losses = make<float>(n);
    a.layer.resize(static_cast<std::size_t>(L));
    for (LayerActs& A : a.layer) {
      A.ln1 = make<T>(n * c);
      A.qkv = make<T>(n * 3 * c);
      A.atty = make<T>(n * c);
      A.res2 = make<T>(n * c);
      A.ln2 = make<T>(n * c);
      A.fch = make<T>(n * f);
      A.fch_gelu = make<T>(n * f);
      A.res3 = make<T>(n * c);
      A.ln1_mean = make<stat_t>(n);
      A.ln1_rstd = make<stat_t>(n);
      A.ln2_mean = make<stat_t>(n);
      A.ln2_rstd = make<stat_t>(n);
      A.lse = make<stat_t>(n * static_cast<std::size_t>(NH));
    }
    a_ = std::move(a);
  }

  template <class U>
  Buffer<U, Device> make(std::size_t n) {
    return ops_.template make_buffer<U>(n);
  }

  // y[N, out] = x[N, in] · W[in, out] + b:  dx = dy · W^T (=),  dW += x^T · dy,  db += colsum(dy).
  void linear_backward(T* dx, T* dW, T* db, const T* dy, const T* x, const T* W, int N, int in, int out) {
    ops_.matmul(dx, dy, W, static_cast<const T*>(nullptr), N, in, out, false, true);
    ops_.matmul(dW, x, dy, static_cast<const T*>(nullptr), in, out, N, true, false, true);
    ops_.bias_backward(db, dy, N, out);
  }

  // Token ids are checked on the host before they go to a device (whose kernels cannot throw).
  static void check_ids(const char* what, const int* ids, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
      if (ids[i] < 0 || ids[i] >= V)
        throw std::invalid_argument(std::string("GPT::forward: ") + what + "[" + std::to_string(i) + "] = " +
                                    std::to_string(ids[i]) + " is outside [0, vocab = " + std::to_string(V) + ")");
  }

  static int index_of(std::string_view name) {
    auto i = layout::find(name);
    if (!i) throw std::invalid_argument("GPT: no parameter named '" + std::string(name) + "' (" + describe() + ")");
    return *i;
  }
  template <class Buf>
  static auto view(Buf& b, int i) {
    using E = std::remove_reference_t<decltype(*b.data())>;
    const ParamInfo& t = layout::tensors[static_cast<std::size_t>(i)];
    return TensorView<E>{&t, std::span<E>(b.data() + t.offset, t.size())};
  }

  ops_type ops_;  // first: the buffers below are made by it
  Buffer<T, Device> params_, grads_;
  Acts a_;
  int B_ = 0, Tseq_ = 0;
  bool has_dlogits_ = false;
  mutable bool loss_pending_ = false;  // the statistics of the last forward are not summed yet
  mutable double loss_ = 0;
};

}  // namespace fived
