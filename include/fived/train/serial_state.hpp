#pragma once
// A pipeline rank's chunks seen in the whole model's serial layout (at TP 1, Hugging Face
// order): what Trainer::serial_params and serial_grads add up. Each chunk adds its tensors
// at their names into a whole buffer of doubles that is zero elsewhere; the caller then sums
// over PP (every element is on one stage) and, for experts, over EP.
//
//   add_serial<Serial, SerialExperts>(dp, experts, whole, tp_comm, tp_rank, ep_rank,
//                                     [](auto& trainer) { return trainer.full_params(); });

#include <cstddef>
#include <span>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/nn/param_table.hpp"

namespace fived {

// Adds a part's tensors, in its serial layout From, to the whole model's (To) at their names.
template <class From, class To, class U>
void put_serial(std::span<const U> part, std::vector<double>& whole) {
  for (const ParamInfo& t : From::tensors) {
    if (t.spec.tied_copy) continue;  // its owner (the embedding's stage) gives it
    const ParamInfo& to = To::tensors[static_cast<std::size_t>(*To::find(t.name()))];
    for (std::size_t i = 0; i < t.size(); ++i) whole[to.offset + i] += static_cast<double>(part[t.offset + i]);
  }
}

// A chunk's values in the serial layouts, added into `whole`. `values(trainer)` gives what a
// chunk's trainer holds whole over its data group, the same on each of its ranks, in host
// memory: full_params() (under ZeRO-3 an all-gather of the shards, so every rank of the group
// calls it) or reduced_grads(). That is this rank's TP piece of the chunk (layout), or of its
// experts (expert_layout: piece ep_rank x TP + tp_rank among the EP x TP ones); the TP pieces
// are assembled over tp_comm into the chunk's serial layout, the other EP ranks' experts left
// to the caller's sum over EP.
template <class Serial, class SerialExperts, class D, class TpComm, class Values>
void add_serial(D& dp, bool experts, std::vector<double>& whole, TpComm& tp_comm, int tp_rank, int ep_rank,
                Values values) {
  using Part = typename D::model_type;
  using T = typename Part::value_type;
  auto add = [&]<class L, class To>(const std::vector<T>& mine, int piece) {
    std::vector<double> pieces(L::size * static_cast<std::size_t>(L::tp * L::ep), 0.0), serial(L::serial::size);
    for (std::size_t k = 0; k < mine.size(); ++k)
      pieces[static_cast<std::size_t>(piece) * L::size + k] = static_cast<double>(static_cast<acc_t<T>>(mine[k]));
    tp_comm.all_reduce_host(std::span<double>(pieces));
    L::assemble(std::span<const double>(pieces), std::span<double>(serial));
    put_serial<typename L::serial, To>(std::span<const double>(serial), whole);
  };
  if (!experts) add.template operator()<typename Part::layout, Serial>(values(dp), tp_rank);
  else if constexpr (Part::has_experts)
    add.template operator()<typename Part::expert_layout, SerialExperts>(values(dp.experts()),
                                                                          ep_rank * Part::expert_layout::tp + tp_rank);
}

}  // namespace fived
