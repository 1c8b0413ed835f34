#pragma once
// A tensor tied across pipeline stages (the model contract's `tied_weight`: GPT-2's wte, which
// the first stage embeds with and the last stage's head multiplies by, each holding a copy)
// gets the sum of its reduced gradients over every chunk and stage that holds it (Megatron's
// embedding group; the stages without it add zeros), so the copies take the same steps.
//
//   sum_tied_grads<T>(for_each_chunk, all_reduce_pp);   // after the step's reductions, before the update
//
// for_each_chunk(f) calls f.template operator()<c>(model, trainer) for each chunk of this
// rank; all_reduce_pp(span<double>, ReduceOp) reduces over the PP group.

#include <cstddef>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "fived/comm/types.hpp"
#include "fived/device/bf16.hpp"
#include "fived/optim/flat_range.hpp"

namespace fived::pipeline {

template <class Model>
constexpr const char* tied_name() {
  if constexpr (requires { Model::tied_weight; }) return Model::tied_weight;
  else return nullptr;
}
// The tied tensor's range in the model's flat buffer, where this model (a stage) holds it.
template <class Model>
std::optional<FlatRange> tied_range() {
  if constexpr (tied_name<Model>() == nullptr) return std::nullopt;
  else if (const auto i = Model::layout::find(tied_name<Model>()))
    return FlatRange{Model::layout::tensors[static_cast<std::size_t>(*i)].offset,
                     Model::layout::tensors[static_cast<std::size_t>(*i)].end()};
  else return std::nullopt;
}

template <class T, class ForEachChunk, class AllReducePP>
void sum_tied_grads(ForEachChunk&& for_each_chunk, AllReducePP&& all_reduce_pp) {
  std::vector<double> sum;
  for_each_chunk([&]<int c>(auto& model, auto& dp) {
    if (const auto r = tied_range<std::remove_reference_t<decltype(model)>>()) {
      const std::vector<T> g = dp.reduced_grads(*r);
      sum.resize(g.size(), 0.0);
      for (std::size_t k = 0; k < g.size(); ++k) sum[k] += static_cast<double>(static_cast<acc_t<T>>(g[k]));
    }
  });
  std::vector<double> n{static_cast<double>(sum.size())};
  all_reduce_pp(std::span<double>(n), ReduceOp::max);  // the stages without it learn its size
  sum.resize(static_cast<std::size_t>(n[0]), 0.0);
  all_reduce_pp(std::span<double>(sum), ReduceOp::sum);
  std::vector<T> back(sum.size());
  for (std::size_t k = 0; k < sum.size(); ++k) back[k] = static_cast<T>(sum[k]);
  for_each_chunk([&]<int c>(auto& model, auto& dp) {
    if (const auto r = tied_range<std::remove_reference_t<decltype(model)>>())
      dp.set_reduced_grads(*r, std::span<const T>(back));
  });
}

}  // namespace fived::pipeline
