#pragma once
// A pipeline rank's chunks seen in the whole model's serial layout (at TP 1, Hugging Face
// order): what Trainer::serial_params and serial_grads add up. Each chunk adds its tensors
// at their names into a whole buffer of doubles that is zero elsewhere; the caller then sums
// over PP (every element is on one stage) and, for experts, over EP.
//
//   add_serial_params<Serial, SerialExperts>(part, dp, experts, whole);
//   add_serial_grads<Serial, SerialExperts>(dp, experts, whole, tp_comm, tp_rank, ep_rank);

#include <algorithm>
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

// A chunk's parameters: the part whole over TP (under ZeRO-3 gathered over DP into its buffer
// first); experts: this rank's piece among the EP x TP ones in place, the others zero.
template <class Serial, class SerialExperts, class Part, class D>
void add_serial_params(Part& part, D& dp, bool experts, std::vector<double>& whole) {
  using T = typename Part::value_type;
  if (!experts) {
    if constexpr (D::stage == 3) {
      const std::vector<T> full = dp.full_params();
      part.ops().upload(part.params().data(), full.data(), full.size());
    }
    const std::vector<T> p = part.gather_params();
    put_serial<typename Part::serial_layout, Serial>(std::span<const T>(p), whole);
  } else if constexpr (Part::has_experts) {
    using EL = typename Part::expert_layout;
    constexpr std::size_t pieces_n = static_cast<std::size_t>(EL::tp * EL::ep);
    std::vector<T> pieces(EL::size * pieces_n), mine(EL::serial::size);
    const std::vector<T> own = part.expert_params_to_host();
    std::copy(own.begin(), own.end(),
              pieces.begin() + static_cast<std::ptrdiff_t>(EL::size * static_cast<std::size_t>(part.ep_rank() * EL::tp +
                                                                                                part.tp_rank())));
    EL::assemble(std::span<const T>(pieces), std::span<T>(mine));
    put_serial<typename EL::serial, SerialExperts>(std::span<const T>(mine), whole);
  }
}

// A chunk's reduced gradient: its TP piece (the same on every rank of the reduction group),
// the TP pieces assembled into the chunk's serial layout over tp_comm. Experts: this rank's
// piece among the EP x TP ones (the others are summed in by the caller over EP).
template <class Serial, class SerialExperts, class D, class TpComm>
void add_serial_grads(D& dp, bool experts, std::vector<double>& whole, TpComm& tp_comm, int tp_rank, int ep_rank) {
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
  if (!experts) add.template operator()<typename Part::layout, Serial>(dp.reduced_grads(), tp_rank);
  else if constexpr (Part::has_experts)
    add.template operator()<typename Part::expert_layout, SerialExperts>(dp.experts().reduced_grads(),
                                                                          ep_rank * Part::expert_layout::tp + tp_rank);
}

}  // namespace fived
