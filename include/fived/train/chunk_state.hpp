#pragma once
// A model chunk's training state in a checkpoint (train/checkpoint.hpp): what the Trainer's
// ranks write, read and load for each chunk (pipeline stage part) they hold. A chunk's state
// is its DataParallel's (the dense buffers, then its experts', each trainer's own ranges)
// and its MoE blocks' selection biases; Model is the whole model, whose MoE block numbers
// name the biases.
//
//   checkpoint::add_chunk<Model>(part, dp, shard);                            // saving
//   checkpoint::want_chunk(dp, restored, tp_rank, ep_rank);                   // loading: read
//   checkpoint::load_chunk(part, dp, restored, adam_step, tp_rank, ep_rank);  // then take

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "fived/train/checkpoint.hpp"
#include "fived/train/saver.hpp"
#include "fived/train/trainer_state.hpp"

namespace fived::checkpoint {

// A trainer's state: every kind of it over each range it saves, each tensor's part one
// entry, in the precision the trainer keeps it in.
template <class D>
void add_trainer_state(D& dp, Shard& w) {
  using L = typename D::layout;
  std::vector<TrainState> kinds{TrainState::params, TrainState::exp_avg, TrainState::exp_avg_sq};
  if constexpr (D::optimizer_type::has_master) kinds.push_back(TrainState::master);
  for (const FlatRange& r : save_ranges(dp))
    for (TrainState k : kinds)
      save_state(dp, k, r, [&]<class U>(std::span<const U> v) {
        for (const ParamInfo& t : L::tensors) {
          const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
          if (b < e)
            w.add(entry_name(k, t.name(), b - t.offset), std::vector<U>(v.begin() + static_cast<std::ptrdiff_t>(b - r.begin),
                                                                        v.begin() + static_cast<std::ptrdiff_t>(e - r.begin)));
        }
      });
}

template <class Model, class Part, class D>
void add_chunk(Part& part, D& dp, Shard& w) {
  add_trainer_state(dp, w);
  if constexpr (Part::has_experts) {
    add_trainer_state(dp.experts(), w);
    if constexpr (Part::has_router_bias)
      for (int m = 0; m < Part::moe_blocks; ++m)
        w.add(bias_entry_name(Model::moe_blocks_before(Part::first_layer) + m), part.router_bias(m));
  }
}

// What load_chunk takes: the state each trainer names (state_wanted, train/trainer_state.hpp), and the
// MoE blocks' selection biases.
template <class D, class Model>
void want_chunk(D& dp, Restored<Model>& restored, int tp_rank, int ep_rank) {
  using Part = typename D::model_type;
  auto from = [&](auto& trainer) {
    using L = typename std::remove_reference_t<decltype(trainer)>::layout;
    for (const auto& [k, r] : state_wanted(trainer)) restored.template want<L>(k, r, tp_rank, ep_rank);
  };
  from(dp);
  if constexpr (Part::has_experts) {
    from(dp.experts());
    if constexpr (Part::has_router_bias)
      for (int m = 0; m < Part::moe_blocks; ++m) restored.want_bias(Model::moe_blocks_before(Part::first_layer) + m);
  }
}

template <class Part, class D, class Model>
void load_chunk(Part& part, D& dp, const Restored<Model>& restored, int adam_step, int tp_rank, int ep_rank) {
  auto from = [&](auto& trainer) {
    using L = typename std::remove_reference_t<decltype(trainer)>::layout;
    load_state(trainer, [&](TrainState k, FlatRange r) { return restored.template values<L>(k, r, tp_rank, ep_rank); },
                       adam_step);
  };
  from(dp);
  if constexpr (Part::has_experts) {
    from(dp.experts());
    if constexpr (Part::has_router_bias)
      for (int m = 0; m < Part::moe_blocks; ++m)
        part.set_router_bias(m, restored.bias(Model::moe_blocks_before(Part::first_layer) + m));
  }
}

}  // namespace fived::checkpoint
