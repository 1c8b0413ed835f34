#pragma once
// GPT-2 style decoder on a mesh: one model for every parallel layout and device.
//
//   struct tiny : fived::gpt_config { static constexpr int layers = 2, d_model = 64, heads = 4,
//                                     vocab = 256, max_seq = 64; };
//   fived::GPT<tiny> model(fived::GptInit{.seed = 42});            // Mesh<>: the serial model
//   float loss = model.forward(tokens, targets, B, T);            // mean cross-entropy over B*T
//   model.zero_grad(); model.backward();                          // grads accumulate until zero_grad()
//
//   auto ctx = fived::make_mesh_context<Mesh<TP<4>>>(world);       // one rank of a TP group
//   fived::GPT<tiny, Mesh<TP<4>>, float, Host, SequenceParallel> tp_model(ctx, GptInit{.seed = 42});
//
// GPT<Cfg, M, T, Device, SP, Part>: the configuration, the mesh (its TP axis shapes the
// model; data parallelism is the trainer's, train/data_parallel.hpp; pipeline stages are
// the executor's, pipeline/executor.hpp), the element type, the device, the
// sequence-parallel policy and the part of the layers this object holds (AllLayers, or a
// pipeline stage's Layers<first, count>: see the boundary functions input/output/
// output_grad/input_grad). Every collective is a call on AxisComm<M, Axis::tp> or, for
// ring attention under context parallelism (nn/ring_attention.hpp), AxisComm<M, Axis::cp>;
// each compiles to nothing at extent 1: GPT<Cfg, Mesh<>> is the serial model, with no
// communicator at all. Under CP every rank takes the whole [B, T] batch and keeps its two
// zig-zag chunks of each sequence (context/zigzag.hpp).
//
// Blocks are pre-LayerNorm:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x));
// logits = ln_f(x) · wte^T (tied; lm_head^T when untied), over the padded vocabulary split
// over TP. The layers (nn/embedding.hpp, layernorm.hpp, attention.hpp, mlp.hpp, head.hpp)
// hold no storage: parameters and gradients are one flat buffer each, laid out at compile
// time by the parameter table (nn/param_table.hpp: this rank's pieces, in HF order), and
// activations live in per-micro-batch slots (set_slots(K): K micro-batches in flight, for
// pipeline schedules; forward and backward take the slot). Every kernel goes through
// ops() (Ops<T, Device>).
//
// The residual stream is [B*T, C] on every rank, or its rows split over TP with sequence
// parallelism (nn/stream.hpp); B*T must then be a multiple of TP.
//
// Activations are sized for B*T at run time: allocated on the first forward and
// reallocated only when a larger B*T comes (a smaller one reuses them, e.g. generation).
//
// The loss is fused with its gradient (d-logits written over the logits, as llm.c does):
// forward(tokens, targets) leaves d-logits for backward(); forward(tokens, nullptr)
// computes no loss and leaves this rank's logits [B*T, Vp/TP] readable (logits()).
//
// Device: Host (T = float, double or bf16) or Cuda (T = float or bf16; include
// <fived/nn/cuda/ops.hpp> first, in a .cu file compiled by nvcc). On Cuda, forward() takes
// host token ids and waits for the loss (enqueue_forward() does not); params(), grads(),
// param(), grad() and logits() are spans over DEVICE memory; *_to_host() copy. init, save
// and load stage through host memory.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fived/comm/group_comm.hpp"
#include "fived/device/bf16.hpp"
#include "fived/device/buffer.hpp"
#include "fived/io/safetensors.hpp"
#include "fived/mesh/context.hpp"
#include "fived/mesh/mesh.hpp"
#include "fived/model/layers.hpp"
#include "fived/nn/attention.hpp"
#include "fived/nn/checkpoint.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/embedding.hpp"
#include "fived/nn/head.hpp"
#include "fived/nn/init.hpp"
#include "fived/nn/layernorm.hpp"
#include "fived/nn/mlp.hpp"
#include "fived/nn/moe.hpp"
#include "fived/nn/ops.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/stream.hpp"
#include "fived/nn/unit_hooks.hpp"

namespace fived {

// The part a GPT object holds (model/layers.hpp): Layers<First, Count> is blocks [First,
// First + Count) of the configuration, with the embedding when First == 0 and ln_f, the
// head and the loss when the part ends at the last block; AllLayers is the whole model.
template <class Cfg, class Part>
struct part_layers {
  using type = Part;
};
template <class Cfg>
struct part_layers<Cfg, AllLayers> {
  using type = Layers<0, Cfg::layers>;
};

// The parameter table of a GPT (or of a part of one): the embedding (unit 0), each block
// (ln_1, attention, ln_2, MLP: a unit each), ln_f and an untied head (the last unit); a
// part's units count from 0 over what it holds. Random streams follow the order GPT-2 has
// always had here, (layer + 1) * 64 + position in a block, so a part starts with exactly
// the values its tensors have in the whole model.
template <class Cfg, class Part = AllLayers>
struct GptSpecs {
  using dims = gpt_dims<Cfg>;
  using part = typename part_layers<Cfg, Part>::type;
  static constexpr int layers = dims::layers;  // the whole model's (residual init)
  static constexpr int first = part::first, blocks = part::count;
  static constexpr bool has_embedding = first == 0, has_head = first + blocks == layers;
  static_assert(first >= 0 && blocks >= 0 && first + blocks <= layers,
                "GPT Layers<First, Count>: the part must lie inside the configuration's layers");
  static_assert(has_embedding || has_head || blocks > 0, "GPT Layers<First, Count>: a part must hold something");
  // Dense tensors of block l: ln_1, attention, ln_2, then the MLP's 4 or a mixture of
  // experts' router (its experts are in ExpertSpecs).
  static constexpr int block_specs(int l) { return 8 + (dims::is_moe(l) ? 1 : 4); }
  static constexpr int block_first(int local) {  // index of the part's block `local`'s first spec
    int i = has_embedding ? 2 : 0;
    for (int k = 0; k < local; ++k) i += block_specs(first + k);
    return i;
  }
  // A tied head on a part without the embedding keeps a copy of wte (Megatron's
  // word_embeddings_for_head): the same spec, so the same values; its gradient is summed with
  // the embedding stage's each step (tied_copy, pipeline/executor.hpp).
  static constexpr bool tied_copy = dims::tied && has_head && !has_embedding;
  static constexpr int count = block_first(blocks) + (has_head ? 2 + (dims::tied && !tied_copy ? 0 : 1) : 0);
  static constexpr int block_unit(int local) { return (has_embedding ? 1 : 0) + local; }
  static constexpr int final_unit = block_unit(blocks);  // ln_f and head
  static constexpr int units = has_head ? final_unit + 1 : block_unit(blocks);
  static constexpr std::array<TensorSpec, count> specs = [] {
    constexpr int C = dims::d_model, F = dims::d_ff, V = dims::vocab, Vp = dims::padded_vocab;
    std::array<TensorSpec, count> t{};
    std::size_t i = 0;
    auto put = [&](const auto& part) {
      for (const TensorSpec& s : part) t[i++] = s;
    };
    if constexpr (has_embedding) put(embedding_specs(V, Vp, C, dims::max_seq));
    for (int k = 0; k < blocks; ++k) {
      const int l = first + k;
      const std::uint64_t base = static_cast<std::uint64_t>(l + 1) * 64;
      put(layernorm_specs("ln_1.weight", "ln_1.bias", l, block_unit(k), C, base + 2));
      put(attention_specs(l, block_unit(k), C, base + 4));
      put(layernorm_specs("ln_2.weight", "ln_2.bias", l, block_unit(k), C, base + 8));
      if (dims::is_moe(l)) put(router_specs(l, block_unit(k), C, dims::experts, base + 16));
      else put(mlp_specs(l, block_unit(k), C, F, base + 10));
    }
    if constexpr (has_head) {
      put(layernorm_specs("ln_f.weight", "ln_f.bias", -1, final_unit, C, 14));
      if constexpr (!dims::tied) put(head_specs(V, Vp, C, final_unit));
      if constexpr (tied_copy) {
        TensorSpec wte = embedding_specs(V, Vp, C, dims::max_seq)[0];
        wte.unit = final_unit, wte.tied_copy = true;
        t[i++] = wte;
      }
    }
    return t;
  }();
};

// The experts of a GPT's part, in their own table (a second flat buffer: they reduce over
// the expert-data group, not DP x CP): 4 stacked tensors per MoE block, in the model's units.
template <class Cfg, class Part = AllLayers>
struct ExpertSpecs {
  using dense = GptSpecs<Cfg, Part>;
  using dims = typename dense::dims;
  static constexpr int layers = dims::layers, units = dense::units;
  static constexpr int moe_blocks = [] {
    int n = 0;
    for (int k = 0; k < dense::blocks; ++k) n += dims::is_moe(dense::first + k) ? 1 : 0;
    return n;
  }();
  static constexpr std::array<TensorSpec, 4 * moe_blocks> specs = [] {
    std::array<TensorSpec, 4 * moe_blocks> t{};
    std::size_t i = 0;
    for (int k = 0; k < dense::blocks; ++k) {
      const int l = dense::first + k;
      if (!dims::is_moe(l)) continue;
      for (const TensorSpec& x : expert_specs(l, dense::block_unit(k), dims::d_model, dims::d_ff, dims::experts,
                                              static_cast<std::uint64_t>(l + 1) * 64 + 17))
        t[i++] = x;
    }
    return t;
  }();
};

// A named tensor inside a flat buffer (device memory on Cuda: for passing on, not indexing).
template <class T>
struct TensorView {
  const ParamInfo* info = nullptr;
  std::span<T> data;

  std::string name() const { return info->name(); }
  std::int64_t rows() const { return info->rows; }
  std::int64_t cols() const { return info->cols; }
  int rank() const { return info->rank(); }
  std::size_t size() const { return data.size(); }
  T& operator[](std::size_t i) const { return data[i]; }
  T& operator()(std::int64_t r, std::int64_t c) const { return data[static_cast<std::size_t>(r * info->cols + c)]; }
};

template <class Cfg, MeshType M = Mesh<>, class T = float, class Device = Host, class SP = NoSequenceParallel,
          class Part = AllLayers>
class GPT {
  static_assert(std::is_same_v<Device, Host> || std::is_same_v<Device, Cuda>,
                "GPT<Cfg, M, T, Device>: the device must be fived::Host or fived::Cuda");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>,
                "GPT<Cfg, M, T>: the element type must be float, double (gradient checks) or fived::bf16");
  static_assert(!(std::is_same_v<Device, Cuda> && std::is_same_v<T, double>),
                "GPT<Cfg, M, double, Cuda>: double is for host gradient checks; on Cuda use float or fived::bf16");

 public:
  using config = Cfg;
  using mesh = M;
  using dims = gpt_dims<Cfg>;
  using value_type = T;
  using device = Device;
  using sequence_parallel = SP;
  using recompute = typename gpt_dims<Cfg>::recompute;  // nn/recompute.hpp
  using ops_type = Ops<T, Device>;
  using stat_t = typename ops_type::stat_t;
  using step_type = Step<M, T, Device, SP>;
  static constexpr int tp = M::extent(Axis::tp);
  static constexpr int cp = M::extent(Axis::cp);
  using sequence_split = LocalSequence<typename step_type::split>;  // context parallelism's
  using specs = GptSpecs<Cfg, Part>;
  using layout = ParamTable<specs, tp>;           // this rank's flat buffers
  using serial_layout = typename layout::serial;  // the same tensors whole, at TP 1 (files, gathers)
  // A mixture of experts keeps its experts in a second pair of flat buffers (nn/moe.hpp):
  // this rank's experts (E/EP) and their TP slice.
  static constexpr int ep = M::ep;
  using expert_specs = ExpertSpecs<Cfg, Part>;
  using expert_layout = ParamTable<expert_specs, tp, ep>;
  static constexpr bool has_experts = expert_layout::count > 0;
  static constexpr bool has_router_bias = has_experts && Cfg::balancing::bias;
  static constexpr int moe_blocks = expert_specs::moe_blocks;
  static constexpr bool on_host = std::is_same_v<Device, Host>;
  // The part this object holds: blocks [first_layer, first_layer + blocks); the embedding
  // and the head (with the loss) when it starts or ends the model.
  static constexpr int first_layer = specs::first, blocks = specs::blocks;
  static constexpr bool has_embedding = specs::has_embedding, has_head = specs::has_head;
  // A tied head on a stage without the embedding keeps its own copy of wte (GptSpecs::tied_copy).
  static constexpr bool has_tied_copy = specs::tied_copy;
  // The tensor tied across the first and last stage (model contract, optional): the pipeline
  // executor sums its gradient over the stages that hold it. None when untied.
  static constexpr const char* tied_weight = dims::tied ? "wte.weight" : nullptr;

  static constexpr int L = dims::layers, C = dims::d_model, NH = dims::heads, V = dims::vocab;
  static constexpr int Vp = dims::padded_vocab, F = dims::d_ff, max_seq = dims::max_seq;
  static constexpr std::size_t num_params = layout::size;  // this rank's buffer elements, padding included

  // ---- what the model contract asks of a model type (model/contract.hpp, docs/model.md) -----

  using init_type = GptInit;
  static constexpr bool calls_hooks = true;    // forward and backward call UnitHooks per unit
  static constexpr int layers = dims::layers;  // the whole model's blocks: what pipeline stages cut
  template <class P>
  using part = GPT<Cfg, M, T, Device, SP, P>;  // the same model holding other layers
  using serial_expert_layout = typename expert_layout::serial;
  // Matmul FLOPs per token of the forward, what StageLayers balances stages by: a block's
  // (qkv, proj and the MLP at ratio r: 2·(3 + 1 + 2r)·C²), the embedding's (none), the head's.
  static constexpr double block_flops() { return 2.0 * (3.0 + 1.0 + 2.0 * dims::mlp_ratio) * double(C) * C; }
  static constexpr double embedding_flops() { return 0.0; }
  static constexpr double head_flops() { return 2.0 * double(C) * Vp; }
  // The whole model's FLOPs per token of a training step (forward and backward), the MFU
  // numerator: 6 per parameter a token meets (the experts it is routed to, not all) and
  // 12·L·C·T for attention's two T-long products (no causal discount, as PaLM and llm.c).
  static constexpr double flops_per_token(int T_) {
    double n = static_cast<double>(ParamTable<GptSpecs<Cfg>, 1>::num_parameters);
    if constexpr (ExpertSpecs<Cfg>::moe_blocks > 0)
      n += static_cast<double>(ParamTable<ExpertSpecs<Cfg>, 1, 1>::num_parameters) * dims::top_k / dims::experts;
    return 6.0 * n + 12.0 * L * C * static_cast<double>(T_);
  }
  // A mixture of experts, for checkpoints: the MoE blocks of the whole model before block
  // `layer` (a part's MoE block m is the model's moe_blocks_before(first_layer) + m), the
  // experts of each, and whether this part keeps a selection bias per MoE block.
  static constexpr int moe_blocks_before(int layer) {
    int n = 0;
    for (int l = 0; l < layer; ++l) n += dims::is_moe(l) ? 1 : 0;
    return n;
  }
  static constexpr int experts_per_block = dims::experts;
  // The configuration's name, the same on every mesh and part (what a checkpoint records).
  static std::string config_name() { return GPT<Cfg>::describe(); }

  static_assert(NH % tp == 0,
                "tensor parallelism splits the attention heads over TP: the number of heads must be a multiple of the "
                "TP extent (change heads in the config, or use a TP that divides it)");
  static_assert(F % tp == 0,
                "tensor parallelism splits the MLP hidden width (mlp_ratio * d_model) over TP: make it a multiple of "
                "the TP extent");
  static_assert(dims::experts % ep == 0,
                "expert parallelism spreads the experts over EP: the number of experts must be a multiple of the EP "
                "extent (change experts in the config, or use an EP that divides it)");
  static_assert(Vp % tp == 0,
                "the vocabulary is split over TP: the padded vocabulary must be a multiple of the TP extent (make "
                "vocab_multiple in the config a multiple of TP)");

  // A mesh without TP and CP (and EP, for a mixture of experts) needs no communicator.
  explicit GPT(const GptInit& init = {}) requires(tp == 1 && cp == 1 && (ep == 1 || !has_experts))
      : GPT(AxisComm<M, Axis::tp>(), AxisComm<M, Axis::cp>(), ep_comm_type(), 0, init) {}
  // One rank of the mesh: binds its TP, CP and EP communicators. Initialised as the serial
  // model with the same GptInit, this rank's piece element by element.
  template <Communicator Comm>
  explicit GPT(MeshContext<M, Comm>& ctx, const GptInit& init = {})
      : GPT(bind<Axis::tp>(ctx), bind<Axis::cp>(ctx), bind_ep(ctx), M::expert_group::index(ctx.rank()), init) {}

  GPT(const GPT&) = delete;  // a bound communicator and device buffers
  GPT& operator=(const GPT&) = delete;

  ops_type& ops() { return ops_; }
  const ops_type& ops() const { return ops_; }
  int tp_rank() const { return comm_.rank(); }

  // ---- parameters and gradients (this rank's pieces; device memory on Cuda) ----------------

  std::span<T> params() { return params_.span(); }
  std::span<const T> params() const { return params_.span(); }
  std::span<T> grads() { return grads_.span(); }
  std::span<const T> grads() const { return grads_.span(); }
  TensorView<T> param(std::string_view name) { return view(params_, index_of(name)); }
  TensorView<T> grad(std::string_view name) { return view(grads_, index_of(name)); }
  TensorView<const T> param(std::string_view name) const { return view(params_, index_of(name)); }
  TensorView<const T> grad(std::string_view name) const { return view(grads_, index_of(name)); }

  void zero_grad() {
    ops_.zero(grads_);
    if constexpr (has_experts) ops_.zero(expert_grads_);
  }
  std::vector<T> params_to_host() const { return ops_.to_host(params_.span()); }
  std::vector<T> grads_to_host() const { return ops_.to_host(grads_.span()); }

  // The whole model's buffers in the serial layout, on every TP rank (an all-gather over TP).
  std::vector<T> gather_params() { return gather(params_); }
  std::vector<T> gather_grads() { return gather(grads_); }

  // The clip norm, every parameter counted once over TP: the parts of r (flat offsets)
  // this rank counts, and a sum over the TP group (nothing to sum at TP 1).
  std::vector<FlatRange> norm_parts(FlatRange r) const { return layout::norm_parts(r, tp_rank()); }
  double sum_over_tp(double s) { return comm_.all_reduce_host(s); }

  // ---- a mixture of experts ------------------------------------------------------------------

  // The expert buffers as a trainer sees a model (train/data_parallel.hpp drives them beside
  // the dense ones): reduced over the expert-data group and scaled by 1/EP, because each
  // expert's gradient sums the mean losses of the EP ranks whose tokens it took; the clip
  // norm sums over TP (each parameter once) and over EP (different experts).
  class Experts {
   public:
    using mesh = M;
    using value_type = T;
    using device = Device;
    using ops_type = typename GPT::ops_type;
    using layout = expert_layout;
    using grad_group = typename M::expert_data_group;
    static constexpr double grad_scale = 1.0 / ep;
    static constexpr bool calls_hooks = true;  // the model's forward and backward call them for it

    explicit Experts(GPT& m) : m_(m) {}
    ops_type& ops() { return m_.ops_; }
    std::span<T> params() { return m_.expert_params_.span(); }
    std::span<T> grads() { return m_.expert_grads_.span(); }
    void zero_grad() { m_.ops_.zero(m_.expert_grads_); }
    std::vector<T> params_to_host() const { return m_.ops_.to_host(std::span<const T>(m_.expert_params_.span())); }
    std::vector<FlatRange> norm_parts(FlatRange r) const { return layout::norm_parts(r, m_.tp_rank()); }
    double sum_over_tp(double s) { return m_.ep_comm_.all_reduce_host(m_.comm_.all_reduce_host(s)); }

   private:
    GPT& m_;
  };
  Experts& experts() requires(has_experts) { return experts_view_; }
  int ep_rank() const { return ep_rank_; }

  // This rank's expert buffers (its E/EP experts, its TP slice of them: expert_layout); device
  // memory on Cuda, *_to_host() copies.
  std::span<T> expert_params() requires(has_experts) { return expert_params_.span(); }
  std::span<T> expert_grads() requires(has_experts) { return expert_grads_.span(); }
  std::vector<T> expert_params_to_host() const requires(has_experts) {
    return ops_.to_host(std::span<const T>(expert_params_.span()));
  }
  std::vector<T> expert_grads_to_host() const requires(has_experts) {
    return ops_.to_host(std::span<const T>(expert_grads_.span()));
  }

  // The load-balancing loss of the slot's last forward: the sum over the part's MoE blocks
  // (0 without them, or with aux_loss_coef 0). Its gradient is in backward(); loss() is the
  // language model's alone.
  double aux_loss(int slot = 0) const {
    double a = 0;
    if constexpr (has_experts)
      for (int l = 0; l < blocks; ++l)
        if (is_moe_block(l)) a += slots_.at(static_cast<std::size_t>(slot)).aux[static_cast<std::size_t>(l)];
    return a;
  }

  // After an optimizer step (DataParallel::update calls it with its gradient group, DP x CP):
  // the rows each expert took in the step's training forwards, summed over the group (every
  // rank that routes tokens), become expert_loads(); with AuxLossFreeBias each MoE block's
  // selection bias moves by bias_update_rate * sign(mean load - load). Nothing without experts.
  template <GroupView G>
  void balance_experts(MeshComm<G>& group) {
    if constexpr (has_experts) {
      group.all_reduce_host(std::span<double>(loads_));
      last_loads_ = loads_;
      if constexpr (Cfg::balancing::bias) {
        for (int m = 0; m < moe_blocks; ++m) {
          const std::span<const double> load(loads_.data() + m * dims::experts, dims::experts);
          double mean = 0;
          for (double x : load) mean += x / dims::experts;
          for (int e = 0; e < dims::experts; ++e) {
            const double d = mean - load[static_cast<std::size_t>(e)];
            bias_host_[static_cast<std::size_t>(m * dims::experts + e)] +=
                static_cast<float>(Cfg::bias_update_rate * ((d > 0) - (d < 0)));
          }
        }
        ops_.upload(router_bias_.data(), bias_host_.data(), bias_host_.size());
      }
      std::fill(loads_.begin(), loads_.end(), 0.0);
    }
  }
  // Rows per expert in the last balanced step, [MoE block][expert] (empty before the first).
  const std::vector<double>& expert_loads() const { return last_loads_; }
  // The selection bias of the part's m-th MoE block (AuxLossFreeBias), [expert].
  std::span<const float> router_bias(int m) const {
    return std::span<const float>(bias_host_).subspan(static_cast<std::size_t>(m * dims::experts), dims::experts);
  }
  // Sets it (a resumed run's, or a test's skewed router); the same on every rank of a replica.
  void set_router_bias(int m, std::span<const float> bias) requires(Cfg::balancing::bias) {
    if (m < 0 || m >= moe_blocks || bias.size() != static_cast<std::size_t>(dims::experts))
      throw std::invalid_argument("GPT::set_router_bias: block " + std::to_string(m) + " of " +
                                  std::to_string(moe_blocks) + " MoE blocks, " + std::to_string(bias.size()) +
                                  " values for " + std::to_string(dims::experts) + " experts");
    std::copy(bias.begin(), bias.end(), bias_host_.begin() + static_cast<std::ptrdiff_t>(m * dims::experts));
    ops_.upload(router_bias_.data(), bias_host_.data(), bias_host_.size());
  }

  // ---- micro-batch slots ------------------------------------------------------------------

  // K activation slots: forward(slot k) keeps what backward(slot k) needs while the other
  // slots run. Allocated at the next forward of each slot.
  void set_slots(int k) {
    if (k < 1) throw std::invalid_argument("GPT::set_slots: needs at least one slot, got " + std::to_string(k));
    slots_.resize(static_cast<std::size_t>(k));
  }
  int slots() const { return static_cast<int>(slots_.size()); }

  // ---- forward / backward --------------------------------------------------------------------

  // tokens and targets: [B, T] ids in [0, vocab), host memory, the same on every TP and CP
  // rank (under context parallelism each rank keeps its two chunks of every sequence, and T
  // must be a multiple of 2·CP). Returns the mean loss over this rank's tokens (B*T, or
  // B*T/CP: the mean over the CP group is the sequences', as DataParallel reports it; 0
  // without targets). On Cuda this waits for the loss.
  double forward(const int* tokens, const int* targets, int B, int T_, const UnitHooks& hooks = {}, int slot = 0) {
    enqueue_forward(tokens, targets, B, T_, hooks, slot);
    if (targets == nullptr) return 0.0;
    return loss(slot);
  }

  void enqueue_forward(const int* tokens, const int* targets, int B, int T_, const UnitHooks& hooks = {},
                       int slot = 0) {
    check_batch(tokens, targets, B, T_);
    const int Tl = local_length(T_);
    Slot& a = slot_at(slot);
    reserve(a, B, Tl);
    a.B = B, a.T_ = Tl;
    upload_local(a.tokens, tokens, B, T_);
    if (targets != nullptr) upload_local(a.targets, targets, B, T_);
    a.has_dlogits = a.loss_pending = false;
    a.loss = 0;
    step_type s = step(a);

    if constexpr (has_embedding) {
      detail::call(hooks.before_forward, 0);
      Embedding<step_type>::forward(s, a.encoded.data(), a.tokens.data(), P(0), P(1), Vp, C, work_.partial.data());
      detail::call(hooks.after_forward, 0);
    }  // else the previous stage's output was received into input(slot)
    const T* x = a.encoded.data();
    for (int l = 0; l < blocks; ++l) {
      detail::call(hooks.before_forward, specs::block_unit(l));
      BlockActs& A = acts(a, l);
      T* out = a.blocks[static_cast<std::size_t>(l)].res3.data();  // kept under every recompute policy
      block_forward(s, A, x, out, l);
      if constexpr (has_experts)
        if (is_moe_block(l)) {
          a.aux[static_cast<std::size_t>(l)] = A.moe.aux;
          if (targets != nullptr)  // a training step's loads, for balance_experts
            for (int e = 0; e < dims::experts; ++e)
              loads_[static_cast<std::size_t>(moe_index(l) * dims::experts + e)] += A.moe.counts[static_cast<std::size_t>(e)];
        }
      x = out;
      detail::call(hooks.after_forward, specs::block_unit(l));
    }
    if constexpr (!has_head) {  // the stream goes on to the next stage: output(slot)
      a.output = x;
      a.has_dlogits = true;
      return;
    } else {
      detail::call(hooks.before_forward, specs::final_unit);
      if constexpr (dims::tied && has_embedding) detail::call(hooks.before_forward, 0);  // the head is wte
      Norm::forward(s, a.lnf, x, P(ln_f_index), P(ln_f_index + 1), C);
      HeadL::forward(s, a.head, a.lnf.out.data(), P(head_index), Vp, C);
      if constexpr (dims::tied && has_embedding) detail::call(hooks.after_forward, 0);
      detail::call(hooks.after_forward, specs::final_unit);
      if (targets == nullptr) return;
      HeadL::loss(s, a.head, a.targets.data(), V, Vp);
      a.loss_pending = a.has_dlogits = true;
      if constexpr (on_host) loss(slot);
    }
  }

  // The mean loss of the slot's last forward with targets (the same on every TP rank), in
  // stat_t precision summed in double. On Cuda the first call after a forward waits.
  double loss(int slot = 0) const {
    const Slot& a = slots_.at(static_cast<std::size_t>(slot));
    if (a.loss_pending) {
      a.loss = ops_.mean_loss(a.head.max.data(), a.head.sumexp.data(), a.head.target.data(), a.B * a.T_);
      a.loss_pending = false;
    }
    return a.loss;
  }
  // The same loss, times the slot's rows, added to ops().loss_sum() without waiting: for a
  // caller that must keep issuing work (a pipeline's last stage) and reads once at the end.
  void add_to_loss_sum(int slot) {
    const Slot& a = slots_.at(static_cast<std::size_t>(slot));
    ops_.add_loss_sum(a.head.max.data(), a.head.sumexp.data(), a.head.target.data(), a.B * a.T_);
  }

  // Accumulates the gradient of the slot's last forward's mean loss into grads(). Hooks
  // (nn/unit_hooks.hpp): before_backward(u) before unit u's parameters are read or its
  // gradients written, after_backward(u) as soon as they are final (under SP, after the
  // unit's LayerNorm gradients are all-reduced over TP). Units finish from L+1 to 0.
  void backward(const UnitHooks& hooks = {}, int slot = 0) {
    Slot& a = slot_at(slot);
    if (!a.has_dlogits)
      throw std::logic_error(has_head ? "GPT::backward: call forward(tokens, targets, B, T) with targets first (once "
                                        "per backward)"
                                      : "GPT::backward: call forward first (once per backward)");
    a.has_dlogits = false;
    step_type s = step(a);
    T* dres = work_.dres.data();
    T* dln = work_.dln.data();
    T* full = work_.partial.data();  // SP: [N, C] for gathered rows and partial sums

    if constexpr (has_head) {
      detail::call(hooks.before_backward, specs::final_unit);
      if constexpr (dims::tied && has_embedding) detail::call(hooks.before_backward, 0);  // the head is wte
      HeadL::backward(s, dln, G(head_index), a.head, a.lnf.out.data(), P(head_index), Vp, C, full);
      ops_.zero(work_.dres);
      const T* x_last = blocks > 0 ? a.blocks[static_cast<std::size_t>(blocks - 1)].res3.data() : a.encoded.data();
      Norm::backward(s, dres, G(ln_f_index), G(ln_f_index + 1), dln, x_last, P(ln_f_index), a.lnf, C);
      finish_unit(specs::final_unit);
      detail::call(hooks.after_backward, specs::final_unit);
    }  // else dres holds d(output), received into output_grad()

    for (int l = blocks - 1; l >= 0; --l) {
      detail::call(hooks.before_backward, specs::block_unit(l));
      BlockActs& A = acts(a, l);
      const int t = block_first(l);
      const T* x = l == 0 ? a.encoded.data() : a.blocks[static_cast<std::size_t>(l - 1)].res3.data();
      if constexpr (recompute::whole_block) block_forward(s, A, x, work_.block.res3.data(), l);
      else if constexpr (recompute::attention_core) Attn::core_forward(s, A.attn, core(A), work_.ring, C);
      // dres holds d(res3)
      if (is_moe_block(l)) {
        if constexpr (has_experts)
          Moe::backward(s, A.moe, work_.moe, dln, moe_params(grads_, expert_grads_, l), dres, A.ln2.out.data(),
                        moe_params(params_, expert_params_, l), C, F, full);
      } else {
        Mlp::backward(s, dln, mlp_params(grads_, t + 8), dres, A.ln2.out.data(), A.mlp, mlp_params(params_, t + 8), C, F,
                      work_.dhidden.data(), full);
      }
      Norm::backward(s, dres, G(t + 6), G(t + 7), dln, A.res2.data(), P(t + 6), A.ln2, C);
      // dres holds d(res2)
      Attn::backward(s, work_.ring, dln, attn_params(grads_, t + 2), dres, A.ln1.out.data(), A.attn, core(A),
                     attn_params(params_, t + 2), C, work_.dhidden.data(), work_.dqkv.data(), full);
      Norm::backward(s, dres, G(t), G(t + 1), dln, x, P(t), A.ln1, C);
      finish_unit(specs::block_unit(l));
      detail::call(hooks.after_backward, specs::block_unit(l));
    }
    if constexpr (has_embedding) {
      detail::call(hooks.before_backward, 0);
      Embedding<step_type>::backward(s, G(0), G(1), dres, a.tokens.data(), Vp, C, full);
      detail::call(hooks.after_backward, 0);  // wte (which a tied head also wrote) and wpe
    }  // else dres holds d(input): input_grad()
  }

  // ---- a pipeline stage's boundary (nn/gpt.hpp parts: Layers<first, count>) -----------------
  // The stream crossing between stages is this rank's rows of it, [n, C] (n = B*T/CP, and /TP
  // under sequence parallelism: boundary_size). B and T are the batch's, as forward takes them.

  // This rank's tokens of each sequence of length T: T, or T/CP (the zig-zag split's error
  // when T does not cut into 2·CP chunks).
  static int local_length(int T_) {
    if constexpr (cp == 1) return T_;
    else return 2 * step_type::split::chunk_length(T_);
  }

  static std::size_t boundary_size(int B, int T_) {
    const std::size_t N = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_ / cp);
    return (step_type::sp ? N / tp : N) * static_cast<std::size_t>(C);
  }
  // Where the previous stage's output goes before enqueue_forward(..., slot) (sized for B x T).
  T* input(int slot, int B, int T_) requires(!has_embedding) {
    Slot& a = slot_at(slot);
    reserve(a, B, local_length(T_));
    return a.encoded.data();
  }
  // The stream this part hands on, after enqueue_forward(..., slot).
  const T* output(int slot) const requires(!has_head) { return slots_.at(static_cast<std::size_t>(slot)).output; }
  // Where the next stage's d(output) goes before backward(slot). Shared by the slots.
  T* output_grad(int B, int T_) requires(!has_head) {
    reserve_work(B, local_length(T_));
    return work_.dres.data();
  }
  // d(input) after backward: what goes back to the previous stage (until the next backward).
  const T* input_grad() const requires(!has_embedding) { return work_.dres.data(); }

  // This rank's logits [B*T, Vp/TP] (columns [tp_rank * Vp/TP, ...) of the padded
  // vocabulary) of the slot's last forward WITHOUT targets. Device memory on Cuda.
  std::span<const T> logits(int slot = 0) const requires(has_head) {
    const Slot& a = slots_.at(static_cast<std::size_t>(slot));
    if (a.has_dlogits)
      throw std::logic_error("GPT::logits: the last forward had targets, its logits were replaced by d-logits");
    return {a.head.logits.data(), static_cast<std::size_t>(a.B) * static_cast<std::size_t>(a.T_) * (Vp / tp)};
  }
  std::vector<T> logits_to_host(int slot = 0) const { return ops_.to_host(logits(slot)); }

  // ---- safetensors, with Hugging Face GPT-2 names and shapes ---------------------------------

  // The whole model's file (nn/checkpoint.hpp): gathered over TP, written by TP rank 0
  // (atomic: a temporary file, then rename); every rank returns once the file is complete.
  void save(const std::filesystem::path& path, const std::map<std::string, std::string>& metadata = {}) {
    if constexpr (has_experts)
      throw std::logic_error("GPT::save: a mixture of experts cannot be saved yet (its experts live in a second "
                             "buffer the GPT-2 file has no names for); checkpoints of MoE models are issue 16");
    if constexpr (tp == 1) {
      ops_.read_to_host(params_, [&](std::span<const T> p) { save_gpt<serial_layout>(path, p, metadata); });
    } else {
      const std::vector<T> all = gather_params();
      if (tp_rank() == 0) save_gpt<serial_layout>(path, std::span<const T>(all), metadata);
      comm_.barrier();
    }
  }

  // Reads HF GPT-2 weights (any floating dtype, names with or without "transformer.") and
  // keeps this rank's piece. A missing, mis-shaped or unknown tensor is an
  // io::SafetensorsError naming it, and the model is left unchanged.
  void load(const std::filesystem::path& path) { load(io::SafetensorsFile::read(path)); }
  void load(const io::SafetensorsFile& f) {
    const std::vector<T> serial = read_serial(f);
    ops_.write_from_host(params_, [&](std::span<T> p) {
      layout::slice(std::span<const T>(serial), p, tp_rank());
    });
  }

  // The part's tensors of a Hugging Face GPT-2 file, in serial_layout (the model contract's
  // way in for given weights: Trainer::load_weights).
  static std::vector<T> read_serial(const io::SafetensorsFile& f) {
    if constexpr (has_experts)
      throw std::logic_error("GPT::load: a mixture of experts cannot be loaded from a GPT-2 file yet");
    std::vector<T> serial(serial_layout::size);
    load_gpt<serial_layout>(f, std::span<T>(serial), describe());
    return serial;
  }

  static std::string describe() {
    return std::to_string(L) + " layers, d_model " + std::to_string(C) + ", " + std::to_string(NH) + " heads, vocab " +
           std::to_string(V) + ", max_seq " + std::to_string(max_seq) + (dims::tied ? ", tied" : ", untied") +
           (blocks != L ? ", the part with blocks " + std::to_string(first_layer) + ".." +
                              std::to_string(first_layer + blocks - 1) + (has_embedding ? " and the embedding" : "") +
                              (has_head ? " and the head" : "")
                        : std::string()) +
           (dims::experts > 0 ? ", " + std::to_string(dims::experts) + " experts top-" + std::to_string(dims::top_k) +
                                    " every " + std::to_string(dims::moe_every) + " blocks"
                              : std::string()) +
           (tp > 1 || cp > 1 || (ep > 1 && has_experts) ? ", over " + M::name() + (step_type::sp ? " with sequence parallelism" : "")
                             : std::string()) +
           (recompute::attention_core || recompute::whole_block ? std::string(", recompute: ") + recompute::name
                                                                : std::string());
  }

 private:
  using Norm = LayerNorm<step_type>;
  using Attn = Attention<step_type, NH>;
  using Mlp = MLP<step_type>;
  using HeadL = Head<step_type>;

  using Moe = MoE<step_type, Cfg>;
  using ep_comm_type = typename step_type::ep_comm_type;

  static constexpr int block_first(int l) { return specs::block_first(l); }
  static constexpr bool is_moe_block(int l) { return dims::is_moe(first_layer + l); }
  // Which of the part's MoE blocks block l is (its experts' place in the expert table).
  static constexpr int moe_index(int l) {
    int m = 0;
    for (int k = 0; k < l; ++k) m += is_moe_block(k) ? 1 : 0;
    return m;
  }
  static constexpr bool has_mlp_block = [] {
    for (int l = 0; l < blocks; ++l)
      if (!is_moe_block(l)) return true;
    return false;
  }();
  static constexpr int ln_f_index = block_first(blocks);
  static constexpr int head_index = dims::tied && has_embedding ? 0 : ln_f_index + 2;  // lm_head or wte's copy

  // What a block's forward leaves for its backward. A slot keeps one per block; under
  // FullRecompute only res3 (the next block's input), the rest in the one work_.block.
  struct BlockActs {
    typename Norm::Saved ln1, ln2;
    typename Attn::Saved attn;
    typename Mlp::Saved mlp;  // or, in an MoE block:
    typename Moe::Saved moe;
    Buffer<T, Device> res2, res3;

    void reserve(ops_type& ops, std::size_t N, std::size_t n, bool mlp_block, bool moe_block) {
      ln1.reserve(ops, n, C);
      attn.reserve(ops, N, C, !recompute::attention_core);
      res2 = ops.template make_buffer<T>(n * C);
      ln2.reserve(ops, n, C);
      if (moe_block) moe.reserve(ops, N, C);
      if (mlp_block) mlp.reserve(ops, N, C, F);
      res3 = ops.template make_buffer<T>(n * C);
    }
  };
  struct Slot {
    std::size_t capacity = 0;  // B*T the buffers hold
    Buffer<int, Device> tokens, targets;
    Buffer<T, Device> encoded;
    std::vector<BlockActs> blocks;
    typename Norm::Saved lnf;
    typename HeadL::Saved head;
    std::vector<double> aux;  // per block: an MoE block's load-balancing loss
    int B = 0, T_ = 0;
    const T* output = nullptr;  // the stream leaving the part (parts without the head)
    bool has_dlogits = false;   // forward done, backward may run (d-logits written, with a head)
    mutable bool loss_pending = false;  // the statistics of the last forward are not summed yet
    mutable double loss = 0;
  };
  // Shared by every slot: what one forward or backward uses and leaves behind.
  struct Work {
    std::size_t capacity = 0;
    Buffer<T, Device> out, dres, dln;  // the stream's rows [n, C]
    Buffer<T, Device> dhidden, dqkv;   // [N, F/TP], [N, 3C/TP]
    Buffer<T, Device> partial;         // SP: [N, C] gathered rows or partial sums
    typename Attn::RingWork ring;      // CP: the ring's blocks and accumulators
    typename Moe::Work moe;            // mixture of experts: router and dispatch buffers
    BlockActs block;                   // FullRecompute: the block being run
    typename Attn::Core core;          // SelectiveRecompute: the core attention being run
  };

  // Where block l of slot a keeps what its backward reads, and its core attention's output.
  BlockActs& acts(Slot& a, int l) {
    if constexpr (recompute::whole_block) return work_.block;
    else return a.blocks[static_cast<std::size_t>(l)];
  }
  typename Attn::Core& core(BlockActs& A) {
    if constexpr (recompute::attention_core) return work_.core;
    else return A.attn.core;
  }

  // Block l's forward from x (the stream's rows) into A, its output to `out`: what forward
  // runs, and what backward runs again under FullRecompute.
  void block_forward(step_type& s, BlockActs& A, const T* x, T* out, int l) {
    const int t = block_first(l);
    Norm::forward(s, A.ln1, x, P(t), P(t + 1), C);
    Attn::forward(s, A.attn, core(A), work_.ring, work_.out.data(), A.ln1.out.data(), attn_params(params_, t + 2), C,
                  work_.partial.data());
    ops_.residual_forward(A.res2.data(), x, work_.out.data(), stream_size(s));
    Norm::forward(s, A.ln2, A.res2.data(), P(t + 6), P(t + 7), C);
    if (is_moe_block(l)) {
      if constexpr (has_experts)
        Moe::forward(s, A.moe, work_.moe, work_.out.data(), A.ln2.out.data(), moe_params(params_, expert_params_, l),
                     Cfg::balancing::bias ? router_bias_.data() + moe_index(l) * dims::experts : nullptr, C, F,
                     work_.partial.data());
    } else {
      Mlp::forward(s, A.mlp, work_.out.data(), A.ln2.out.data(), mlp_params(params_, t + 8), C, F, work_.partial.data());
    }
    ops_.residual_forward(out, A.res2.data(), work_.out.data(), stream_size(s));
  }

  GPT(AxisComm<M, Axis::tp> comm, AxisComm<M, Axis::cp> cp_comm, ep_comm_type ep_comm, int ep_rank,
      const GptInit& init)
      : comm_(std::move(comm)), cp_comm_(std::move(cp_comm)), ep_comm_(std::move(ep_comm)), ep_rank_(ep_rank),
        params_(ops_.template make_buffer<T>(num_params)), grads_(ops_.template make_buffer<T>(num_params)),
        expert_params_(ops_.template make_buffer<T>(expert_layout::size)),
        expert_grads_(ops_.template make_buffer<T>(expert_layout::size)),
        router_bias_(ops_.template make_buffer<float>(std::max(moe_blocks * dims::experts, 1))), slots_(1),
        experts_view_(*this) {
    // (The whole model on a PP mesh is a type the Trainer reads facts from, never an object.)
    static_assert(M::pp == 1 || !std::is_same_v<Part, AllLayers>,
                  "GPT on a mesh with PP > 1: each rank holds one stage's layers, not the whole model; give the model "
                  "its part as the last template argument, Layers<first, count> (fived::Trainer does this for you)");
    comm_.set_compute_stream(stream_of(ops_));  // TP collectives in the order of the model's kernels
    cp_comm_.set_compute_stream(stream_of(ops_));  // and the ring's transfers
    ep_comm_.set_compute_stream(stream_of(ops_));  // and the experts' all-to-all
    ops_.write_from_host(params_, [&](std::span<T> p) { init_params<layout>(p, tp_rank(), init); });
    if constexpr (has_experts)
      ops_.write_from_host(expert_params_, [&](std::span<T> p) { init_params<expert_layout>(p, tp_rank(), init, ep_rank_); });
    loads_.assign(static_cast<std::size_t>(moe_blocks * dims::experts), 0.0);
    bias_host_.assign(loads_.size(), 0.0f);
    if constexpr (step_type::sp)
      for (int u = 0; u < layout::units; ++u)
        sp_partial_[static_cast<std::size_t>(u)] = ops_.template make_buffer<T>(sp_partial_size(u));
  }
  template <Axis A, class Ctx>
  static AxisComm<M, A> bind(Ctx& ctx) {
    if constexpr (M::extent(A) == 1) return AxisComm<M, A>();
    else return AxisComm<M, A>(ctx.template comm<A>());
  }
  template <class Ctx>
  static ep_comm_type bind_ep(Ctx& ctx) {
    if constexpr (ep == 1) return ep_comm_type();
    else return ep_comm_type(ctx.template comm<typename M::expert_group>());
  }

  step_type step(const Slot& a) { return step_type{ops_, comm_, cp_comm_, a.B, a.T_, &ep_comm_}; }

  T* at_expert(Buffer<T, Device>& b, int i) {
    return b.data() + expert_layout::tensors[static_cast<std::size_t>(i)].offset;
  }
  // Block l's router (in the dense buffer `dense`) and its experts (in `experts`).
  typename Moe::Params moe_params(Buffer<T, Device>& dense, Buffer<T, Device>& experts, int l) {
    const int e = 4 * moe_index(l);
    return {at(dense, block_first(l) + 8), at_expert(experts, e), at_expert(experts, e + 1), at_expert(experts, e + 2),
            at_expert(experts, e + 3)};
  }

  // A [B, T] batch of ids to dst: all of it, or under CP this rank's chunks (chunk-major).
  void upload_local(Buffer<int, Device>& dst, const int* ids, int B, int T_) {
    const std::size_t N = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    if constexpr (cp == 1) {
      ops_.upload_ids(dst, ids, N);
    } else {
      local_ids_.resize(N / cp);  // grows once
      sequence_split::local_tokens(std::span<const int>(ids, N), B, T_, cp_comm_.rank(), std::span<int>(local_ids_));
      ops_.upload_ids(dst, local_ids_.data(), local_ids_.size());
    }
  }
  std::size_t stream_size(const step_type& s) const {
    return static_cast<std::size_t>(s.local_rows()) * static_cast<std::size_t>(C);
  }

  T* P(int i) { return params_.data() + layout::tensors[static_cast<std::size_t>(i)].offset; }
  // Where tensor i's gradient accumulates: the gradient buffer, or under SP, for a gradient
  // summed over this rank's rows, its unit's partial buffer (finish_unit reduces it).
  T* G(int i) {
    if constexpr (step_type::sp) {
      const TensorSpec& s = layout::specs[static_cast<std::size_t>(i)];
      if (s.sp_partial) return sp_partial_[static_cast<std::size_t>(s.unit)].data() + sp_partial_offset[static_cast<std::size_t>(i)];
    }
    return grads_.data() + layout::tensors[static_cast<std::size_t>(i)].offset;
  }
  T* at(Buffer<T, Device>& b, int i) { return b.data() + layout::tensors[static_cast<std::size_t>(i)].offset; }
  typename Attn::Params attn_params(Buffer<T, Device>& b, int i) { return {at(b, i), at(b, i + 1), at(b, i + 2), at(b, i + 3)}; }
  typename Mlp::Params mlp_params(Buffer<T, Device>& b, int i) { return {at(b, i), at(b, i + 1), at(b, i + 2), at(b, i + 3)}; }

  // SP: the partial gradients of each unit, packed per unit in spec order.
  static constexpr std::array<std::size_t, layout::count> sp_partial_offset = [] {
    std::array<std::size_t, layout::count> o{};
    std::array<std::size_t, layout::units> next{};
    for (int i = 0; i < layout::count; ++i) {
      const TensorSpec& s = layout::specs[static_cast<std::size_t>(i)];
      if (!s.sp_partial) continue;
      o[static_cast<std::size_t>(i)] = next[static_cast<std::size_t>(s.unit)];
      next[static_cast<std::size_t>(s.unit)] += layout::tensors[static_cast<std::size_t>(i)].size();
    }
    return o;
  }();
  static constexpr std::size_t sp_partial_size(int u) {
    std::size_t n = 0;
    for (int i = 0; i < layout::count; ++i)
      if (layout::specs[static_cast<std::size_t>(i)].sp_partial && layout::specs[static_cast<std::size_t>(i)].unit == u)
        n += layout::tensors[static_cast<std::size_t>(i)].size();
    return n;
  }
  // SP: unit u's backward is done; its partial gradients are summed over TP (one
  // all-reduce) and added to the gradient buffer.
  void finish_unit(int u) {
    if constexpr (step_type::sp) {
      Buffer<T, Device>& part = sp_partial_[static_cast<std::size_t>(u)];
      if (part.size() == 0) return;
      comm_.all_reduce(part.span());
      for (int i = 0; i < layout::count; ++i) {
        const ParamInfo& t = layout::tensors[static_cast<std::size_t>(i)];
        if (!t.spec.sp_partial || t.spec.unit != u) continue;
        T* g = grads_.data() + t.offset;
        ops_.residual_forward(g, g, part.data() + sp_partial_offset[static_cast<std::size_t>(i)], t.size());
      }
      ops_.zero(part);
    }
  }

  Slot& slot_at(int k) {
    if (k < 0 || k >= slots())
      throw std::out_of_range("GPT: slot " + std::to_string(k) + " does not exist (the model has " +
                              std::to_string(slots()) + "; set_slots(k) adds more)");
    return slots_[static_cast<std::size_t>(k)];
  }

  void check_batch(const int* tokens, const int* targets, int B, int T_) const {
    if (B < 1 || T_ < 1 || T_ > max_seq)
      throw std::invalid_argument("GPT::forward: needs B >= 1 and 1 <= T <= max_seq = " + std::to_string(max_seq) +
                                  " (got B=" + std::to_string(B) + ", T=" + std::to_string(T_) + ")");
    if (tokens == nullptr) throw std::invalid_argument("GPT::forward: tokens is nullptr");
    const int Tl = local_length(T_);
    if (step_type::sp && (B * Tl) % tp != 0)
      throw std::invalid_argument("GPT::forward: sequence parallelism splits this rank's B*T" +
                                  std::string(cp > 1 ? "/CP" : "") + " = " + std::to_string(B * Tl) +
                                  " tokens over TP = " + std::to_string(tp) +
                                  ", which does not divide them; use a batch or sequence length that makes them a "
                                  "multiple of TP, or NoSequenceParallel");
    // Ids are checked on the host on every device (a kernel cannot report a bad one).
    const std::size_t n = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    check_ids("tokens", tokens, n);
    if (targets != nullptr) check_ids("targets", targets, n);
  }
  static void check_ids(const char* what, const int* ids, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
      if (ids[i] < 0 || ids[i] >= V)
        throw std::invalid_argument(std::string("GPT::forward: ") + what + "[" + std::to_string(i) + "] = " +
                                    std::to_string(ids[i]) + " is outside [0, vocab = " + std::to_string(V) + ")");
  }

  void reserve_work(int B, int T_) {
    const std::size_t N = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    const std::size_t n = step_type::sp ? N / tp : N, c = C, f = F;
    if (N > work_.capacity) {
      Work w;
      w.capacity = N;
      w.out = make<T>(n * c);
      w.dres = make<T>(n * c);
      w.dln = make<T>(n * c);
      w.dhidden = make<T>(N * f / tp);
      w.dqkv = make<T>(N * 3 * c / tp);
      if constexpr (step_type::sp) w.partial = make<T>(N * c);
      if constexpr (cp > 1) w.ring.reserve(ops_, N, c / tp);
      if constexpr (has_experts) w.moe.reserve(ops_, N, c);
      if constexpr (recompute::whole_block) w.block.reserve(ops_, N, n, has_mlp_block, has_experts);
      if constexpr (recompute::attention_core) w.core.reserve(ops_, N, c);
      work_ = std::move(w);
    }
  }
  void reserve(Slot& a, int B, int T_) {
    reserve_work(B, T_);
    const std::size_t N = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    const std::size_t n = step_type::sp ? N / tp : N, c = C;
    if (N <= a.capacity) return;
    Slot s;
    s.capacity = N;
    s.tokens = make<int>(N);
    s.targets = make<int>(N);
    s.encoded = make<T>(n * c);
    s.blocks.resize(static_cast<std::size_t>(blocks));
    s.aux.assign(static_cast<std::size_t>(blocks), 0.0);
    for (int l = 0; l < blocks; ++l) {
      BlockActs& A = s.blocks[static_cast<std::size_t>(l)];
      if constexpr (recompute::whole_block) A.res3 = make<T>(n * c);  // the next block's input
      else A.reserve(ops_, N, n, !is_moe_block(l), is_moe_block(l));
    }
    if constexpr (has_head) {
      s.lnf.reserve(ops_, n, c);
      s.head.reserve(ops_, N, c, static_cast<std::size_t>(Vp));
    }
    a = std::move(s);
  }
  template <class U>
  Buffer<U, Device> make(std::size_t n) {
    return ops_.template make_buffer<U>(n);
  }

  std::vector<T> gather(const Buffer<T, Device>& local) {
    if constexpr (tp == 1) {
      return ops_.to_host(local.span());
    } else {  // gathered where the buffers live, then assembled on the host
      Buffer<T, Device> all = make<T>(local.size() * static_cast<std::size_t>(tp));
      comm_.all_gather(local.span(), all.span());
      std::vector<T> serial(serial_layout::size);
      layout::assemble(std::span<const T>(ops_.to_host(all.span())), std::span<T>(serial));
      return serial;
    }
  }
  static StreamHandle stream_of(ops_type& ops) {
    if constexpr (on_host) return nullptr;
    else return ops.stream();
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
  AxisComm<M, Axis::tp> comm_;
  AxisComm<M, Axis::cp> cp_comm_;
  ep_comm_type ep_comm_;
  int ep_rank_ = 0;
  Buffer<T, Device> params_, grads_;
  Buffer<T, Device> expert_params_, expert_grads_;  // empty without a mixture of experts
  Buffer<float, Device> router_bias_;               // AuxLossFreeBias: [MoE block][expert]
  std::vector<float> bias_host_;                    // the same, in host memory
  std::vector<double> loads_, last_loads_;          // rows per expert: this step's here, the last step's summed
  std::array<Buffer<T, Device>, layout::units> sp_partial_;  // SP only: per unit
  std::vector<Slot> slots_;
  Work work_;
  std::vector<int> local_ids_;  // CP: this rank's ids of a batch, on the host before upload
  Experts experts_view_;
};

}  // namespace fived
