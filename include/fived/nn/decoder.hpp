#pragma once
// A decoder-only transformer on a mesh, composed from a block type: embedding -> blocks ->
// final LayerNorm -> head (tied to the embedding or its own) with the fused loss. One class
// for every architecture, parallel layout and device; an architecture only says what its
// block is (nn/gpt.hpp: GPT-2's pre-norm block; examples/custom_model.cpp: parallel blocks).
//
//   struct MyArch {
//     using config = my_config;          // a gpt_config: widths, vocabulary, experts, recompute
//     using block = MyBlock<my_config>;  // the block type (below, and docs/model.md)
//     static constexpr const char* name = "MyModel";
//     static constexpr plan::Transformer plan_shape();  // optional: for the planner
//   };
//   fived::Decoder<MyArch, Mesh<TP<2>>, float, Host, SequenceParallel> model(ctx, GptInit{.seed = 1});
//
// Decoder<Arch, M, T, Device, SP, Part>: the architecture, the mesh (its TP, CP and EP
// axes shape the model; data parallelism is the trainer's, train/data_parallel.hpp;
// pipeline stages are the executor's), the element type, the device, the sequence-parallel
// policy and the part of the layers this object holds (AllLayers, or a pipeline stage's
// Layers<first, count>: see input/output/output_grad/input_grad). Every collective is a
// call on AxisComm<M, Axis::tp>, AxisComm<M, Axis::cp> (ring attention) or the expert
// group's communicator; each compiles to nothing at extent 1: Decoder<Arch, Mesh<>> is the
// serial model. Under CP every rank takes the whole [B, T] batch and keeps its two zig-zag
// chunks of each sequence (context/zigzag.hpp).
//
// A block type B (GPT-2's is nn/gpt.hpp's PreNormBlock) gives its tensors (B::specs, and
// B::expert_specs for a mixture of experts), its forward FLOPs and B::run<S>: its handles,
// what it keeps per slot and shares, and its forward and backward on step type S
// (nn/stream.hpp); docs/model.md writes the contract out. Recomputation (nn/recompute.hpp)
// is the decoder's for whole blocks and the block's for what it keeps inside.
//
// Parameters and gradients are one flat buffer each, laid out at compile time by the
// parameter table (nn/param_table.hpp: this rank's pieces, in HF order); a block reaches
// its tensors through the handles bind() builds once. Activations live in per-micro-batch
// slots (set_slots(K); nn/decoder_slots.hpp), sized for B*T at run time: allocated on the
// first forward and reallocated only when a larger B*T comes. The residual stream is
// [B*T, C] on every rank, or its rows split over TP with sequence parallelism
// (nn/stream.hpp).
//
// The loss is fused with its gradient (d-logits written over the logits, as llm.c does):
// forward(tokens, targets) leaves d-logits for backward(); forward(tokens, nullptr)
// computes no loss and leaves this rank's logits [B*T, Vp/TP] readable (logits()).
//
// Device: Host (T = float, double or bf16) or Cuda (T = float or bf16; include
// <fived/nn/cuda/ops.hpp> first, in a .cu file compiled by nvcc). On Cuda, forward() takes
// host token ids and waits for the loss (enqueue_forward() does not); params(), grads(),
// param(), grad() and logits() are spans over DEVICE memory; *_to_host() copy.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/mesh/mesh_comm.hpp"
#include "fived/device/bf16.hpp"
#include "fived/device/buffer.hpp"
#include "fived/io/safetensors.hpp"
#include "fived/mesh/context.hpp"
#include "fived/mesh/mesh.hpp"
#include "fived/model/layers.hpp"
#include "fived/nn/checkpoint.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/decoder_slots.hpp"
#include "fived/nn/decoder_specs.hpp"
#include "fived/nn/embedding.hpp"
#include "fived/nn/expert_balance.hpp"
#include "fived/nn/head.hpp"
#include "fived/nn/init.hpp"
#include "fived/nn/layernorm.hpp"
#include "fived/nn/ops.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/sp_partial_grads.hpp"
#include "fived/nn/stream.hpp"
#include "fived/nn/tensor_view.hpp"
#include "fived/nn/weight_grads.hpp"
#include "fived/model/unit_hooks.hpp"
#include "fived/model/plan_shape.hpp"

namespace fived {

template <class Arch, MeshType M = Mesh<>, class T = float, class Device = Host, class SP = NoSequenceParallel,
          class Part = AllLayers>
class Decoder {
  static_assert(std::is_same_v<Device, Host> || std::is_same_v<Device, Cuda>,
                "a model's device must be fived::Host or fived::Cuda");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>,
                "a model's element type must be float, double (gradient checks) or fived::bf16");
  static_assert(!(std::is_same_v<Device, Cuda> && std::is_same_v<T, double>),
                "double is for host gradient checks; on Cuda use float or fived::bf16");

 public:
  using arch = Arch;
  using config = typename Arch::config;
  using mesh = M;
  using dims = gpt_dims<config>;
  using value_type = T;
  using device = Device;
  using sequence_parallel = SP;
  using recompute = typename dims::recompute;  // nn/recompute.hpp
  using ops_type = Ops<T, Device>;
  using stat_t = typename ops_type::stat_t;
  using step_type = Step<M, T, Device, SP>;
  static constexpr int tp = M::extent(Axis::tp);
  static constexpr int cp = M::extent(Axis::cp);
  using sequence_split = LocalSequence<typename step_type::split>;  // context parallelism's
  using specs = DecoderSpecs<Arch, Part>;
  using layout = ParamTable<specs, tp>;           // this rank's flat buffers
  using serial_layout = typename layout::serial;  // the same tensors whole, at TP 1 (files, gathers)
  // A mixture of experts keeps its experts in a second pair of flat buffers (nn/moe.hpp):
  // this rank's experts (E/EP) and their TP slice.
  static constexpr int ep = M::ep;
  using expert_specs = DecoderExpertSpecs<Arch, Part>;
  using expert_layout = ParamTable<expert_specs, tp, ep>;
  static constexpr bool has_experts = expert_layout::count > 0;
  static constexpr bool has_router_bias = has_experts && config::balancing::bias;
  static constexpr int moe_blocks = expert_specs::moe_blocks;
  static constexpr bool on_host = std::is_same_v<Device, Host>;
  // The part this object holds: blocks [first_layer, first_layer + blocks); the embedding
  // and the head (with the loss) when it starts or ends the model.
  static constexpr int first_layer = specs::first, blocks = specs::blocks;
  static constexpr bool has_embedding = specs::has_embedding, has_head = specs::has_head;
  // A tied head on a stage without the embedding keeps its own copy of wte (specs::tied_copy).
  static constexpr bool has_tied_copy = specs::tied_copy;
  // The tensor tied across the first and last stage (model contract, optional): the pipeline
  // executor sums its gradient over the stages that hold it. None when untied.
  static constexpr const char* tied_weight = dims::tied ? specs::embedding[0].name : nullptr;

  static constexpr int L = dims::layers, C = dims::d_model, NH = dims::heads, V = dims::vocab;
  static constexpr int Vp = dims::padded_vocab, max_seq = dims::max_seq;
  static constexpr std::size_t num_params = layout::size;  // this rank's buffer elements, padding included

  // ---- what the model contract asks of a model type (model/contract.hpp, docs/model.md) -----

  using init_type = GptInit;
  static constexpr bool calls_hooks = true;    // forward and backward call UnitHooks per unit
  static constexpr int layers = dims::layers;  // the whole model's blocks: what pipeline stages cut
  template <class P>
  using part = Decoder<Arch, M, T, Device, SP, P>;  // the same model holding other layers
  using serial_expert_layout = typename expert_layout::serial;
  // Matmul FLOPs per token of the forward, what StageLayers balances stages by.
  static constexpr double block_flops() { return Arch::block::flops(); }
  static constexpr double embedding_flops() { return 0.0; }
  static constexpr double head_flops() { return 2.0 * double(C) * Vp; }
  // The whole model's FLOPs per token of a training step (forward and backward), the MFU
  // numerator: 6 per parameter a token meets (the experts it is routed to, not all) and
  // 12·L·C·T for attention's two T-long products (no causal discount, as PaLM and llm.c).
  static constexpr double flops_per_token(int T_) {
    double n = static_cast<double>(ParamTable<DecoderSpecs<Arch>, 1>::num_parameters);
    if constexpr (DecoderExpertSpecs<Arch>::moe_blocks > 0)
      n += static_cast<double>(ParamTable<DecoderExpertSpecs<Arch>, 1, 1>::num_parameters) * dims::top_k / dims::experts;
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
  // The architecture and configuration, the same on every mesh and part (what a checkpoint
  // records and checks).
  static std::string config_name() { return std::string(Arch::name) + ": " + Decoder<Arch>::describe(); }
  // The model as the planner reads it (plan::from_model), when the architecture describes itself.
  static constexpr plan::Transformer plan_shape()
    requires requires { Arch::plan_shape(); }
  {
    return Arch::plan_shape();
  }

  static_assert(NH % tp == 0,
                "tensor parallelism splits the attention heads over TP: the number of heads must be a multiple of the "
                "TP extent (change heads in the config, or use a TP that divides it)");
  static_assert(dims::d_ff % tp == 0,
                "tensor parallelism splits the MLP hidden width (mlp_ratio * d_model) over TP: make it a multiple of "
                "the TP extent");
  static_assert(dims::experts % ep == 0,
                "expert parallelism spreads the experts over EP: the number of experts must be a multiple of the EP "
                "extent (change experts in the config, or use an EP that divides it)");
  static_assert(Vp % tp == 0,
                "the vocabulary is split over TP: the padded vocabulary must be a multiple of the TP extent (make "
                "vocab_multiple in the config a multiple of TP)");

  // A mesh without TP and CP (and EP, for a mixture of experts) needs no communicator.
  explicit Decoder(const GptInit& init = {}) requires(tp == 1 && cp == 1 && (ep == 1 || !has_experts))
      : Decoder(AxisComm<M, Axis::tp>(), AxisComm<M, Axis::cp>(), ep_comm_type(), 0, init) {}
  // One rank of the mesh: binds its TP, CP and EP communicators. Initialised as the serial
  // model with the same GptInit, this rank's piece element by element.
  template <Communicator Comm>
  explicit Decoder(MeshContext<M, Comm>& ctx, const GptInit& init = {})
      : Decoder(bind<Axis::tp>(ctx), bind<Axis::cp>(ctx), bind_ep(ctx), M::expert_group::index(ctx.rank()), init) {}

  Decoder(const Decoder&) = delete;  // a bound communicator, device buffers and handles into them
  Decoder& operator=(const Decoder&) = delete;

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
    using ops_type = typename Decoder::ops_type;
    using layout = expert_layout;
    using grad_group = typename M::expert_data_group;
    static constexpr double grad_scale = 1.0 / ep;
    static constexpr bool calls_hooks = true;  // the model's forward and backward call them for it

    explicit Experts(Decoder& m) : m_(m) {}
    ops_type& ops() { return m_.ops_; }
    std::span<T> params() { return m_.expert_params_.span(); }
    std::span<T> grads() { return m_.expert_grads_.span(); }
    void zero_grad() { m_.ops_.zero(m_.expert_grads_); }
    std::vector<T> params_to_host() const { return m_.ops_.to_host(std::span<const T>(m_.expert_params_.span())); }
    std::vector<FlatRange> norm_parts(FlatRange r) const { return layout::norm_parts(r, m_.tp_rank()); }
    double sum_over_tp(double s) { return m_.ep_comm_.all_reduce_host(m_.comm_.all_reduce_host(s)); }

   private:
    Decoder& m_;
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
    if constexpr (has_experts) balance_.step(group, ops_);
  }
  // Rows per expert in the last balanced step, [MoE block][expert] (empty before the first).
  const std::vector<double>& expert_loads() const { return balance_.last_loads(); }
  // The selection bias of the part's m-th MoE block (AuxLossFreeBias), [expert].
  std::span<const float> router_bias(int m) const { return balance_.bias(m); }
  // Sets it (a resumed run's, or a test's skewed router); the same on every rank of a replica.
  void set_router_bias(int m, std::span<const float> bias) requires(config::balancing::bias) {
    balance_.set_bias(m, bias, ops_, std::string(Arch::name) + "::set_router_bias");
  }

  // ---- micro-batch slots ------------------------------------------------------------------

  // K activation slots: forward(slot k) keeps what backward(slot k) needs while the other
  // slots run. Allocated at the next forward of each slot.
  void set_slots(int k) {
    if (k < 1) throw std::invalid_argument(std::string(Arch::name) + "::set_slots: needs at least one slot, got " + std::to_string(k));
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
    if (a.tape >= 0)
      throw std::logic_error(std::string(Arch::name) + "::forward: slot " + std::to_string(slot) +
                             " still holds a backward_input's weight gradients; call backward_weight first");
    reserve(a, B, Tl);
    a.B = B, a.T_ = Tl;
    upload_local(a.tokens, tokens, B, T_);
    if (targets != nullptr) upload_local(a.targets, targets, B, T_);
    a.has_dlogits = a.loss_pending = false;
    a.loss = 0;
    step_type s = step(a);

    if constexpr (has_embedding) {
      detail::call(hooks.before_forward, 0);
      Embedding<step_type>::forward(s, a.encoded.data(), a.tokens.data(), P(0), positions(p_at_), Vp, C, work_.partial.data());
      detail::call(hooks.after_forward, 0);
    }  // else the previous stage's output was received into input(slot)
    const T* x = a.encoded.data();
    for (int l = 0; l < blocks; ++l) {
      detail::call(hooks.before_forward, specs::block_unit(l));
      typename Block::Saved& A = saved(a, l);
      T* out = a.out[static_cast<std::size_t>(l)].data();  // kept under every recompute policy
      Block::forward(s, A, work_.block, scratch(), block_params_[static_cast<std::size_t>(l)], x, out, first_layer + l);
      if constexpr (has_experts)
        if (is_moe_block(l)) {
          a.aux[static_cast<std::size_t>(l)] = Block::aux_loss(A);
          if (targets != nullptr) balance_.count(moe_index(l), Block::expert_counts(A));  // for balance_experts
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
      Norm::forward(s, a.lnf, x, norm_params_, C);
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
  // (model/unit_hooks.hpp): before_backward(u) before unit u's parameters are read or its
  // gradients written, after_backward(u) as soon as they are final (under SP, after the
  // unit's LayerNorm gradients are all-reduced over TP). Units finish from the last to 0.
  void backward(const UnitHooks& hooks = {}, int slot = 0) { run_backward(hooks, slot_at(slot), nullptr); }

  // The same backward in two halves, for the zero-bubble pipeline schedules (I and W,
  // pipeline/action.hpp): backward_input makes d(input) (input_grad()) and leaves every
  // weight gradient on a tape (nn/weight_grads.hpp); backward_weight makes them, in
  // the same order, so the two together give backward()'s gradients bit for bit. The slot
  // keeps its activations until backward_weight, and the model one tape of snapshots for
  // each micro-batch between the two (nn/weight_grads.hpp). Hooks: before_backward(u) and
  // after_input_grad(u) around each unit in the first, before_weight_grad(u) and
  // after_backward(u) in the second.
  void backward_input(const UnitHooks& hooks = {}, int slot = 0) {
    Slot& a = slot_at(slot);
    if (a.tape >= 0)
      throw std::logic_error(std::string(Arch::name) + "::backward_input: slot " + std::to_string(slot) +
                             " still waits for backward_weight of its last backward_input");
    if (free_tapes_.empty()) free_tapes_.push_back(static_cast<int>(tapes_.size())), tapes_.emplace_back();
    const int t = free_tapes_.back();
    free_tapes_.pop_back();
    try {
      run_backward(hooks, a, &tapes_[static_cast<std::size_t>(t)]);
    } catch (...) {  // (no forward to go back from) the tape stays free
      free_tapes_.push_back(t);
      throw;
    }
    a.tape = t;
  }
  void backward_weight(const UnitHooks& hooks = {}, int slot = 0) {
    Slot& a = slot_at(slot);
    if (a.tape < 0)
      throw std::logic_error(std::string(Arch::name) + "::backward_weight: call backward_input(hooks, " +
                             std::to_string(slot) + ") first (once per backward_weight)");
    WeightGradTape<ops_type>& tape = tapes_[static_cast<std::size_t>(a.tape)];
    free_tapes_.push_back(std::exchange(a.tape, -1));
    tape.run(
        ops_,
        [&](int u) {
          detail::call(hooks.before_weight_grad, u);
          if constexpr (dims::tied && has_embedding)  // the head writes wte's gradient
            if (u == specs::final_unit) detail::call(hooks.before_weight_grad, 0);
        },
        [&](int u) {
          finish_unit(u);
          detail::call(hooks.after_backward, u);
        });
  }

  // ---- a pipeline stage's boundary (parts: Layers<first, count>) ------------------------------
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
      throw std::logic_error(std::string(Arch::name) +
                             "::logits: the last forward had targets, its logits were replaced by d-logits");
    return {a.head.logits.data(), static_cast<std::size_t>(a.B) * static_cast<std::size_t>(a.T_) * (Vp / tp)};
  }
  std::vector<T> logits_to_host(int slot = 0) const { return ops_.to_host(logits(slot)); }

  // ---- safetensors, with Hugging Face names and shapes ----------------------------------------

  // The whole model's file (nn/checkpoint.hpp): gathered over TP, written by TP rank 0
  // (atomic: a temporary file, then rename); every rank returns once the file is complete.
  void save(const std::filesystem::path& path, const std::map<std::string, std::string>& metadata = {}) {
    if constexpr (has_experts)
      throw std::logic_error(std::string(Arch::name) +
                             "::save: a mixture of experts has no single-file format (its experts live in a second "
                             "buffer the Hugging Face file has no names for); use Trainer::save, a sharded checkpoint");
    if constexpr (tp == 1) {
      ops_.read_to_host(params_, [&](std::span<const T> p) { save_gpt<serial_layout>(path, p, metadata); });
    } else {
      const std::vector<T> all = gather_params();
      if (tp_rank() == 0) save_gpt<serial_layout>(path, std::span<const T>(all), metadata);
      comm_.barrier();
    }
  }

  // Reads Hugging Face weights (any floating dtype, names with or without "transformer.") and
  // keeps this rank's piece. A missing, mis-shaped or unknown tensor is an
  // io::SafetensorsError naming it, and the model is left unchanged.
  void load(const std::filesystem::path& path) { load(io::SafetensorsFile::read(path)); }
  void load(const io::SafetensorsFile& f) {
    const std::vector<T> serial = read_serial(f);
    ops_.write_from_host(params_, [&](std::span<T> p) { layout::slice(std::span<const T>(serial), p, tp_rank()); });
  }

  // The part's tensors of a Hugging Face file, in serial_layout (the model contract's way in
  // for given weights: Trainer::load_weights).
  static std::vector<T> read_serial(const io::SafetensorsFile& f) {
    if constexpr (has_experts)
      throw std::logic_error(std::string(Arch::name) +
                             "::load: a mixture of experts cannot be loaded from a Hugging Face file yet");
    std::vector<T> serial(serial_layout::size);
    load_gpt<serial_layout>(f, std::span<T>(serial), describe());
    return serial;
  }

  // The configuration in words; a block type may add its own facts (B::describe()).
  static std::string describe() {
    std::string block;
    if constexpr (requires { Arch::block::describe(); }) block = ", " + std::string(Arch::block::describe());
    return std::to_string(L) + " layers, d_model " + std::to_string(C) + ", " + std::to_string(NH) + " heads" + block +
           ", vocab " + std::to_string(V) + ", max_seq " + std::to_string(max_seq) + (dims::tied ? ", tied" : ", untied") +
           (blocks != L ? ", the part with blocks " + std::to_string(first_layer) + ".." +
                              std::to_string(first_layer + blocks - 1) + (has_embedding ? " and the embedding" : "") +
                              (has_head ? " and the head" : "")
                        : std::string()) +
           (dims::experts > 0 ? ", " + std::to_string(dims::experts) + " experts top-" + std::to_string(dims::top_k) +
                                    " every " + std::to_string(dims::moe_every) + " blocks"
                              : std::string()) +
           (tp > 1 || cp > 1 || (ep > 1 && has_experts)
                ? ", over " + M::name() + (step_type::sp ? " with sequence parallelism" : "")
                : std::string()) +
           (recompute::attention_core || recompute::whole_block ? std::string(", recompute: ") + recompute::name
                                                                : std::string());
  }

 private:
  using Norm = typename Arch::template final_norm<step_type>;
  using HeadL = Head<step_type>;
  using Block = typename Arch::block::template run<step_type>;
  using ep_comm_type = typename step_type::ep_comm_type;

  static constexpr bool is_moe_block(int l) { return dims::is_moe(first_layer + l); }
  // Which of the part's MoE blocks block l is (its selection bias and loads).
  static constexpr int moe_index(int l) {
    int m = 0;
    for (int k = 0; k < l; ++k) m += is_moe_block(k) ? 1 : 0;
    return m;
  }
  static constexpr int ln_f_index = specs::block_first(blocks);
  static constexpr int head_index = dims::tied && has_embedding ? 0 : ln_f_index + specs::norm_count;  // or wte's copy
  // The learned position embedding's parameters or gradient, or none (rotary positions).
  static T* positions(const std::array<T*, layout::count>& at) {
    if constexpr (specs::embedding_count == 2) return at[1];
    else return nullptr;
  }

  using Slot = DecoderSlot<step_type, Block, Norm, HeadL>;  // nn/decoder_slots.hpp
  using Work = DecoderWork<step_type, Block>;
  static constexpr SlotShape slot_shape{first_layer, blocks, has_head, recompute::whole_block, C,
                                        static_cast<std::size_t>(Vp)};

  typename Block::Saved& saved(Slot& a, int l) {
    if constexpr (recompute::whole_block) return work_.rerun;
    else return a.blocks[static_cast<std::size_t>(l)];
  }
  StreamScratch<T> scratch() { return {work_.out.data(), work_.dln.data(), work_.partial.data()}; }

  // backward(), or with a tape backward_input(): each unit's weight gradients left on it.
  void run_backward(const UnitHooks& hooks, Slot& a, WeightGradTape<ops_type>* tape) {
    if (!a.has_dlogits)
      throw std::logic_error(std::string(Arch::name) +
                             (has_head ? "::backward: call forward(tokens, targets, B, T) with targets first (once "
                                         "per backward)"
                                       : "::backward: call forward first (once per backward)"));
    a.has_dlogits = false;
    step_type s = step(a);
    s.tape = tape;
    T* dres = work_.dres.data();
    auto begin_unit = [&](int u) {
      detail::call(hooks.before_backward, u);
      if (tape != nullptr) tape->begin_unit(u);
    };
    auto end_unit = [&](int u) {
      if (tape != nullptr) return detail::call(hooks.after_input_grad, u);
      finish_unit(u);
      detail::call(hooks.after_backward, u);
    };

    if constexpr (has_head) {
      begin_unit(specs::final_unit);
      if constexpr (dims::tied && has_embedding) detail::call(hooks.before_backward, 0);  // the head is wte
      HeadL::backward(s, work_.dln.data(), G(head_index), a.head, a.lnf.out.data(), P(head_index), Vp, C,
                      work_.partial.data());
      ops_.zero(work_.dres);
      const T* x_last = blocks > 0 ? a.out[static_cast<std::size_t>(blocks - 1)].data() : a.encoded.data();
      Norm::backward(s, dres, norm_grads_, work_.dln.data(), x_last, norm_params_, a.lnf, C);
      end_unit(specs::final_unit);
    }  // else dres holds d(output), received into output_grad()

    s.recomputed = recompute::whole_block;  // the blocks' saved activations: shared, recomputed
    for (int l = blocks - 1; l >= 0; --l) {
      begin_unit(specs::block_unit(l));
      typename Block::Saved& A = saved(a, l);
      const T* x = l == 0 ? a.encoded.data() : a.out[static_cast<std::size_t>(l - 1)].data();
      const auto& p = block_params_[static_cast<std::size_t>(l)];
      if constexpr (recompute::whole_block) Block::forward(s, A, work_.block, scratch(), p, x, work_.rerun_out.data(), first_layer + l);
      Block::backward(s, A, work_.block, scratch(), p, block_grads_[static_cast<std::size_t>(l)], x, dres, first_layer + l);
      end_unit(specs::block_unit(l));
    }
    s.recomputed = false;
    if constexpr (has_embedding) {
      begin_unit(0);
      Embedding<step_type>::backward(s, G(0), positions(g_at_), dres, a.tokens.data(), Vp, C, work_.partial.data());
      end_unit(0);  // wte (which a tied head also wrote) and wpe
    }  // else dres holds d(input): input_grad()
  }

  Decoder(AxisComm<M, Axis::tp> comm, AxisComm<M, Axis::cp> cp_comm, ep_comm_type ep_comm, int ep_rank,
          const GptInit& init)
      : comm_(std::move(comm)), cp_comm_(std::move(cp_comm)), ep_comm_(std::move(ep_comm)), ep_rank_(ep_rank),
        params_(ops_.template make_buffer<T>(num_params, releasable_pages)),
        grads_(ops_.template make_buffer<T>(num_params, releasable_pages)),
        expert_params_(ops_.template make_buffer<T>(expert_layout::size, releasable_pages)),
        expert_grads_(ops_.template make_buffer<T>(expert_layout::size, releasable_pages)),
        balance_(ops_, moe_blocks), sp_partial_(ops_), slots_(1), experts_view_(*this) {
    // (The whole model on a PP mesh is a type the Trainer reads facts from, never an object.)
    static_assert(M::pp == 1 || !std::is_same_v<Part, AllLayers>,
                  "a model on a mesh with PP > 1: each rank holds one stage's layers, not the whole model; give the "
                  "model its part as the last template argument, Layers<first, count> (fived::Trainer does this for "
                  "you)");
    comm_.set_compute_stream(stream_of(ops_));     // TP collectives in the order of the model's kernels
    cp_comm_.set_compute_stream(stream_of(ops_));  // and the ring's transfers
    ep_comm_.set_compute_stream(stream_of(ops_));  // and the experts' all-to-all
    ops_.write_from_host(params_, [&](std::span<T> p) { init_params<layout>(p, tp_rank(), init); });
    if constexpr (has_experts)
      ops_.write_from_host(expert_params_,
                           [&](std::span<T> p) { init_params<expert_layout>(p, tp_rank(), init, ep_rank_); });
    bind_blocks();
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

  // Every block's typed handles to its parameters and to where its gradients accumulate,
  // taken once from the tables (the buffers never move).
  void bind_blocks() {
    for (int i = 0; i < layout::count; ++i) p_at_[static_cast<std::size_t>(i)] = P(i), g_at_[static_cast<std::size_t>(i)] = G(i);
    for (int i = 0; i < expert_layout::count; ++i) {
      const std::size_t off = expert_layout::tensors[static_cast<std::size_t>(i)].offset;
      ep_at_[static_cast<std::size_t>(i)] = expert_params_.data() + off;
      eg_at_[static_cast<std::size_t>(i)] = expert_grads_.data() + off;
    }
    if constexpr (has_head) {
      TensorCursor<T> p(p_at_.data() + ln_f_index), g(g_at_.data() + ln_f_index);
      norm_params_ = Norm::bind(p), norm_grads_ = Norm::bind(g);
    }
    for (int l = 0; l < blocks; ++l) {
      const float* bias = has_router_bias && is_moe_block(l) ? balance_.device_bias(moe_index(l)) : nullptr;
      auto take = [&](const auto& dense, const auto& experts) {
        TensorCursor<T> d(dense.data() + specs::block_first(l)), e(experts.data() + expert_specs::block_first(l));
        return Block::bind(first_layer + l, d, e, bias);
      };
      block_params_.push_back(take(p_at_, ep_at_));
      block_grads_.push_back(take(g_at_, eg_at_));
    }
  }

  step_type step(const Slot& a) { return step_type{ops_, comm_, cp_comm_, a.B, a.T_, &ep_comm_}; }

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

  T* P(int i) { return params_.data() + layout::tensors[static_cast<std::size_t>(i)].offset; }
  // Where tensor i's gradient accumulates: the gradient buffer, or under SP, for a gradient
  // summed over this rank's rows, its unit's partial buffer (finish_unit reduces it).
  T* G(int i) {
    if (T* partial = sp_partial_.at(i)) return partial;
    return grads_.data() + layout::tensors[static_cast<std::size_t>(i)].offset;
  }
  // Unit u's backward is done: under SP its partial gradients are summed over TP.
  void finish_unit(int u) { sp_partial_.finish(u, comm_, ops_, grads_.data()); }

  Slot& slot_at(int k) {
    if (k < 0 || k >= slots())
      throw std::out_of_range(std::string(Arch::name) + ": slot " + std::to_string(k) + " does not exist (the model has " +
                              std::to_string(slots()) + "; set_slots(k) adds more)");
    return slots_[static_cast<std::size_t>(k)];
  }

  void check_batch(const int* tokens, const int* targets, int B, int T_) const {
    const std::string fn = std::string(Arch::name) + "::forward: ";
    if (B < 1 || T_ < 1 || T_ > max_seq)
      throw std::invalid_argument(fn + "needs B >= 1 and 1 <= T <= max_seq = " + std::to_string(max_seq) +
                                  " (got B=" + std::to_string(B) + ", T=" + std::to_string(T_) + ")");
    if (tokens == nullptr) throw std::invalid_argument(fn + "tokens is nullptr");
    const int Tl = local_length(T_);
    if (step_type::sp && (B * Tl) % tp != 0)
      throw std::invalid_argument(fn + "sequence parallelism splits this rank's B*T" + std::string(cp > 1 ? "/CP" : "") +
                                  " = " + std::to_string(B * Tl) + " tokens over TP = " + std::to_string(tp) +
                                  ", which does not divide them; use a batch or sequence length that makes them a "
                                  "multiple of TP, or NoSequenceParallel");
    // Ids are checked on the host on every device (a kernel cannot report a bad one).
    const std::size_t n = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    check_ids(fn, "tokens", tokens, n);
    if (targets != nullptr) check_ids(fn, "targets", targets, n);
  }
  static void check_ids(const std::string& fn, const char* what, const int* ids, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
      if (ids[i] < 0 || ids[i] >= V)
        throw std::invalid_argument(fn + what + "[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                                    " is outside [0, vocab = " + std::to_string(V) + ")");
  }

  // Activations for B x T rows (this rank's T): the shared work, and slot a's.
  void reserve_work(int B, int T_) {
    const std::size_t N = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    work_.reserve(ops_, N, step_type::sp ? N / tp : N, slot_shape);
  }
  void reserve(Slot& a, int B, int T_) {
    reserve_work(B, T_);
    const std::size_t N = static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    a.reserve(ops_, N, step_type::sp ? N / tp : N, slot_shape);
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
    if (!i)
      throw std::invalid_argument(std::string(Arch::name) + ": no parameter named '" + std::string(name) + "' (" +
                                  describe() + ")");
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
  ExpertBalance<config, Device> balance_;           // rows per expert, AuxLossFreeBias's selection bias
  SpPartialGrads<layout, T, Device, step_type::sp> sp_partial_;
  std::array<T*, layout::count> p_at_{}, g_at_{};           // each tensor's parameters and gradient
  std::array<T*, expert_layout::count> ep_at_{}, eg_at_{};  // the same for the experts
  std::vector<typename Block::Params> block_params_, block_grads_;
  typename Norm::Params norm_params_{}, norm_grads_{};  // the final norm's (a part with the head)
  std::vector<Slot> slots_;
  Work work_;
  // Split backwards (backward_input): one tape per micro-batch awaiting backward_weight.
  std::vector<WeightGradTape<ops_type>> tapes_;
  std::vector<int> free_tapes_;
  std::vector<int> local_ids_;  // CP: this rank's ids of a batch, on the host before upload
  Experts experts_view_;
};

}  // namespace fived
