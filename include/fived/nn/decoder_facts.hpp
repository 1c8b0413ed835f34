#pragma once
// What a Decoder<Arch, M, T, Device, SP, Part> is at compile time, before it holds anything:
// its types, widths and parameter tables, the facts the model contract asks of a model type
// (model/contract.hpp, docs/model.md: FLOPs, layers, MoE counts, the planner's shape, the
// configuration in words), the mesh's constraints on the configuration as sentences, and the
// sizes of a pipeline stage's boundary. The decoder's state is nn/decoder_params.hpp, its
// passes nn/decoder.hpp; both derive from this.

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include "fived/device/bf16.hpp"
#include "fived/device/buffer.hpp"
#include "fived/mesh/mesh.hpp"
#include "fived/model/layers.hpp"
#include "fived/model/plan_shape.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/decoder_specs.hpp"
#include "fived/nn/init.hpp"
#include "fived/nn/ops.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/stream.hpp"

namespace fived {

template <class Arch, MeshType M = Mesh<>, class T = float, class Device = Host, class SP = NoSequenceParallel,
          class Part = AllLayers>
struct DecoderFacts {
  static_assert(std::is_same_v<Device, Host> || std::is_same_v<Device, Cuda>,
                "a model's device must be fived::Host or fived::Cuda");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>,
                "a model's element type must be float, double (gradient checks) or fived::bf16");
  static_assert(!(std::is_same_v<Device, Cuda> && std::is_same_v<T, double>),
                "double is for host gradient checks; on Cuda use float or fived::bf16");

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
  // Whether a training step waits for the device in its MoE layers: dropless routing sizes
  // its exchange by counts read on the host (pad_to_capacity does not). The whole model's
  // answer, the same on every part, so every pipeline rank decides a step graph alike.
  static constexpr bool routing_waits = dims::experts > 0 && !config::pad_to_capacity;
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
  static std::string config_name() { return std::string(Arch::name) + ": " + DecoderFacts<Arch>::describe(); }
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

 protected:
  using ep_comm_type = typename step_type::ep_comm_type;

  static constexpr bool is_moe_block(int l) { return dims::is_moe(first_layer + l); }
  // Which of the part's MoE blocks block l is (its selection bias and loads).
  static constexpr int moe_index(int l) {
    int m = 0;
    for (int k = 0; k < l; ++k) m += is_moe_block(k) ? 1 : 0;
    return m;
  }

  // The index of the tensor called `name` in the layout, or an error that names the model.
  static int index_of(std::string_view name) {
    auto i = layout::find(name);
    if (!i)
      throw std::invalid_argument(std::string(Arch::name) + ": no parameter named '" + std::string(name) + "' (" +
                                  describe() + ")");
    return *i;
  }
};

}  // namespace fived
