#pragma once
// fived's GPT configuration as the planner's plan::Transformer (model/plan_shape.hpp):
// plan::from_gpt<Cfg>(), what GPT::plan_shape() returns (nn/gpt.hpp).

#include <type_traits>

#include "fived/model/plan_shape.hpp"
#include "fived/nn/config.hpp"

namespace fived::plan {

// fived's GPT (nn/gpt.hpp) as a Transformer: LayerNorm with bias, biases on every linear
// layer, a GELU MLP of mlp_ratio·C, learned positions [max_seq, C], multi-head attention,
// the vocabulary padded to vocab_multiple; a mixture of experts every moe_every-th block,
// with experts as wide as the MLP (their biases stacked: c_fc.bias [E, F], c_proj.bias [E, C]).
template <class Cfg>
constexpr Transformer from_gpt() {
  using d = gpt_dims<Cfg>;
  Transformer m;
  m.layers = d::layers, m.d_model = d::d_model, m.heads = d::heads, m.kv_heads = d::heads, m.d_ff = d::d_ff;
  m.gated = false, m.vocab = d::vocab, m.padded_vocab = d::padded_vocab, m.tied = d::tied, m.biases = true;
  m.norm = Norm::layer_norm, m.positions = d::max_seq;
  m.allgather_context = std::is_same_v<typename d::context_attention, AllGatherContext>;
  m.documents = d::documents;
  m.experts = d::experts, m.top_k = d::experts > 0 ? d::top_k : 0, m.moe_every = d::moe_every, m.dense_first = 0;
  m.expert_d_ff = d::d_ff, m.shared_experts = 0, m.balancing_loss = d::experts > 0 && Cfg::aux_loss_coef > 0;
  m.capacity_factor = d::experts > 0 ? Cfg::capacity_factor : 0;
  m.pad_to_capacity = d::experts > 0 && Cfg::pad_to_capacity;
  return m;
}

}  // namespace fived::plan
