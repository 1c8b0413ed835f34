#pragma once
// GPT-2 on a mesh: embedding -> pre-norm blocks -> ln_f -> tied head, written against the
// decoder (nn/decoder.hpp) as its block type and nothing else.
//
//   struct tiny : fived::gpt_config { static constexpr int layers = 2, d_model = 64, heads = 4,
//                                     vocab = 256, max_seq = 64; };
//   fived::GPT<tiny> model(fived::GptInit{.seed = 42});            // Mesh<>: the serial model
//   double loss = model.forward(tokens, targets, B, T);           // mean cross-entropy over B*T
//   model.zero_grad(); model.backward();                          // grads accumulate until zero_grad()
//
//   auto ctx = fived::make_mesh_context<Mesh<TP<4>>>(world);       // one rank of a TP group
//   fived::GPT<tiny, Mesh<TP<4>>, float, Host, SequenceParallel> tp_model(ctx, GptInit{.seed = 42});
//
// GPT<Cfg, M, T, Device, SP, Part> is Decoder<Gpt2<Cfg>, M, T, Device, SP, Part>: the
// configuration (nn/config.hpp), the mesh, the element type, the device, the
// sequence-parallel policy and the part of the layers the object holds (a pipeline stage's
// Layers<first, count>). Everything but the block is the decoder's.
//
// The block is pre-LayerNorm:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x)), with a mixture
// of experts (nn/moe.hpp) in place of the MLP in the configuration's MoE blocks. Its tensors
// carry Hugging Face GPT-2's names and shapes ("h.3.attn.c_attn.weight"), so a GPT-2 file
// loads as it is; their random streams are the ones GPT-2 has always had here,
// (layer + 1) * 64 + position in the block.

#include <array>
#include <cstdint>
#include <vector>

#include "fived/nn/attention.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/decoder.hpp"
#include "fived/nn/embedding.hpp"
#include "fived/nn/gpt_shape.hpp"
#include "fived/nn/layernorm.hpp"
#include "fived/nn/mlp.hpp"
#include "fived/nn/moe.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/pre_norm_saved.hpp"

namespace fived {

template <class Cfg>
struct PreNormBlock {
  using dims = gpt_dims<Cfg>;
  static constexpr int C = dims::d_model, F = dims::d_ff;

  // ln_1, attention, ln_2, then the MLP's 4 tensors or a mixture of experts' router (its
  // experts are in expert_specs, the second table).
  static constexpr SpecList<12> specs(int layer, int unit, std::uint64_t stream) {
    SpecList<12> s;
    s += layernorm_specs("ln_1.weight", "ln_1.bias", layer, unit, C, stream + 2);
    s += attention_specs(layer, unit, C, stream + 4);
    s += layernorm_specs("ln_2.weight", "ln_2.bias", layer, unit, C, stream + 8);
    if (dims::is_moe(layer)) s += router_specs(layer, unit, C, dims::experts, stream + 16);
    else s += mlp_specs(layer, unit, C, F, stream + 10);
    return s;
  }
  static constexpr std::array<TensorSpec, 4> expert_specs(int layer, int unit, std::uint64_t stream) {
    return fived::expert_specs(layer, unit, C, F, dims::experts, stream + 17);
  }
  // Forward matmul FLOPs per token: qkv, proj and the MLP at ratio r, 2·(3 + 1 + 2r)·C².
  static constexpr double flops() { return 2.0 * (3.0 + 1.0 + 2.0 * dims::mlp_ratio) * double(C) * C; }

  template <class S>
  struct run {
    using T = typename S::value_type;
    using ops_type = typename S::ops_type;
    using recompute = typename dims::recompute;
    using Norm = LayerNorm<S>;
    using Attn = Attention<S, dims::heads, typename dims::context_attention>;
    using Mlp = MLP<S>;
    using Moe = MoE<S, Cfg>;

    struct Params {
      T *ln_1_w, *ln_1_b;
      typename Attn::Params attn;
      T *ln_2_w, *ln_2_b;
      typename Mlp::Params mlp;  // or, in an MoE block:
      typename Moe::Params moe;
      const float* router_bias;  // AuxLossFreeBias's selection bias, or none
    };
    static Params bind(int layer, TensorCursor<T>& dense, TensorCursor<T>& experts, const float* router_bias) {
      Params p{};
      p.ln_1_w = dense.take(), p.ln_1_b = dense.take();
      p.attn = {dense.take(), dense.take(), dense.take(), dense.take()};
      p.ln_2_w = dense.take(), p.ln_2_b = dense.take();
      if (dims::is_moe(layer))
        p.moe = {dense.take(), experts.take(), experts.take(), experts.take(), experts.take()}, p.router_bias = router_bias;
      else
        p.mlp = {dense.take(), dense.take(), dense.take(), dense.take()};
      return p;
    }

    // What forward leaves for backward (the core attention only without SelectiveRecompute).
    using Saved = PreNormSaved<S, dims, Norm, Attn, Mlp, Moe, C, F>;
    struct Work {
      Buffer<T, typename S::device> dhidden, dqkv;  // [N, F/TP], [N, 3C/TP]
      typename Attn::ContextWork ring;              // CP: the ring's (or all-gather's) buffers
      typename Moe::Work moe;                       // router and dispatch buffers
      typename Attn::Core core;                     // SelectiveRecompute: the core being run
      void reserve(ops_type& ops, std::size_t N, std::size_t, int first, int count) {
        dhidden = ops.template make_buffer<T>(N * F / S::tp);
        dqkv = ops.template make_buffer<T>(N * 3 * C / S::tp);
        if constexpr (S::cp > 1) ring.reserve(ops, N, C / S::tp);
        if (dims::any_block(first, count, true)) moe.reserve(ops, N, C);
        if constexpr (recompute::attention_core) core.reserve(ops, N, C);
      }
    };

    static void forward(S& s, Saved& a, Work& w, StreamScratch<T> k, const Params& p, const T* x, T* out, int layer) {
      const std::size_t n = static_cast<std::size_t>(s.local_rows()) * C;
      Norm::forward(s, a.ln_1, x, p.ln_1_w, p.ln_1_b, C);
      Attn::forward(s, a.attn, a.core(w), w.ring, k.out, a.ln_1.out.data(), p.attn, C, k.partial);
      Norm::forward_residual(s, a.ln_2, a.res2.data(), x, k.out, {p.ln_2_w, p.ln_2_b}, C);
      if (dims::is_moe(layer)) Moe::forward(s, a.moe, w.moe, k.out, a.ln_2.out.data(), p.moe, p.router_bias, C, F, k.partial);
      else Mlp::forward(s, a.mlp, k.out, a.ln_2.out.data(), p.mlp, C, F, k.partial);
      s.ops.residual_forward(out, a.res2.data(), k.out, n);
    }
    // dres holds d(out); leaves d(x) there. Gradients "+=" into g.
    static void backward(S& s, Saved& a, Work& w, StreamScratch<T> k, const Params& p, const Params& g, const T* x,
                         T* dres, int layer) {
      if constexpr (recompute::attention_core) Attn::core_forward(s, a.attn, w.core, w.ring, C);
      if (dims::is_moe(layer))
        Moe::backward(s, a.moe, w.moe, k.dln, g.moe, dres, a.ln_2.out.data(), p.moe, C, F, k.partial);
      else
        Mlp::backward(s, k.dln, g.mlp, dres, a.ln_2.out.data(), a.mlp, p.mlp, C, F, w.dhidden.data(), k.partial);
      Norm::backward(s, dres, g.ln_2_w, g.ln_2_b, k.dln, a.res2.data(), p.ln_2_w, a.ln_2, C);  // dres: d(res2)
      Attn::backward(s, w.ring, k.dln, g.attn, dres, a.ln_1.out.data(), a.attn, a.core(w), p.attn, C,
                     w.dhidden.data(), w.dqkv.data(), k.partial);
      Norm::backward(s, dres, g.ln_1_w, g.ln_1_b, k.dln, x, p.ln_1_w, a.ln_1, C);
    }
    // A MoE block's rows per expert (device memory), its balancing statistics (balance_size of
    // them, device memory) and the balancing loss they give for N tokens.
    static constexpr int balance_size = Moe::balance_size;
    using stat_t = typename S::stat_t;
    static const stat_t* expert_loads(const Saved& a) { return a.moe.loads.data(); }
    static const stat_t* balance(const Saved& a) { return a.moe.balance.data(); }
    static double aux_loss(std::span<const stat_t> balance, int N) { return Moe::aux_loss(balance, N); }
  };
};

// GPT-2's ends of the decoder: the token and learned position embeddings (wte, wpe) and
// the final LayerNorm (ln_f). An architecture with other blocks may keep them (derive).
struct Gpt2Ends {
  static constexpr auto embedding_specs(int V, int Vp, int C, int max_seq) {
    return fived::embedding_specs(V, Vp, C, max_seq);
  }
  template <class S>
  using final_norm = LayerNorm<S>;
  static constexpr auto final_norm_specs(int unit, int C) {
    return layernorm_specs("ln_f.weight", "ln_f.bias", -1, unit, C, 14);
  }
};

// GPT-2 as a decoder architecture.
template <class Cfg>
struct Gpt2 : Gpt2Ends {
  using config = Cfg;
  using block = PreNormBlock<Cfg>;
  static constexpr const char* name = "GPT";
  static constexpr plan::Transformer plan_shape() { return plan::from_gpt<Cfg>(); }
};

template <class Cfg, MeshType M = Mesh<>, class T = float, class Device = Host, class SP = NoSequenceParallel,
          class Part = AllLayers>
using GPT = Decoder<Gpt2<Cfg>, M, T, Device, SP, Part>;

// GPT-2's parameter tables (the dense one and the experts'), as the decoder lays them out.
template <class Cfg, class Part = AllLayers>
using GptSpecs = DecoderSpecs<Gpt2<Cfg>, Part>;
template <class Cfg, class Part = AllLayers>
using ExpertSpecs = DecoderExpertSpecs<Gpt2<Cfg>, Part>;

}  // namespace fived
