#pragma once
// What a pre-norm block's forward leaves for its backward, shared by GPT-2's PreNormBlock
// (nn/gpt.hpp) and Llama's LlamaBlock (nn/llama.hpp):
//
//   x -> ln_1 -> attention -> res2 = x + attention -> ln_2 -> MLP or a mixture of experts
//
// per block and micro-batch slot: both norms' outputs and statistics, the attention's (its
// core only when the model does not recompute it), the stream between the two halves, and
// the MLP's or the MoE's, each only when one of the blocks [first, first + count) it serves
// has that kind. C: the stream's width; F: the MLP's hidden width.

#include <cstddef>

#include "fived/device/buffer.hpp"

namespace fived {

template <class S, class Dims, class Norm, class Attn, class Mlp, class Moe, int C, int F>
struct PreNormSaved {
  typename Norm::Saved ln_1, ln_2;
  typename Attn::Saved attn;
  Buffer<typename S::value_type, typename S::device> res2;  // the stream after attention
  typename Mlp::Saved mlp;
  typename Moe::Saved moe;

  void reserve(typename S::ops_type& ops, std::size_t N, std::size_t n, int first, int count) {
    ln_1.reserve(ops, n, C);
    attn.reserve(ops, N, C, !Dims::recompute::attention_core);
    res2 = ops.template make_buffer<typename S::value_type>(n * C);
    ln_2.reserve(ops, n, C);
    if (Dims::any_block(first, count, false)) mlp.reserve(ops, N, C, F);
    if (Dims::any_block(first, count, true)) moe.reserve(ops, N, C);
  }
  // Where the core attention runs: this slot's, or under SelectiveRecompute the one the
  // block's Work shares (w.core).
  template <class Work>
  typename Attn::Core& core(Work& w) {
    if constexpr (Dims::recompute::attention_core) return w.core;
    else return attn.core;
  }
};

}  // namespace fived
