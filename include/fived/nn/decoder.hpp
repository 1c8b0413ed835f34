#pragma once
// A decoder-only transformer on a mesh, composed from a block type: embedding -> blocks ->
// final norm -> head (tied to the embedding or its own) with the fused loss. One class for
// every architecture, parallel layout and device; an architecture says what its block is
// (nn/gpt.hpp: GPT-2's pre-norm block; examples/custom_model.cpp: parallel blocks; an
// architecture type names its config, block and name: docs/model.md, "Writing a model").
//
//   fived::Decoder<MyArch, Mesh<TP<2>>, float, Host, SequenceParallel> model(ctx, GptInit{.seed = 1});
//
// Decoder<Arch, M, T, Device, SP, Part>: the architecture, the mesh (its TP, CP and EP axes
// shape the model; DP is the trainer's, train/data_parallel.hpp; PP the executor's), the
// element type, the device, the sequence-parallel policy and the part of the layers held
// (AllLayers, or a pipeline stage's Layers<first, count>: input/output/output_grad/
// input_grad). Every collective is a call on AxisComm<M, Axis::tp>, AxisComm<M, Axis::cp>
// (ring attention) or the expert group's communicator, nothing at extent 1: Decoder<Arch,
// Mesh<>> is the serial model. Under CP every rank takes the whole [B, T] batch and keeps its
// two zig-zag chunks of each sequence (context/zigzag.hpp).
//
// A block type B gives its tensors (B::specs, B::expert_specs for a mixture of experts), its
// forward FLOPs and B::run<S>: its handles, what it keeps per slot and shares, and its
// forward and backward on step type S (nn/stream.hpp); docs/model.md writes the contract
// out. Recomputation (nn/recompute.hpp) is the decoder's for whole blocks and the block's
// for what it keeps inside.
//
// Three floors, one idea each: what the type is (nn/decoder_facts.hpp: widths, tables, the
// contract's facts), what it holds (nn/decoder_params.hpp: one flat buffer each for
// parameters and gradients, this rank's pieces laid out by the parameter table, with views,
// gathers and files), and here the passes over them; a block reaches its tensors through
// the handles bind_blocks() builds once. Activations live in per-micro-batch slots
// (set_slots(K); nn/decoder_slots.hpp), allocated on the first forward and again only for
// a larger B*T. The residual stream is [B*T, C] on every rank, or its rows split over TP
// with sequence parallelism (nn/stream.hpp). The loss is fused with its gradient (d-logits
// written over the logits, as llm.c does): forward(tokens, targets) leaves d-logits for
// backward(); forward(tokens, nullptr) leaves this rank's logits [B*T, Vp/TP] (logits()).
//
// Device: Host (T = float, double or bf16) or Cuda (T = float or bf16; include
// <fived/nn/cuda/ops.hpp> first, in a .cu file compiled by nvcc). On Cuda, forward() takes
// host token ids and waits for the loss (enqueue_forward() does not); logits() and the
// buffers (nn/decoder_params.hpp) are spans over DEVICE memory; *_to_host() copy.

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/mesh/context.hpp"
#include "fived/model/unit_hooks.hpp"
#include "fived/nn/decoder_batch.hpp"
#include "fived/nn/decoder_params.hpp"
#include "fived/nn/decoder_slots.hpp"
#include "fived/nn/embedding.hpp"
#include "fived/nn/head.hpp"
#include "fived/nn/stream.hpp"
#include "fived/nn/weight_grads.hpp"

namespace fived {

template <class Arch, MeshType M = Mesh<>, class T = float, class Device = Host, class SP = NoSequenceParallel,
          class Part = AllLayers>
class Decoder : public DecoderParams<Arch, M, T, Device, SP, Part> {
  using Params = DecoderParams<Arch, M, T, Device, SP, Part>;

 public:
  // (The facts and state this class reads, named because a dependent base's names are not
  // found unqualified; public as they are there.)
  using typename Params::dims, typename Params::specs, typename Params::expert_specs, typename Params::step_type,
      typename Params::ops_type, typename Params::recompute, typename Params::layout;
  using Params::tp, Params::cp, Params::C, Params::V, Params::Vp, Params::blocks, Params::first_layer,
      Params::has_embedding, Params::has_head, Params::has_experts, Params::has_router_bias, Params::on_host,
      Params::local_length;

  template <class P>
  using part = Decoder<Arch, M, T, Device, SP, P>;  // the same model holding other layers

  // A mesh without TP and CP (and EP, for a mixture of experts) needs no communicator.
  explicit Decoder(const GptInit& init = {}) requires(tp == 1 && cp == 1 && (Params::ep == 1 || !has_experts))
      : Decoder(AxisComm<M, Axis::tp>(), AxisComm<M, Axis::cp>(), ep_comm_type(), 0, init) {}
  // One rank of the mesh: binds its TP, CP and EP communicators. Initialised as the serial
  // model with the same GptInit, this rank's piece element by element.
  template <Communicator Comm>
  explicit Decoder(MeshContext<M, Comm>& ctx, const GptInit& init = {})
      : Decoder(Params::template bind<Axis::tp>(ctx), Params::template bind<Axis::cp>(ctx), Params::bind_ep(ctx),
                M::expert_group::index(ctx.rank()), init) {}

  // The load-balancing loss of the slot's last forward: the sum over the part's MoE blocks
  // (0 without them, or with aux_loss_coef 0). Its gradient is in backward(); loss() is the
  // language model's alone.
  // Read from the statistics the forward left in device memory: a wait for the device.
  double aux_loss(int slot = 0) const {
    double a = 0;
    if constexpr (balance_size > 0) {
      const Slot& sl = slots_.at(static_cast<std::size_t>(slot));
      if (sl.balance.size() == 0) return 0;  // no forward yet
      using stat_t = typename step_type::stat_t;
      const auto stats = ops_.to_host(std::span<const stat_t>(sl.balance.data(), sl.balance.size()));
      for (int l = 0; l < blocks; ++l)
        if (is_moe_block(l))
          a += Block::aux_loss(std::span<const stat_t>(stats).subspan(balance_at(l), balance_size), sl.B * sl.T_);
    }
    return a;
  }

  // ---- micro-batch slots ------------------------------------------------------------------

  // K activation slots: forward(slot k) keeps what backward(slot k) needs while the other
  // slots run. Allocated at the next forward of each slot.
  void set_slots(int k) {
    if (k < 1) throw std::invalid_argument(std::string(Arch::name) + "::set_slots: needs at least one slot, got " + std::to_string(k));
    slots_.resize(static_cast<std::size_t>(k));
  }
  int slots() const { return static_cast<int>(slots_.size()); }

  // ---- training or evaluation ---------------------------------------------------------------

  // Off: a forward with targets is an evaluation (a held-out loss) and keeps no statistic for
  // the optimizer step (a mixture of experts' loads, which balance_experts moves the selection
  // bias by), so the next step is what it would have been without it. On from the start.
  void set_training(bool on) { training_ = on; }
  bool training() const { return training_; }

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
    DecoderBatch<DecoderFacts<Arch, M, T, Device, SP, Part>>::check(tokens, targets, B, T_);
    if (!this->params_written())
      throw std::logic_error(std::string(Arch::name) + "::forward: the model was made with GptInit{.deferred = "
                             "true}, so its trainer writes its parameters: make the DataParallel first");
    const int Tl = local_length(T_);
    Slot& a = slot_at(slot);
    if (a.tape >= 0)
      throw std::logic_error(std::string(Arch::name) + "::forward: slot " + std::to_string(slot) +
                             " still holds a backward_input's weight gradients; call backward_weight first");
    reserve(a, B, Tl);
    a.B = B, a.T_ = Tl;
    batch_.upload(ops_, a.tokens, tokens, B, T_, cp_comm_.rank());
    if (targets != nullptr) batch_.upload(ops_, a.targets, targets, B, T_, cp_comm_.rank());
    if constexpr (dims::documents) batch_.upload_documents(ops_, a.doc_first, tokens, B, T_, cp_comm_.rank());
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
          if constexpr (balance_size > 0) ops_.copy(a.balance.data() + balance_at(l), Block::balance(A), balance_size);
          if (targets != nullptr && training_)
            balance_.count(ops_, moe_index(l), Block::expert_loads(A));  // for balance_experts
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
      a.loss_pending = a.has_dlogits = true;  // loss() reads it (a step reads add_to_loss_sum's sum instead)
    }
  }

  // The mean loss of the slot's last forward with targets (the same on every TP rank), in
  // stat_t precision summed in double. The first call after a forward computes it (on Cuda,
  // waits for it).
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
    const int t = tapes_.take();
    try {
      run_backward(hooks, a, &tapes_[t]);
    } catch (...) {  // (no forward to go back from) the tape stays free
      tapes_.give_back(t);
      throw;
    }
    a.tape = t;
  }
  void backward_weight(const UnitHooks& hooks = {}, int slot = 0) {
    Slot& a = slot_at(slot);
    if (a.tape < 0)
      throw std::logic_error(std::string(Arch::name) + "::backward_weight: call backward_input(hooks, " +
                             std::to_string(slot) + ") first (once per backward_weight)");
    WeightGradTape<ops_type>& tape = tapes_[a.tape];
    tapes_.give_back(std::exchange(a.tape, -1));
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

  // ---- a pipeline stage's boundary (parts: Layers<first, count>; sizes: boundary_size) ------
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

 private:
  using typename Params::ep_comm_type;
  using Params::is_moe_block, Params::moe_index, Params::P, Params::G, Params::finish_unit, Params::ops_,
      Params::comm_, Params::cp_comm_, Params::ep_comm_, Params::balance_, Params::p_at_, Params::g_at_,
      Params::ep_at_, Params::eg_at_;

  using Norm = typename Arch::template final_norm<step_type>;
  using HeadL = Head<step_type>;
  using Block = typename Arch::block::template run<step_type>;

  static constexpr int ln_f_index = specs::block_first(blocks);
  static constexpr int head_index = dims::tied && has_embedding ? 0 : ln_f_index + specs::norm_count;  // or wte's copy
  // The learned position embedding's parameters or gradient, or none (rotary positions).
  static T* positions(const std::array<T*, layout::count>& at) {
    if constexpr (specs::embedding_count == 2) return at[1];
    else return nullptr;
  }

  // The balancing statistics of one MoE block (a block without experts need not say).
  static constexpr std::size_t balance_size = [] {
    if constexpr (has_experts) return static_cast<std::size_t>(Block::balance_size);
    else return std::size_t{0};
  }();
  // Where MoE block l's balancing statistics start in a slot's balance (l = blocks: how many).
  static constexpr std::size_t balance_at(int l) { return static_cast<std::size_t>(Params::moe_index(l)) * balance_size; }

  using Slot = DecoderSlot<step_type, Block, Norm, HeadL>;  // nn/decoder_slots.hpp
  using Work = DecoderWork<step_type, Block>;
  static constexpr SlotShape slot_shape{first_layer, blocks, has_head, recompute::whole_block, C,
                                        static_cast<std::size_t>(Vp),
                                        static_cast<std::size_t>(Params::moe_index(blocks)) * balance_size,
                                        dims::documents};

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
      : Params(std::move(comm), std::move(cp_comm), std::move(ep_comm), ep_rank, init), slots_(1) {
    // (The whole model on a PP mesh is a type the Trainer reads facts from, never an object.)
    static_assert(M::pp == 1 || !std::is_same_v<Part, AllLayers>,
                  "a model on a mesh with PP > 1: each rank holds one stage's layers, not the whole model; give the "
                  "model its part as the last template argument, Layers<first, count> (fived::Trainer does this for "
                  "you)");
    bind_blocks();
  }

  // Every block's typed handles to its parameters and to where its gradients accumulate,
  // taken once from the tables (the buffers never move).
  void bind_blocks() {
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

  step_type step(const Slot& a) {
    return step_type{ops_, comm_, cp_comm_, a.B, a.T_, &ep_comm_, dims::documents ? a.doc_first.data() : nullptr};
  }

  Slot& slot_at(int k) {
    if (k < 0 || k >= slots())
      throw std::out_of_range(std::string(Arch::name) + ": slot " + std::to_string(k) + " does not exist (the model has " +
                              std::to_string(slots()) + "; set_slots(k) adds more)");
    return slots_[static_cast<std::size_t>(k)];
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

  std::vector<typename Block::Params> block_params_, block_grads_;
  typename Norm::Params norm_params_{}, norm_grads_{};  // the final norm's (a part with the head)
  std::vector<Slot> slots_;
  Work work_;
  // Split backwards (backward_input): one tape per micro-batch awaiting backward_weight.
  WeightGradTapes<ops_type> tapes_;
  DecoderBatch<DecoderFacts<Arch, M, T, Device, SP, Part>> batch_;  // the ids' checks and upload (CP: this rank's chunks)
  bool training_ = true;  // set_training
};

}  // namespace fived
