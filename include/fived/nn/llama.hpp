#pragma once
// Llama 3 on a mesh: token embedding -> pre-RMSNorm blocks (grouped-query attention with
// rotary positions, SwiGLU MLP) -> RMSNorm -> untied head, written against the decoder
// (nn/decoder.hpp) as its block type and its two ends.
//
//   struct tiny : fived::llama_config { static constexpr int layers = 2, d_model = 64, heads = 4,
//                                       kv_heads = 2, ffn = 160, vocab = 256, max_seq = 64; };
//   fived::Llama<tiny> model(fived::GptInit{.seed = 1});                   // the serial model
//   fived::Llama<tiny, Mesh<TP<2>>, float, Host, SequenceParallel> tp_model(ctx, GptInit{.seed = 1});
//
// The block:  x = x + o_proj(attn(rope(q|k|v(rmsnorm_1(x)))));  x = x + down(silu(gate) * up).
// Tensors carry Hugging Face LlamaForCausalLM's names and shapes
// ("model.layers.3.self_attn.k_proj.weight" [kv_heads * head size, d_model]), so its
// safetensors files load as they are; rotary embeddings pair column i with i + head size / 2
// as Hugging Face does. No biases anywhere. TP must divide kv_heads or be a multiple of it.

#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/nn/attention.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/decoder.hpp"
#include "fived/nn/embedding.hpp"
#include "fived/nn/moe.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/pre_norm_saved.hpp"
#include "fived/nn/rmsnorm.hpp"
#include "fived/nn/rotary_attention.hpp"
#include "fived/nn/swiglu.hpp"
#include "fived/model/plan_shape.hpp"

namespace fived {

// Llama 3.1 8B ("meta-llama/Llama-3.1-8B"). Derive and hide the members to change them.
struct llama_config : gpt_config {
  static constexpr int layers = 32;
  static constexpr int d_model = 4096;
  static constexpr int heads = 32;
  static constexpr int kv_heads = 8;  // grouped-query attention: heads / kv_heads queries share a key/value head
  static constexpr int ffn = 14336;   // the SwiGLU MLP's hidden width
  static constexpr int vocab = 128256;
  static constexpr int max_seq = 8192;  // the longest sequence a batch may have (no position table)
  static constexpr bool tied = false;
  static constexpr int vocab_multiple = 128;
  using context_attention = AllGatherContext;  // under CP, as Llama 3 trains long context (or RingContext)
  // Rotary embeddings: base θ and Llama 3.1's frequency scaling (factor 1 turns it off).
  static constexpr double rope_theta = 500000.0;
  static constexpr double rope_factor = 8.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  static constexpr int rope_original_max_seq = 8192;
};

// Llama 3's "405B" (Dubey et al. 2024, Table 3), as Hugging Face's Llama-3.1-405B config.
struct llama3_405b_config : llama_config {
  static constexpr int layers = 126, d_model = 16384, heads = 128, kv_heads = 8, ffn = 53248;
};

// What the Llama block derives from a configuration, checked once.
template <class Cfg>
struct llama_dims : gpt_dims<Cfg> {
  static constexpr int kv_heads = Cfg::kv_heads, ffn = Cfg::ffn;
  static constexpr int head_size = Cfg::d_model / Cfg::heads;
  static constexpr int kv_width = kv_heads * head_size;  // k_proj and v_proj rows
  static_assert(kv_heads >= 1 && Cfg::heads % kv_heads == 0,
                "llama config: kv_heads must divide heads (each key/value head serves heads / kv_heads queries)");
  static_assert(head_size % 2 == 0, "llama config: the head size (d_model / heads) must be even for rotary embeddings");
  static_assert(ffn >= 1, "llama config: ffn must be at least 1");
  static_assert(Cfg::rope_theta > 1 && Cfg::rope_factor >= 1 && Cfg::rope_high_freq_factor > Cfg::rope_low_freq_factor,
                "llama config: rope_theta > 1, rope_factor >= 1 and rope_high_freq_factor > rope_low_freq_factor");

  // The rotary frequencies θ^(-2i/hd), i < hd/2, with Llama 3.1's scaling: wavelengths longer
  // than original / low are slowed by the factor, shorter than original / high kept, and
  // those in between interpolated (Hugging Face's "llama3" rope type).
  static std::vector<double> inv_freq() {
    std::vector<double> f(static_cast<std::size_t>(head_size / 2));
    const double orig = Cfg::rope_original_max_seq, low = Cfg::rope_low_freq_factor, high = Cfg::rope_high_freq_factor;
    for (std::size_t i = 0; i < f.size(); ++i) {
      const double base = 1.0 / std::pow(Cfg::rope_theta, 2.0 * static_cast<double>(i) / head_size);
      const double wavelen = 2 * std::numbers::pi / base;
      if (wavelen < orig / high) f[i] = base;
      else if (wavelen > orig / low) f[i] = base / Cfg::rope_factor;
      else {
        const double smooth = (orig / wavelen - low) / (high - low);
        f[i] = (1 - smooth) * base / Cfg::rope_factor + smooth * base;
      }
    }
    return f;
  }
};

template <class Cfg>
struct LlamaBlock {
  using dims = llama_dims<Cfg>;
  static constexpr int C = dims::d_model, F = dims::ffn, KVC = dims::kv_width;
  static_assert(2 * F >= C, "llama config: ffn must be at least d_model / 2 (d(gate | up) also holds d(attention))");

  static constexpr SpecList<9> specs(int layer, int unit, std::uint64_t stream) {
    SpecList<9> s;
    s += rmsnorm_specs("input_layernorm.weight", layer, unit, C, stream + 2);
    s += rotary_attention_specs(layer, unit, C, dims::kv_heads, KVC, stream + 4);
    s += rmsnorm_specs("post_attention_layernorm.weight", layer, unit, C, stream + 8);
    if (dims::is_moe(layer)) s += router_specs<TorchLinear>(layer, unit, C, dims::experts, stream + 16);
    else s += swiglu_specs(layer, unit, C, F, stream + 10);
    return s.in_scope("model.layers.");
  }
  // A mixture of experts' SwiGLU experts, each as wide as the dense MLP (Mixtral-like).
  static constexpr std::array<TensorSpec, 2> expert_specs(int layer, int unit, std::uint64_t stream) {
    std::array<TensorSpec, 2> t = swiglu_expert_specs(layer, unit, C, F, dims::experts, stream + 17);
    for (TensorSpec& x : t) x.scope = "model.layers.";
    return t;
  }
  static std::string describe() {  // what Decoder::describe adds
    return std::to_string(dims::kv_heads) + " key/value heads, SwiGLU " + std::to_string(F) + ", rotary theta " +
           std::to_string(static_cast<long long>(Cfg::rope_theta)) +
           (Cfg::rope_factor > 1 ? " scaled x" + std::to_string(static_cast<int>(Cfg::rope_factor)) : std::string());
  }
  // Forward matmul FLOPs per token: q|k|v, o_proj and the three SwiGLU matrices.
  static constexpr double flops() { return 2.0 * (double(C) * (C + 2 * KVC) + double(C) * C + 3.0 * C * F); }

  template <class S>
  struct run {
    using T = typename S::value_type;
    using stat_t = typename S::stat_t;
    using ops_type = typename S::ops_type;
    using recompute = typename dims::recompute;
    using Norm = RMSNorm<S>;
    using Attn = RotaryAttention<S, dims::heads, dims::kv_heads, typename dims::context_attention>;
    using Mlp = SwiGLU<S>;
    using Moe = MoE<S, Cfg, true>;  // SwiGLU experts
    static_assert(F % S::tp == 0,
                  "tensor parallelism splits the SwiGLU hidden width over TP: make ffn in the config a multiple of the "
                  "TP extent");

    struct Params {
      typename Norm::Params ln_1;
      typename Attn::Params attn;
      typename Norm::Params ln_2;
      typename Mlp::Params mlp;  // or, in an MoE block:
      typename Moe::Params moe;
      const float* router_bias;  // AuxLossFreeBias's selection bias, or none
    };
    static Params bind(int layer, TensorCursor<T>& dense, TensorCursor<T>& experts, const float* router_bias) {
      Params p{};
      p.ln_1 = Norm::bind(dense), p.attn = Attn::bind(dense, C, KVC), p.ln_2 = Norm::bind(dense);
      if (dims::is_moe(layer))
        p.moe = {dense.take(), experts.take(), nullptr, experts.take(), nullptr}, p.router_bias = router_bias;
      else
        p.mlp = Mlp::bind(dense, C, F);
      return p;
    }

    // What forward leaves for backward (the core attention only without SelectiveRecompute).
    using Saved = PreNormSaved<S, dims, Norm, Attn, Mlp, Moe, C, F>;
    struct Work {
      Buffer<stat_t, typename S::device> inv_freq;          // [head size / 2]
      Buffer<T, typename S::device> dqkv;       // d(q|k|v) [N, (C + 2KVC)/TP] (KVC/KV per rank above the KV heads)
      Buffer<T, typename S::device> dh, dgu;    // [N, F/TP], [N, 2F/TP] (also d(core) [N, C/TP])
      typename Attn::ContextWork ring;
      typename Attn::Work attn;  // TP above the key/value heads: their gradients' sum
      typename Attn::Core core;  // SelectiveRecompute: the core being run
      typename Moe::Work moe;    // router and dispatch buffers
      void reserve(ops_type& ops, std::size_t N, std::size_t, int first, int count) {
        if (dims::any_block(first, count, true)) moe.reserve(ops, N, C);
        const std::vector<double> f = dims::inv_freq();
        const std::vector<stat_t> g(f.begin(), f.end());
        inv_freq = ops.template make_buffer<stat_t>(g.size());
        ops.upload(inv_freq.data(), g.data(), g.size());
        dqkv = ops.template make_buffer<T>(N * static_cast<std::size_t>(Attn::raw_width(C, KVC)));
        dh = ops.template make_buffer<T>(N * F / S::tp);
        dgu = ops.template make_buffer<T>(N * 2 * F / S::tp);
        if constexpr (S::cp > 1) ring.reserve(ops, N, C / S::tp);
        attn.reserve(ops, C, KVC);
        if constexpr (recompute::attention_core) core.reserve(ops, N, C);
      }
    };

    static void forward(S& s, Saved& a, Work& w, StreamScratch<T> k, const Params& p, const T* x, T* out, int layer) {
      const std::size_t n = static_cast<std::size_t>(s.local_rows()) * C;
      Norm::forward(s, a.ln_1, x, p.ln_1, C);
      Attn::forward(s, a.attn, a.core(w), w.ring, k.out, a.ln_1.out.data(), p.attn, C, KVC, w.inv_freq.data(),
                    k.partial);
      Norm::forward_residual(s, a.ln_2, a.res2.data(), x, k.out, p.ln_2, C);
      if (dims::is_moe(layer))
        Moe::forward(s, a.moe, w.moe, k.out, a.ln_2.out.data(), p.moe, p.router_bias, C, F, k.partial);
      else
        Mlp::forward(s, a.mlp, k.out, a.ln_2.out.data(), p.mlp, C, F, k.partial);
      s.ops.residual_forward(out, a.res2.data(), k.out, n);
    }
    // dres holds d(out); leaves d(x) there. Gradients "+=" into g.
    static void backward(S& s, Saved& a, Work& w, StreamScratch<T> k, const Params& p, const Params& g, const T* x,
                         T* dres, int layer) {
      if constexpr (recompute::attention_core) Attn::core_forward(s, a.attn, w.core, w.ring, C);
      if (dims::is_moe(layer))
        Moe::backward(s, a.moe, w.moe, k.dln, g.moe, dres, a.ln_2.out.data(), p.moe, C, F, k.partial);
      else
        Mlp::backward(s, k.dln, g.mlp, dres, a.ln_2.out.data(), a.mlp, p.mlp, C, F, w.dh.data(), w.dgu.data(),
                      k.partial);
      Norm::backward(s, dres, g.ln_2, k.dln, a.res2.data(), p.ln_2, a.ln_2, C);  // dres: d(res2)
      Attn::backward(s, w.ring, w.attn, k.dln, g.attn, dres, a.ln_1.out.data(), a.attn, a.core(w), p.attn, C, KVC,
                     w.inv_freq.data(), w.dgu.data(), w.dqkv.data(), k.partial);
      Norm::backward(s, dres, g.ln_1, k.dln, x, p.ln_1, a.ln_1, C);
    }
    // A MoE block's rows per expert (device memory), its balancing statistics (balance_size of
    // them, device memory) and the balancing loss they give for N tokens.
    static constexpr int balance_size = Moe::balance_size;
    static const stat_t* expert_loads(const Saved& a) { return a.moe.loads.data(); }
    static const stat_t* balance(const Saved& a) { return a.moe.balance.data(); }
    static double aux_loss(std::span<const stat_t> balance, int N) { return Moe::aux_loss(balance, N); }
  };
};

// Llama 3 as a decoder architecture.
template <class Cfg>
struct Llama3 {
  using config = Cfg;
  using block = LlamaBlock<Cfg>;
  static constexpr const char* name = "Llama";
  static constexpr auto embedding_specs(int V, int Vp, int C, int) {
    return token_embedding_specs("model.embed_tokens.weight", V, Vp, C);
  }
  template <class S>
  using final_norm = RMSNorm<S>;
  static constexpr auto final_norm_specs(int unit, int C) { return rmsnorm_specs("model.norm.weight", -1, unit, C, 14); }
  static constexpr plan::Transformer plan_shape() {
    using d = llama_dims<Cfg>;
    plan::Transformer m;
    m.layers = d::layers, m.d_model = d::d_model, m.heads = d::heads, m.kv_heads = d::kv_heads, m.d_ff = d::ffn;
    m.gated = true, m.vocab = d::vocab, m.padded_vocab = d::padded_vocab, m.tied = d::tied, m.biases = false;
    m.norm = plan::Norm::rms_norm, m.positions = 0;
    m.experts = d::experts, m.top_k = d::experts > 0 ? d::top_k : 0, m.moe_every = d::moe_every, m.dense_first = 0;
    m.expert_d_ff = d::ffn, m.shared_experts = 0, m.balancing_loss = d::experts > 0 && Cfg::aux_loss_coef > 0;
    m.capacity_factor = d::experts > 0 ? Cfg::capacity_factor : 0;
    m.pad_to_capacity = d::experts > 0 && Cfg::pad_to_capacity;
    m.allgather_context = std::is_same_v<typename d::context_attention, AllGatherContext>;
    m.documents = d::documents;
    return m;
  }
};

template <class Cfg, MeshType M = Mesh<>, class T = float, class Device = Host, class SP = NoSequenceParallel,
          class Part = AllLayers>
using Llama = Decoder<Llama3<Cfg>, M, T, Device, SP, Part>;

}  // namespace fived
