#pragma once
// GPT-2 style decoder on one device: explicit forward and backward over the host reference
// kernels (fived/kernels/host.hpp), parameters and gradients in one flat buffer each, laid
// out at compile time (nn/layout.hpp).
//
//   struct tiny : fived::gpt_config { static constexpr int layers = 2, d_model = 64, heads = 4,
//                                     vocab = 256, max_seq = 64; };
//   fived::GPT<tiny> model(fived::GptInit{.seed = 42});
//   float loss = model.forward(tokens, targets, B, T);   // mean cross-entropy over B*T
//   model.zero_grad(); model.backward();                 // grads accumulate until zero_grad()
//   // update model.params() from model.grads() (e.g. kernels::host::adamw_update)
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
// Device: only Host exists. The Device parameter is the seam for the CUDA issue: a
// GPT<Cfg, T, Cuda> will keep this algorithm and call kernels::cuda on Buffer<T, Cuda>.

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
#include "fived/kernels/host.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/init.hpp"
#include "fived/nn/layout.hpp"

namespace fived {

// A named tensor inside a flat buffer.
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
  static_assert(std::is_same_v<Device, Host>,
                "GPT<Cfg, T, Device>: only the Host device exists so far (the CUDA model comes with the CUDA kernels)");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>,
                "GPT<Cfg, T>: the element type must be float, double (gradient checks) or fived::bf16");

 public:
  using config = Cfg;
  using dims = gpt_dims<Cfg>;
  using layout = GptLayout<Cfg>;
  using value_type = T;
  using device = Device;
  using acc = acc_t<T>;

  static constexpr int L = dims::layers;
  static constexpr int C = dims::d_model;
  static constexpr int NH = dims::heads;
  static constexpr int V = dims::vocab;
  static constexpr int Vp = dims::padded_vocab;
  static constexpr int F = dims::d_ff;
  static constexpr int max_seq = dims::max_seq;
  static constexpr std::size_t num_params = layout::size;  // buffer elements, padding included

  explicit GPT(const GptInit& init = {}) : params_(num_params), grads_(num_params) { init_gpt<Cfg>(params_.span(), init); }

  // ---- parameters and gradients ----------------------------------------------------------

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

  void zero_grad() { grads_.zero(); }

  // ---- forward / backward ------------------------------------------------------------------

  // tokens and targets are [B, T] token ids in [0, vocab). Returns the mean loss over B*T
  // (0 when targets is nullptr). With targets, d-logits for backward() are computed too.
  float forward(const int* tokens, const int* targets, int B, int T_) {
    namespace K = kernels::host;
    if (B < 1 || T_ < 1 || T_ > max_seq)
      throw std::invalid_argument("GPT::forward: needs B >= 1 and 1 <= T <= max_seq = " + std::to_string(max_seq) +
                                  " (got B=" + std::to_string(B) + ", T=" + std::to_string(T_) + ")");
    if (tokens == nullptr) throw std::invalid_argument("GPT::forward: tokens is nullptr");
    reserve(B, T_);
    B_ = B;
    Tseq_ = T_;
    const int N = B * T_;
    const std::size_t sN = static_cast<std::size_t>(N);
    tokens_.assign(tokens, tokens + sN);
    has_dlogits_ = false;
    loss_ = 0;

    const T* p = params_.data();
    auto P = [&](ParamKind k, int l = -1) { return p + layout::offset(k, l); };

    K::embedding_forward(a_.encoded.data(), tokens, P(ParamKind::wte), P(ParamKind::wpe), B, T_, C, V);
    const T* x = a_.encoded.data();
    for (int l = 0; l < L; ++l) {
      LayerActs& A = a_.layer[static_cast<std::size_t>(l)];
      K::layernorm_forward(A.ln1.data(), A.ln1_mean.data(), A.ln1_rstd.data(), x, P(ParamKind::ln_1_weight, l),
                           P(ParamKind::ln_1_bias, l), N, C);
      K::matmul(A.qkv.data(), A.ln1.data(), P(ParamKind::attn_c_attn_weight, l), P(ParamKind::attn_c_attn_bias, l), N,
                3 * C, C, false, false);
      K::attention_forward(A.atty.data(), A.lse.data(), A.qkv.data(), B, T_, C, NH);
      K::matmul(a_.scratch.data(), A.atty.data(), P(ParamKind::attn_c_proj_weight, l),
                P(ParamKind::attn_c_proj_bias, l), N, C, C, false, false);
      K::residual_forward(A.res2.data(), x, a_.scratch.data(), sN * C);
      K::layernorm_forward(A.ln2.data(), A.ln2_mean.data(), A.ln2_rstd.data(), A.res2.data(),
                           P(ParamKind::ln_2_weight, l), P(ParamKind::ln_2_bias, l), N, C);
      K::matmul(A.fch_gelu.data(), A.ln2.data(), P(ParamKind::mlp_c_fc_weight, l), P(ParamKind::mlp_c_fc_bias, l), N,
                F, C, false, false, false, K::Epilogue::gelu, A.fch.data());
      K::matmul(a_.scratch.data(), A.fch_gelu.data(), P(ParamKind::mlp_c_proj_weight, l),
                P(ParamKind::mlp_c_proj_bias, l), N, C, F, false, false);
      K::residual_forward(A.res3.data(), A.res2.data(), a_.scratch.data(), sN * C);
      x = A.res3.data();
    }
    K::layernorm_forward(a_.lnf.data(), a_.lnf_mean.data(), a_.lnf_rstd.data(), x, P(ParamKind::ln_f_weight),
                         P(ParamKind::ln_f_bias), N, C);
    // logits[N, Vp] = lnf[N, C] · head^T, head stored [Vp, C]
    K::matmul(a_.logits.data(), a_.lnf.data(), P(layout::head_kind), static_cast<const T*>(nullptr), N, Vp, C, false,
              true);
    if (targets == nullptr) return 0.0f;

    // Fused loss + d-logits (written over the logits), in the three steps of the
    // vocab-parallel contract so the loss keeps acc_t precision (double in gradient checks).
    K::logits_max(a_.ce_max.data(), a_.logits.data(), N, Vp, 0, V);
    K::crossentropy_partials(a_.ce_sumexp.data(), a_.ce_target.data(), a_.logits.data(), targets, a_.ce_max.data(), N,
                             Vp, 0, V);
    const float dloss = 1.0f / static_cast<float>(N);
    K::crossentropy_backward(a_.losses.data(), a_.logits.data(), a_.logits.data(), targets, a_.ce_max.data(),
                             a_.ce_sumexp.data(), a_.ce_target.data(), N, Vp, 0, V, dloss);
    double sum = 0;
    for (std::size_t i = 0; i < sN; ++i)
      sum += std::log(static_cast<double>(a_.ce_sumexp[i])) + static_cast<double>(a_.ce_max[i]) -
             static_cast<double>(a_.ce_target[i]);
    loss_ = sum / static_cast<double>(N);
    has_dlogits_ = true;
    return static_cast<float>(loss_);
  }

  // The mean loss of the last forward with targets, in acc_t precision (double for T = double).
  double loss() const { return loss_; }

  // Accumulates the gradient of the last forward's mean loss into grads().
  void backward() {
    namespace K = kernels::host;
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
    K::matmul(dln, dlogits, P(layout::head_kind), static_cast<const T*>(nullptr), N, C, Vp, false, false);
    K::matmul(G(layout::head_kind), dlogits, a_.lnf.data(), static_cast<const T*>(nullptr), Vp, C, N, true, false, true);
    a_.dres.zero();
    const T* x_last = L > 0 ? a_.layer[static_cast<std::size_t>(L - 1)].res3.data() : a_.encoded.data();
    K::layernorm_backward(dres, G(ParamKind::ln_f_weight), G(ParamKind::ln_f_bias), dln, x_last,
                          P(ParamKind::ln_f_weight), a_.lnf_mean.data(), a_.lnf_rstd.data(), N, C);

    for (int l = L - 1; l >= 0; --l) {
      LayerActs& A = a_.layer[static_cast<std::size_t>(l)];
      const T* x = l == 0 ? a_.encoded.data() : a_.layer[static_cast<std::size_t>(l - 1)].res3.data();
      // dres holds d(res3). MLP projection: y = fch_gelu · Wp + bp
      linear_backward(a_.dfch.data(), G(ParamKind::mlp_c_proj_weight, l), G(ParamKind::mlp_c_proj_bias, l), dres,
                      A.fch_gelu.data(), P(ParamKind::mlp_c_proj_weight, l), N, F, C);
      K::gelu_backward(a_.dfch.data(), A.fch.data(), a_.dfch.data(), static_cast<std::size_t>(N) * F);
      linear_backward(dln, G(ParamKind::mlp_c_fc_weight, l), G(ParamKind::mlp_c_fc_bias, l), a_.dfch.data(),
                      A.ln2.data(), P(ParamKind::mlp_c_fc_weight, l), N, C, F);
      K::layernorm_backward(dres, G(ParamKind::ln_2_weight, l), G(ParamKind::ln_2_bias, l), dln, A.res2.data(),
                            P(ParamKind::ln_2_weight, l), A.ln2_mean.data(), A.ln2_rstd.data(), N, C);
      // dres holds d(res2). Attention projection, attention, qkv projection.
      linear_backward(a_.scratch.data(), G(ParamKind::attn_c_proj_weight, l), G(ParamKind::attn_c_proj_bias, l), dres,
                      A.atty.data(), P(ParamKind::attn_c_proj_weight, l), N, C, C);
      K::attention_backward(a_.dqkv.data(), a_.scratch.data(), A.qkv.data(), A.atty.data(), A.lse.data(), B, T_, C, NH);
      linear_backward(dln, G(ParamKind::attn_c_attn_weight, l), G(ParamKind::attn_c_attn_bias, l), a_.dqkv.data(),
                      A.ln1.data(), P(ParamKind::attn_c_attn_weight, l), N, C, 3 * C);
      K::layernorm_backward(dres, G(ParamKind::ln_1_weight, l), G(ParamKind::ln_1_bias, l), dln, x,
                            P(ParamKind::ln_1_weight, l), A.ln1_mean.data(), A.ln1_rstd.data(), N, C);
      // dres holds d(x) = d(res3 of layer l-1)
    }
    K::embedding_backward(G(ParamKind::wte), G(ParamKind::wpe), dres, tokens_.data(), B, T_, C);
  }

  // [B, T, Vp] logits of the last forward WITHOUT targets (with targets they were replaced
  // by d-logits). Columns >= vocab are padding.
  std::span<const T> logits() const {
    if (has_dlogits_)
      throw std::logic_error("GPT::logits: the last forward had targets, its logits were replaced by d-logits");
    return {a_.logits.data(), static_cast<std::size_t>(B_) * static_cast<std::size_t>(Tseq_) * Vp};
  }
  int batch() const { return B_; }
  int seq() const { return Tseq_; }

  // ---- safetensors, with Hugging Face GPT-2 names and shapes -------------------------------

  // Writes every tensor with its HF name in T's dtype (F32, F64 or BF16); wte (and lm_head)
  // without the padded vocabulary rows. Atomic (write "<path>.tmp", rename).
  void save(const std::filesystem::path& path, const std::map<std::string, std::string>& metadata = {}) const {
    io::SafetensorsWriter w;
    for (const ParamInfo& t : layout::tensors) {
      std::vector<std::int64_t> shape = t.rank == 2 ? std::vector<std::int64_t>{t.file_rows, t.cols}
                                                    : std::vector<std::int64_t>{t.file_rows};
      w.add(t.name(), std::move(shape), params_.span().subspan(t.offset, t.file_size()));
    }
    w.add_metadata("format", "pt");
    for (const auto& [k, v] : metadata) w.add_metadata(k, v);
    w.write(path);
  }

  // Reads HF GPT-2 weights: names with or without the "transformer." prefix; HF's attention
  // mask buffers (h.{i}.attn.bias, h.{i}.attn.masked_bias) and, in a tied model, lm_head.weight
  // are ignored; any floating dtype is converted. Everything is checked before anything is
  // written: a missing, mis-shaped or unknown tensor is an io::SafetensorsError naming it, and
  // the model is left unchanged.
  void load(const std::filesystem::path& path) { load(io::SafetensorsFile::read(path)); }
  void load(const io::SafetensorsFile& f) {
    std::vector<const io::TensorEntry*> found(layout::count, nullptr);
    for (const io::TensorEntry& e : f.tensors()) {
      std::string_view n = e.name;
      if (n.substr(0, 12) == "transformer.") n.remove_prefix(12);
      if (is_hf_buffer(n)) continue;
      if (layout::tied && n == "lm_head.weight") continue;  // HF may store the tied copy of wte
      auto idx = layout::find(n);
      if (!idx)
        throw io::SafetensorsError(f.source() + ": tensor '" + e.name + "' is not a parameter of this model (" +
                                   describe() + ")");
      if (found[static_cast<std::size_t>(*idx)])
        throw io::SafetensorsError(f.source() + ": tensors '" + found[static_cast<std::size_t>(*idx)]->name +
                                   "' and '" + e.name + "' are the same parameter");
      found[static_cast<std::size_t>(*idx)] = &e;
    }
    for (int i = 0; i < layout::count; ++i) {
      const ParamInfo& t = layout::tensors[static_cast<std::size_t>(i)];
      const std::vector<std::int64_t> want = t.rank == 2 ? std::vector<std::int64_t>{t.file_rows, t.cols}
                                                         : std::vector<std::int64_t>{t.file_rows};
      const io::TensorEntry* e = found[static_cast<std::size_t>(i)];
      if (!e)
        throw io::SafetensorsError(f.source() + ": tensor '" + t.name() + "' is missing (the model expects " +
                                   io::shape_string(want) + ")");
      if (e->shape != want)
        throw io::SafetensorsError(f.source() + ": " + t.name() + " has shape " + io::shape_string(e->shape) +
                                   " in the file, the model expects " + io::shape_string(want));
      if (!io::is_floating(e->dtype))
        throw io::SafetensorsError(f.source() + ": " + t.name() + " is " + std::string(io::dtype_name(e->dtype)) +
                                   ", the model needs a floating-point dtype");
    }
    for (int i = 0; i < layout::count; ++i) {
      const ParamInfo& t = layout::tensors[static_cast<std::size_t>(i)];
      f.read_into(*found[static_cast<std::size_t>(i)], params_.span().subspan(t.offset, t.file_size()));
      for (std::size_t j = t.offset + t.file_size(); j < t.end(); ++j) params_[j] = T{};  // padded rows
    }
  }

  static std::string describe() {
    return std::to_string(L) + " layers, d_model " + std::to_string(C) + ", " + std::to_string(NH) + " heads, vocab " +
           std::to_string(V) + ", max_seq " + std::to_string(max_seq) + (layout::tied ? ", tied" : ", untied");
  }

 private:
  struct LayerActs {
    Buffer<T, Device> ln1, qkv, atty, res2, ln2, fch, fch_gelu, res3;
    Buffer<acc, Device> ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, lse;
  };
  struct Acts {
    std::size_t capacity = 0;  // B*T the buffers hold
    Buffer<T, Device> encoded, lnf, logits, scratch, dres, dln, dqkv, dfch;
    Buffer<acc, Device> lnf_mean, lnf_rstd, ce_max, ce_sumexp, ce_target;
    Buffer<float, Device> losses;
    std::vector<LayerActs> layer;
  };

  void reserve(int B, int T_) {
    const std::size_t n = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    if (n <= a_.capacity) return;
    const std::size_t c = static_cast<std::size_t>(C), f = static_cast<std::size_t>(F);
    Acts a;
    a.capacity = n;
    a.encoded = Buffer<T, Device>(n * c);
    a.lnf = Buffer<T, Device>(n * c);
    a.logits = Buffer<T, Device>(n * static_cast<std::size_t>(Vp));
    a.scratch = Buffer<T, Device>(n * c);
    a.dres = Buffer<T, Device>(n * c);
    a.dln = Buffer<T, Device>(n * c);
    a.dqkv = Buffer<T, Device>(n * 3 * c);
    a.dfch = Buffer<T, Device>(n * f);
    a.lnf_mean = Buffer<acc, Device>(n);
    a.lnf_rstd = Buffer<acc, Device>(n);
    a.ce_max = Buffer<acc, Device>(n);
    a.ce_sumexp = Buffer<acc, Device>(n);
    a.ce_target = Buffer<acc, Device>(n);
    a.losses = Buffer<float, Device>(n);
    a.layer.resize(static_cast<std::size_t>(L));
    for (LayerActs& A : a.layer) {
      A.ln1 = Buffer<T, Device>(n * c);
      A.qkv = Buffer<T, Device>(n * 3 * c);
      A.atty = Buffer<T, Device>(n * c);
      A.res2 = Buffer<T, Device>(n * c);
      A.ln2 = Buffer<T, Device>(n * c);
      A.fch = Buffer<T, Device>(n * f);
      A.fch_gelu = Buffer<T, Device>(n * f);
      A.res3 = Buffer<T, Device>(n * c);
      A.ln1_mean = Buffer<acc, Device>(n);
      A.ln1_rstd = Buffer<acc, Device>(n);
      A.ln2_mean = Buffer<acc, Device>(n);
      A.ln2_rstd = Buffer<acc, Device>(n);
      A.lse = Buffer<acc, Device>(n * static_cast<std::size_t>(NH));
    }
    a_ = std::move(a);
  }

  // y[N, out] = x[N, in] · W[in, out] + b:  dx = dy · W^T (=),  dW += x^T · dy,  db += colsum(dy).
  static void linear_backward(T* dx, T* dW, T* db, const T* dy, const T* x, const T* W, int N, int in, int out) {
    namespace K = kernels::host;
    K::matmul(dx, dy, W, static_cast<const T*>(nullptr), N, in, out, false, true);
    K::matmul(dW, x, dy, static_cast<const T*>(nullptr), in, out, N, true, false, true);
    K::bias_backward(db, dy, N, out);
  }

  // HF GPT2Attention's causal-mask buffers: "h.{i}.attn.bias", "h.{i}.attn.masked_bias".
  static bool is_hf_buffer(std::string_view n) {
    if (n.substr(0, 2) != "h.") return false;
    const std::size_t dot = n.find('.', 2);
    if (dot == std::string_view::npos) return false;
    const std::string_view rest = n.substr(dot + 1);
    return rest == "attn.bias" || rest == "attn.masked_bias";
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

  Buffer<T, Device> params_, grads_;
  Acts a_;
  std::vector<int> tokens_;
  int B_ = 0, Tseq_ = 0;
  bool has_dlogits_ = false;
  double loss_ = 0;
};

}  // namespace fived
