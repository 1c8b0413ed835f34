#pragma once
// The reference GPT (nn/gpt.hpp) split over the TP axis of a mesh, Megatron
// style, on the host backend:
//
//   using M = fived::Mesh<fived::TP<2>>;
//   fived::host::run(M::size, [&](fived::host::Comm& world) {
//     auto ctx = fived::make_mesh_context<M>(world);
//     auto& tp = ctx.comm<fived::Axis::tp>();
//     nn::tp::GPT<cfg, M, nn::tp::SequenceParallel> model(ctx.coord(), GptInit{.seed = 1});
//     fived::AdamW<decltype(model)::layout> opt(hp);       // over this rank's shard
//     model.zero_grad();
//     float loss = model.forward(tokens, targets, B, T, tp); // the same on every TP rank
//     model.backward(tp);
//     model.optimizer_step(opt, tp);                        // clip (global norm), AdamW
//   });
//
// Every rank holds one flat parameter buffer and one gradient buffer laid out by
// TpGptLayout<Cfg, TP> (nn/tp/layout.hpp); the layers are views of them. Each
// element starts at the value the serial model gives it (the initialisation is
// by element), so a TP run starts from the serial weights.
//
// The residual stream is placed Replicate on TP, or Shard<1> (the sequence)
// with SequenceParallel, and every layer's types agree with it (Chain):
//
//   x   = VocabParallelEmbedding(tokens) + wpe         all-reduce | reduce-scatter
//   per block:
//     x = x + Attention(LayerNorm(x))                   see nn/tp/attention.hpp
//     x = x + MLP(LayerNorm(x))                         see nn/tp/mlp.hpp
//   logits = VocabParallelHead(LayerNorm(x))            Shard<2>: never gathered
//   loss   = VocabParallelCrossEntropy(logits)          3 all-reduces of [B*T]
//
// Per block, Megatron's counts: without SP 2 all-reduces forward and 2
// backward; with SP 2 all-gathers + 2 reduce-scatters each way. With SP the
// gradients of the replicated parameters (wpe, LayerNorms, c_proj biases) are
// partial sums over the sequence shards: they accumulate in one packed buffer
// and are reduced over TP by ONE all-reduce at the end of backward().
//
// Save and load use the serial model's safetensors format (nn/checkpoint.hpp):
// save gathers the pieces over TP and rank 0 of the group writes; load reads the
// whole file on every rank and keeps its piece.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/comm/communicator.hpp"
#include "fived/io/safetensors.hpp"
#include "fived/kernels/host/norm.hpp"
#include "fived/kernels/host/residual.hpp"
#include "fived/nn/checkpoint.hpp"
#include "fived/nn/init.hpp"
#include "fived/nn/tp/attention.hpp"
#include "fived/nn/tp/layernorm.hpp"
#include "fived/nn/tp/layout.hpp"
#include "fived/nn/tp/mlp.hpp"
#include "fived/nn/tp/vocab.hpp"
#include "fived/optim/adamw.hpp"

namespace fived::nn::tp {

// Sequence parallelism as a policy: the residual stream, LayerNorms and
// residual adds are split over TP along the sequence.
struct SequenceParallel {
  static constexpr bool enabled = true;
};
struct NoSequenceParallel {
  static constexpr bool enabled = false;
};

template <class Cfg, MeshType M, class SeqPolicy = NoSequenceParallel, class T = float>
class GPT {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "nn::tp::GPT: the element type must be float or double (the communicators move these)");

 public:
  static constexpr int tp_size = M::extent(Axis::tp);
  static constexpr bool sequence_parallel = SeqPolicy::enabled;
  using config = Cfg;
  using mesh = M;
  using value_type = T;
  using layout = TpGptLayout<Cfg, tp_size>;  // this rank's buffers (checks heads, d_ff, vocab)
  using serial_layout = GptLayout<Cfg>;
  static constexpr bool on_host = true;
  static constexpr int L = layout::L;
  static constexpr std::int64_t C = layout::C, V = layout::V, Vp = layout::Vp, F = layout::F;
  static constexpr int max_seq = gpt_dims<Cfg>::max_seq;

  using stream_placement = std::conditional_t<sequence_parallel, Shard<1>, Replicate>;
  using Stream = Activation<T, M, stream_placement>;
  using Embedding = VocabParallelEmbedding<M, sequence_parallel, T>;
  using Norm = LayerNorm<M, sequence_parallel, T>;
  using Attn = Attention<M, gpt_dims<Cfg>::heads, sequence_parallel, T>;
  using Mlp = MLP<M, sequence_parallel, T>;
  using Head = VocabParallelHead<M, sequence_parallel, T>;
  static_assert(std::is_same_v<typename Embedding::output_type, Stream> && std::is_same_v<typename Norm::input_type, Stream> &&
                std::is_same_v<typename Attn::input_type, Stream> && std::is_same_v<typename Attn::output_type, Stream> &&
                std::is_same_v<typename Mlp::input_type, Stream> && std::is_same_v<typename Head::input_type, Stream>);

  // Initialised as the serial GPT<Cfg> with the same GptInit: this rank's piece
  // of each tensor, element by element.
  explicit GPT(Coord coord, const GptInit& init = {}) : GPT(coord, 0) {
    for (int i = 0; i < layout::count; ++i) {
      const ParamInfo& lt = layout::tensors[static_cast<std::size_t>(i)];
      const ParamInfo& gt = serial_layout::tensors[static_cast<std::size_t>(i)];
      for (std::size_t j = 0; j < lt.size(); ++j)
        params_[lt.offset + j] = static_cast<T>(init_value(
            gt, L, init, static_cast<std::size_t>(layout::global_index(i, rank(), static_cast<std::int64_t>(j)))));
    }
  }
  // This rank's piece of a serial model's flat parameter buffer.
  GPT(Coord coord, std::span<const T> serial_params) : GPT(coord, 0) { layout::slice(serial_params, params(), rank()); }

  GPT(const GPT&) = delete;  // the layers view the buffers
  GPT& operator=(const GPT&) = delete;

  std::span<T> params() { return params_; }
  std::span<const T> params() const { return params_; }
  std::span<T> grads() { return grads_; }
  std::span<const T> grads() const { return grads_; }
  const Coord& coord() const { return coord_; }
  int rank() const { return coord_[Axis::tp]; }

  void zero_grad() { std::fill(grads_.begin(), grads_.end(), T{}); }

  // tokens and targets: [B, T] ids in [0, vocab), the same on every TP rank. With
  // SP the sequence length must be a multiple of TP. Returns the mean loss over
  // B*T (0 without targets; then logits() holds this rank's [B, T, Vp/TP]).
  template <Communicator Comm>
  float forward(const int* tokens, const int* targets, int B, int T_, Comm& tp) {
    check_batch(B, T_);
    if (tokens == nullptr) throw std::invalid_argument("nn::tp::GPT::forward: tokens is nullptr");
    const std::size_t n = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    for (std::size_t i = 0; i < n; ++i)
      if (tokens[i] < 0 || tokens[i] >= V || (targets && (targets[i] < 0 || targets[i] >= V)))
        throw std::invalid_argument("nn::tp::GPT::forward: id at position " + std::to_string(i) +
                                    " is outside [0, vocab = " + std::to_string(V) + ")");
    has_dlogits_ = false;
    loss_ = 0;
    B_ = B;

    Stream x = embedding_->forward(std::span<const int>(tokens, n), B, T_, tp);
    add_positions(x);
    for (int l = 0; l < L; ++l) {
      Block& b = blocks_[static_cast<std::size_t>(l)];
      add_into(x, b.attn.forward(b.ln_1.forward(x), tp));
      add_into(x, b.mlp.forward(b.ln_2.forward(x), tp));
    }
    logits_.emplace(head_->forward(ln_f_->forward(x), tp));
    if (targets == nullptr) return 0.0f;
    loss_ = ce_.forward_backward(*logits_, std::span<const int>(targets, n), tp);  // logits -> d-logits
    has_dlogits_ = true;
    return static_cast<float>(loss_);
  }

  // The mean loss of the last forward with targets, in acc_t precision summed in double.
  double loss() const { return loss_; }

  // Accumulates the gradient of the last forward's mean loss into grads().
  template <Communicator Comm>
  void backward(Comm& tp) {
    if (!has_dlogits_)
      throw std::logic_error("nn::tp::GPT::backward: call forward(tokens, targets, B, T, tp) with targets first");
    has_dlogits_ = false;
    const Stream dlnf = head_->backward(*logits_, tp);
    Stream dx(dlnf.layout(), std::vector<T>(dlnf.local().size(), T{}));
    ln_f_->backward(dlnf, dx);
    for (int l = L - 1; l >= 0; --l) {  // dx: the gradient of the residual stream after block l
      Block& b = blocks_[static_cast<std::size_t>(l)];
      b.ln_2.backward(b.mlp.backward(dx, tp), dx);
      b.ln_1.backward(b.attn.backward(dx, tp), dx);
    }
    position_grads(dx);
    embedding_->backward(dx, tp);
    if constexpr (sequence_parallel) reduce_partial_grads(tp);
  }

  // The logits of the last forward without targets: [B, T, Vp] placed Shard<2>.
  const Activation<T, M, Shard<2>>& logits() const {
    if (!logits_ || has_dlogits_)
      throw std::logic_error("nn::tp::GPT::logits: needs a forward without targets (with targets they became d-logits)");
    return *logits_;
  }

  // ---- the whole model, serial layout --------------------------------------------------

  // The serial flat buffers (GptLayout<Cfg>) of the parameters or gradients, on every rank.
  template <Communicator Comm>
  std::vector<T> gather_params(Comm& tp) const { return gather(params_, tp); }
  template <Communicator Comm>
  std::vector<T> gather_grads(Comm& tp) const { return gather(grads_, tp); }

  // The parts of r (offsets of this rank's buffer) whose gradients this rank counts in the
  // global norm, so that the TP group counts every parameter once: every piece of a split
  // tensor, and a replicated tensor (identical on every rank) on TP rank 0 only.
  std::vector<FlatRange> norm_parts(FlatRange r) const {
    std::vector<FlatRange> parts;
    for (int i = 0; i < layout::count; ++i) {
      const ParamInfo& t = layout::tensors[static_cast<std::size_t>(i)];
      const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
      if (b >= e || (layout::split(i).replicated() && rank() != 0)) continue;
      if (!parts.empty() && parts.back().end == b) parts.back().end = e;
      else parts.push_back({b, e});
    }
    return parts;
  }

  // Sum of squares of the gradient elements in r (`grads` may be a copy, e.g. a DP-reduced
  // one) over the whole TP group, every parameter once (norm_parts). One all-reduce; the
  // same on every rank of the group.
  template <Communicator Comm>
  double grad_sum_of_squares(std::span<const T> grads, FlatRange r, Comm& tp) const {
    if (r.end > grads.size() || r.begin > r.end)
      throw std::invalid_argument("nn::tp::GPT::grad_sum_of_squares: range outside the gradient buffer");
    double s = 0;
    for (const FlatRange& p : norm_parts(r)) s += kernels::host::sum_of_squares(grads.data() + p.begin, p.size());
    tp.all_reduce(std::span<const double>(&s, 1), std::span<double>(&s, 1), ReduceOp::sum);
    return s;
  }

  // Clips the gradient to opt.hp.max_norm (global norm over the TP group) and
  // takes one AdamW step on this rank's buffers. Returns the clip factor.
  template <Communicator Comm>
  float optimizer_step(AdamW<layout, T>& opt, Comm& tp) {
    const FlatRange all{0, layout::size};
    float f = 1.0f;
    if (opt.hp.max_norm > 0) f = opt.clip(grads(), all, grad_sum_of_squares(std::span<const T>(grads_), all, tp));
    opt.step(params(), std::span<const T>(grads()), all);
    return f;
  }

  // The serial model's safetensors file (nn/checkpoint.hpp): gathered over TP,
  // written by TP rank 0; every rank returns when the file is complete.
  template <Communicator Comm>
  void save(const std::filesystem::path& path, Comm& tp, const std::map<std::string, std::string>& metadata = {}) const {
    const std::vector<T> all = gather_params(tp);
    if (rank() == 0) save_gpt<serial_layout>(path, std::span<const T>(all), metadata);
    tp.barrier();
  }
  // Reads a serial model's file (or a TP model's: the same format) and keeps this
  // rank's piece. Checked before anything changes, as GPT::load.
  void load(const std::filesystem::path& path) { load(io::SafetensorsFile::read(path)); }
  void load(const io::SafetensorsFile& f) {
    std::vector<T> serial(serial_layout::size);
    load_gpt<serial_layout>(f, std::span<T>(serial), "tensor-parallel GPT over " + M::name());
    layout::slice(std::span<const T>(serial), params(), rank());
  }

 private:
  struct Block {
    Norm ln_1;
    Attn attn;
    Norm ln_2;
    Mlp mlp;
  };

  GPT(Coord coord, int)
      : coord_(coord), params_(layout::size), grads_(layout::size),
        partial_grads_(sequence_parallel ? layout::replicated_size : 0) {
    embedding_.emplace(Vp, C, slot(ParamKind::wte), coord);
    blocks_.reserve(static_cast<std::size_t>(L));
    for (int l = 0; l < L; ++l)
      blocks_.push_back(Block{
          Norm(C, slot(ParamKind::ln_1_weight, l), slot(ParamKind::ln_1_bias, l), coord),
          Attn(C, slot(ParamKind::attn_c_attn_weight, l), slot(ParamKind::attn_c_attn_bias, l),
               slot(ParamKind::attn_c_proj_weight, l), slot(ParamKind::attn_c_proj_bias, l), coord),
          Norm(C, slot(ParamKind::ln_2_weight, l), slot(ParamKind::ln_2_bias, l), coord),
          Mlp(C, F, slot(ParamKind::mlp_c_fc_weight, l), slot(ParamKind::mlp_c_fc_bias, l),
              slot(ParamKind::mlp_c_proj_weight, l), slot(ParamKind::mlp_c_proj_bias, l), coord)});
    ln_f_.emplace(C, slot(ParamKind::ln_f_weight), slot(ParamKind::ln_f_bias), coord);
    head_.emplace(Vp, C, slot(layout::head_kind), coord);
  }

  // Where tensor (k, layer) lives. A replicated tensor's gradient goes to the
  // packed partial buffer under SP (reduced at the end of backward).
  ParamSlot<T> slot(ParamKind k, int layer = -1) {
    const int i = layout::index(k, layer);
    const ParamInfo& t = layout::tensors[static_cast<std::size_t>(i)];
    std::span<T> grad(grads_.data() + t.offset, t.size());
    if (sequence_parallel && layout::split(i).replicated())
      grad = std::span<T>(partial_grads_.data() + layout::packed_offset[static_cast<std::size_t>(i)], t.size());
    return {std::span<T>(params_.data() + t.offset, t.size()), grad};
  }

  // SP: one all-reduce of every replicated tensor's partial gradient, added to grads().
  template <Communicator Comm>
  void reduce_partial_grads(Comm& tp) {
    using Packed = Sharded<T, ParamLayout<M, 1, Partial>>;
    const auto full = redistribute<Axis::tp, Replicate>(
        Packed({{static_cast<std::int64_t>(partial_grads_.size())}, coord_}, partial_grads_), tp);
    const auto r = full.local();
    for (int i = 0; i < layout::count; ++i) {
      if (!layout::split(i).replicated()) continue;
      const ParamInfo& t = layout::tensors[static_cast<std::size_t>(i)];
      const std::size_t p = layout::packed_offset[static_cast<std::size_t>(i)];
      for (std::size_t j = 0; j < t.size(); ++j) grads_[t.offset + j] += r[p + j];
    }
    std::fill(partial_grads_.begin(), partial_grads_.end(), T{});
  }

  // The first global position of this rank's rows of the stream (SP: its sequence shard).
  std::int64_t first_position(const Stream& x) const { return x.layout().offset()[1]; }
  std::int64_t local_seq(const Stream& x) const { return x.layout().local_shape()[1]; }

  void add_positions(Stream& x) const {
    const T* wpe = params_.data() + layout::offset(ParamKind::wpe);
    auto v = x.local();
    const std::int64_t t0 = first_position(x), tl = local_seq(x);
    for (std::int64_t b = 0; b < B_; ++b)
      for (std::int64_t t = 0; t < tl; ++t)
        for (std::int64_t c = 0; c < C; ++c) v[static_cast<std::size_t>((b * tl + t) * C + c)] += wpe[(t0 + t) * C + c];
  }
  // d wpe += the stream's gradient summed over the batch, at this rank's positions
  // (a partial sum with SP: the slot is in the packed buffer).
  void position_grads(const Stream& dx) {
    const ParamSlot<T> s = slot(ParamKind::wpe);
    const auto g = dx.local();
    const std::int64_t t0 = first_position(dx), tl = local_seq(dx);
    for (std::int64_t t = 0; t < tl; ++t)
      for (std::int64_t c = 0; c < C; ++c) {
        acc_t<T> sum = 0;
        for (std::int64_t b = 0; b < B_; ++b) sum += g[static_cast<std::size_t>((b * tl + t) * C + c)];
        s.grad[static_cast<std::size_t>((t0 + t) * C + c)] += static_cast<T>(sum);
      }
  }

  static void add_into(Stream& x, const Stream& y) {
    kernels::host::residual_forward(x.local().data(), x.local().data(), y.local().data(), x.local().size());
  }

  static void check_batch(int B, int T_) {
    if (B < 1 || T_ < 1 || T_ > max_seq)
      throw std::invalid_argument("nn::tp::GPT::forward: needs B >= 1 and 1 <= T <= max_seq = " +
                                  std::to_string(max_seq) + " (got B=" + std::to_string(B) + ", T=" +
                                  std::to_string(T_) + ")");
    if (sequence_parallel && T_ % tp_size != 0)
      throw std::invalid_argument("nn::tp::GPT::forward: sequence parallelism splits the sequence over TP = " +
                                  std::to_string(tp_size) + ", but T = " + std::to_string(T_) +
                                  " is not a multiple of it; use a sequence length divisible by TP or "
                                  "NoSequenceParallel");
  }

  template <Communicator Comm>
  std::vector<T> gather(const std::vector<T>& local, Comm& tp) const {
    std::vector<T> all(local.size() * static_cast<std::size_t>(tp_size));
    tp.all_gather(std::span<const T>(local), std::span<T>(all));
    std::vector<T> serial(serial_layout::size);
    layout::assemble(std::span<const T>(all), std::span<T>(serial));
    return serial;
  }

  Coord coord_;
  std::vector<T> params_, grads_;
  std::vector<T> partial_grads_;  // SP: packed partial gradients of the replicated tensors
  std::optional<Embedding> embedding_;
  std::vector<Block> blocks_;
  std::optional<Norm> ln_f_;
  std::optional<Head> head_;
  VocabParallelCrossEntropy<M, T> ce_{V};
  std::optional<Activation<T, M, Shard<2>>> logits_;  // logits, or d-logits after a forward with targets
  int B_ = 0;  // batch of the last forward (the position embedding's rows)
  bool has_dlogits_ = false;
  double loss_ = 0;
};

// A TP model with its TP communicator bound: the serial GPT's interface
// (forward/loss/backward without a communicator, params, grads, layout), so
// code written for one model replica takes a TP-split one, e.g.
//   DataParallel<nn::tp::Bound<Model, Comm>, DP, ZeRO<1>> dp(bound, dp_comm, hp);
// for DP x TP. norm_parts and sum_over_replica count every parameter once over
// the TP group in the clip norm; DataParallel sums it over DP.
template <class Model, Communicator Comm>
class Bound {
 public:
  using layout = typename Model::layout;
  using value_type = typename Model::value_type;
  static constexpr bool on_host = Model::on_host;

  Bound(Model& m, Comm& tp) : m_(m), tp_(tp) {}

  float forward(const int* tokens, const int* targets, int B, int T_) { return m_.forward(tokens, targets, B, T_, tp_); }
  double loss() const { return m_.loss(); }
  void backward() { m_.backward(tp_); }
  void zero_grad() { m_.zero_grad(); }
  std::span<value_type> params() { return m_.params(); }
  std::span<value_type> grads() { return m_.grads(); }
  // The clip norm, as DataParallel takes it: the parts of r this rank counts, and a sum of
  // this rank's part over the TP group.
  std::vector<FlatRange> norm_parts(FlatRange r) const { return m_.norm_parts(r); }
  double sum_over_replica(double s) const {
    tp_.all_reduce(std::span<double>(&s, 1), ReduceOp::sum);
    return s;
  }
  Model& model() { return m_; }
  Comm& comm() { return tp_; }

 private:
  Model& m_;
  Comm& tp_;
};

}  // namespace fived::nn::tp
