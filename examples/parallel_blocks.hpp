#pragma once
// A model fived does not ship, written outside namespace fived against its model contract
// (docs/model.md): GPT-J / PaLM-style parallel blocks, attention and MLP side by side from one
// LayerNorm,
//
//   x = x + attn(ln(x)) + mlp(ln(x))
//
// on fived's decoder (embedding -> blocks -> final norm -> head). The block is all there
// is to write: its tensors (names, shapes, TP placement, initialisation), its typed
// parameter handles, what it keeps for backward, and forward and backward over fived's
// tensor-parallel layers. Every axis comes from fived: TP (the layers' collectives), SP, CP
// (ring attention inside Attention), PP (the decoder cuts the blocks), DP/ZeRO (the Trainer).
// examples/custom_model.cpp trains it; tests/test_custom_model.cpp checks it against serial.

#include <cstddef>
#include <cstdint>

#include <fived/nn/attention.hpp>
#include <fived/nn/decoder.hpp>
#include <fived/nn/gpt.hpp>  // Gpt2Ends
#include <fived/nn/layernorm.hpp>
#include <fived/nn/mlp.hpp>

namespace parallel_gpt {

// 4 blocks of width 48, 4 heads, an MLP 3 times as wide; a 64-token vocabulary; its own head.
struct config : fived::gpt_config {
  static constexpr int layers = 4, d_model = 48, heads = 4, mlp_ratio = 3;
  static constexpr int vocab = 64, max_seq = 32, vocab_multiple = 16;
  static constexpr bool tied = false;
};

template <class Cfg>
struct ParallelBlock {
  using dims = fived::gpt_dims<Cfg>;
  static constexpr int C = dims::d_model, F = dims::d_ff;

  // ln, attention, MLP (Hugging Face GPT-2 names): a stream of random numbers each.
  static constexpr fived::SpecList<10> specs(int layer, int unit, std::uint64_t stream) {
    fived::SpecList<10> s;
    s += fived::layernorm_specs("ln_1.weight", "ln_1.bias", layer, unit, C, stream);
    s += fived::attention_specs(layer, unit, C, stream + 2);
    s += fived::mlp_specs(layer, unit, C, F, stream + 6);
    return s;
  }
  // Forward matmul FLOPs per token: q|k|v, the projection and the MLP's two.
  static constexpr double flops() { return 2.0 * (3.0 + 1.0 + 2.0 * dims::mlp_ratio) * C * C; }

  template <class S>  // S: fived's step (nn/stream.hpp): the mesh, element type, device, SP
  struct run {
    using T = typename S::value_type;
    using Norm = fived::LayerNorm<S>;
    using Attn = fived::Attention<S, dims::heads, typename dims::context_attention>;  // CP: ring or all-gather
    using Mlp = fived::MLP<S>;
    template <class U>
    using buffer = fived::Buffer<U, typename S::device>;

    struct Params {
      T *ln_w, *ln_b;
      typename Attn::Params attn;
      typename Mlp::Params mlp;
    };
    // The handles, taken in the order specs() lists the tensors.
    static Params bind(int, fived::TensorCursor<T>& dense, fived::TensorCursor<T>&, const float*) {
      Params p{};
      p.ln_w = dense.take(), p.ln_b = dense.take();
      p.attn = {dense.take(), dense.take(), dense.take(), dense.take()};
      p.mlp = {dense.take(), dense.take(), dense.take(), dense.take()};
      return p;
    }

    struct Saved {  // per block and micro-batch
      typename Norm::Saved ln;
      typename Attn::Saved attn;
      typename Mlp::Saved mlp;
      void reserve(typename S::ops_type& ops, std::size_t N, std::size_t n, int, int) {
        ln.reserve(ops, n, C);
        attn.reserve(ops, N, C, true);
        mlp.reserve(ops, N, C, F);
      }
    };
    struct Work {  // shared by every block and micro-batch
      buffer<T> dhidden, dqkv;     // [N, F/TP] (also attention's d(core)), [N, 3C/TP]
      typename Attn::ContextWork ring;  // context parallelism's ring
      void reserve(typename S::ops_type& ops, std::size_t N, std::size_t, int, int) {
        dhidden = ops.template make_buffer<T>(N * F / S::tp);
        dqkv = ops.template make_buffer<T>(N * 3 * C / S::tp);
        if constexpr (S::cp > 1) ring.reserve(ops, N, C / S::tp);
      }
    };

    static void forward(S& s, Saved& a, Work& w, fived::StreamScratch<T> k, const Params& p, const T* x, T* out, int) {
      const std::size_t n = static_cast<std::size_t>(s.local_rows()) * C;
      Norm::forward(s, a.ln, x, p.ln_w, p.ln_b, C);
      Attn::forward(s, a.attn, a.attn.core, w.ring, k.out, a.ln.out.data(), p.attn, C, k.partial);
      s.ops.residual_forward(out, x, k.out, n);  // x + attn
      Mlp::forward(s, a.mlp, k.out, a.ln.out.data(), p.mlp, C, F, k.partial);
      s.ops.residual_forward(out, out, k.out, n);  // + mlp
    }
    // dres: d(out) in, d(x) out (the residual's and the norm's). Gradients "+=" into g.
    static void backward(S& s, Saved& a, Work& w, fived::StreamScratch<T> k, const Params& p, const Params& g,
                         const T* x, T* dres, int) {
      const std::size_t n = static_cast<std::size_t>(s.local_rows()) * C;
      Mlp::backward(s, k.dln, g.mlp, dres, a.ln.out.data(), a.mlp, p.mlp, C, F, w.dhidden.data(), k.partial);
      Attn::backward(s, w.ring, k.out, g.attn, dres, a.ln.out.data(), a.attn, a.attn.core, p.attn, C,
                     w.dhidden.data(), w.dqkv.data(), k.partial);
      s.ops.residual_forward(k.dln, k.dln, k.out, n);  // d(ln(x)): both branches
      Norm::backward(s, dres, g.ln_w, g.ln_b, k.dln, x, p.ln_w, a.ln, C);
    }
  };
};

struct ParallelGPT : fived::Gpt2Ends {  // GPT-2's embedding (wte, wpe) and final LayerNorm
  using config = parallel_gpt::config;
  using block = ParallelBlock<config>;
  static constexpr const char* name = "ParallelGPT";
  static constexpr fived::plan::Transformer plan_shape() {  // for the planner: GPT-2's shape, parallel blocks
    fived::plan::Transformer m = fived::plan::from_gpt<config>();
    m.parallel_blocks = true;
    return m;
  }
};

// The model on mesh M (its part P on a pipeline stage: the Trainer picks it).
template <class M = fived::Mesh<>, class SP = fived::NoSequenceParallel, class P = fived::AllLayers>
using Model = fived::Decoder<ParallelGPT, M, float, fived::Host, SP, P>;

}  // namespace parallel_gpt
