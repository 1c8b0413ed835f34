#pragma once
// A tensor tied across pipeline stages (the model contract's `tied_weight`: GPT-2's wte,
// which the first stage embeds with and the last stage's head multiplies by, each holding a
// copy) gets the sum of the two copies' reduced gradients, so the copies take the same
// steps (Megatron's embedding group).
//
// The sum is made in device memory, in the order of the kernels, and the host waits for
// nothing. Both stages cut the tensor into the same buckets (train/bucket_plan.hpp: a tied
// tensor's buckets are its own), so each DP rank holds the same pieces of it on both:
// the two PP ranks swap those pieces in one grouped send_recv and each adds the other's
// (where one rank holds both stages, as chunks, it adds them in place). a + b is b + a, so
// both copies end with the same bits: the sum of the two rounded once, which is what
// summing them in double and rounding would give.
//
//   TiedGradSum<T, Device> tied(shape, holders, ops);   // at the executor's construction
//   tied.peer();                          // the PP rank this one swaps with (-1: none)
//   tied.check_peer_cut(max_over_pp);     // once, a collective over PP: both copies cut alike
//   tied.sum(ops, gate, pp);              // after the step's reductions, before the update

#include <array>
#include <cstddef>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fived/comm/types.hpp"
#include "fived/device/buffer.hpp"
#include "fived/optim/flat_range.hpp"
#include "fived/pipeline/stages.hpp"

namespace fived::pipeline {

template <class Model>
constexpr const char* tied_name() {
  if constexpr (requires { Model::tied_weight; }) return Model::tied_weight;
  else return nullptr;
}
// The tied tensor's range in the model's flat buffer, where this model (a stage) holds it:
// its layout's tied_range (the spec marked `tied`), which must be the contract's tied_weight.
template <class Model>
std::optional<FlatRange> tied_range() {
  if constexpr (tied_name<Model>() == nullptr) {
    return std::nullopt;
  } else {
    const auto i = Model::layout::find(tied_name<Model>());
    if (!i) return std::nullopt;
    const auto& t = Model::layout::tensors[static_cast<std::size_t>(*i)];
    const FlatRange r{t.offset, t.end()};
    if (Model::has_embedding && Model::has_head) return r;  // the whole model: one copy
    if constexpr (requires { Model::layout::tied_range; })
      if (Model::layout::tied_range == r) return r;
    throw std::logic_error(std::string("pipeline: the tied tensor '") + tied_name<Model>() +
                           "' of a pipeline stage must be its layout's spec marked `tied` (TensorSpec::tied), so that "
                           "each stage holding it cuts it into the same buckets");
  }
}

// One rank's part of the sum: the pieces of each of its chunks that hold the tied tensor
// (DataParallel::owned_reduced_grads over tied_range), and a buffer for the peer's.
template <class T, class Device>
class TiedGradSum {
 public:
  TiedGradSum() = default;
  // holders: for each chunk of this rank holding the tied tensor, its virtual stage and its
  // pieces (device memory, in flat order; the same spans every step).
  template <class Ops>
  TiedGradSum(Shape shape, std::vector<std::pair<int, std::vector<std::span<T>>>> holders, Ops& ops) {
    const int first = 0, last = shape.stages() - 1;
    for (const auto& [stage, pieces] : holders)
      if (stage != first && stage != last)
        throw std::logic_error("pipeline: virtual stage " + std::to_string(stage) + " holds the tied tensor; only the "
                               "first and the last stage may (the model contract's tied_weight)");
    if (holders.empty() || first == last) return;  // not tied across stages here
    mine_ = std::move(holders[0].second);
    if (holders.size() == 2) {  // both stages are chunks of this rank
      other_ = std::move(holders[1].second);
      check_alike(mine_, other_);
      return;
    }
    peer_ = shape.rank_of(holders[0].first == first ? last : first);
    std::size_t n = 0;
    for (const std::span<T>& p : mine_) n += p.size();
    received_ = ops.template make_buffer<T>(n);
    n = 0;
    for (const std::span<T>& p : mine_) {
      other_.push_back(received_.span().subspan(n, p.size())), n += p.size();
      sends_.push_back({std::span<const T>(p), peer_}), recvs_.push_back({other_.back(), peer_});
    }
  }

  // The PP rank holding the other copy, which this rank swaps pieces with; -1: none.
  int peer() const { return peer_; }

  // Whether the peer cut its copy as this rank did (pieces, elements, and the sizes weighted
  // by position), else a logic_error on every rank: a collective over PP, once.
  // max_over_pp(std::span<double>): the element-wise maximum over the PP group, in place.
  template <class MaxOverPP>
  void check_peer_cut(MaxOverPP&& max_over_pp) const {
    constexpr double none = -std::numeric_limits<double>::infinity();
    std::array<double, 6> most{none, none, none, none, none, none};  // each figure and its negative
    if (peer_ >= 0) {
      double elements = 0, weighted = 0;
      for (std::size_t k = 0; k < mine_.size(); ++k)
        elements += static_cast<double>(mine_[k].size()), weighted += static_cast<double>((k + 1) * mine_[k].size());
      const double pieces = static_cast<double>(mine_.size());
      most = {pieces, elements, weighted, -pieces, -elements, -weighted};
    }
    max_over_pp(std::span<double>(most));
    if (most[0] == none || (most[0] == -most[3] && most[1] == -most[4] && most[2] == -most[5])) return;
    const auto count = [](double v) { return std::to_string(static_cast<long long>(v)); };
    throw std::logic_error("pipeline::Executor: the first and the last stage cut the tied tensor into different "
                           "pieces (" + count(-most[3]) + " and " + count(most[0]) + " pieces of " + count(-most[4]) +
                           " and " + count(most[1]) + " elements): give their DataParallels the same bucket size and "
                           "element type");
  }

  // Each piece += the other copy's, and the other copy = the sum. gate: the executor's
  // StepGate (comm/step_gate.hpp), pp: its PP communicator.
  template <class Ops, class Gate, class PP>
  void sum(Ops& ops, Gate& gate, PP& pp) {
    if (peer_ >= 0) gate.send_recv(pp, std::span<const SendOp<T>>(sends_), std::span<const RecvOp<T>>(recvs_));
    for (std::size_t k = 0; k < mine_.size(); ++k) {
      ops.residual_forward(mine_[k].data(), mine_[k].data(), other_[k].data(), mine_[k].size());
      if (peer_ < 0) ops.copy(other_[k].data(), mine_[k].data(), mine_[k].size());
    }
  }

 private:
  static void check_alike(const std::vector<std::span<T>>& a, const std::vector<std::span<T>>& b) {
    bool same = a.size() == b.size();
    for (std::size_t k = 0; same && k < a.size(); ++k) same = a[k].size() == b[k].size();
    if (!same)
      throw std::logic_error("pipeline: the two stages holding the tied tensor cut it into different pieces "
                             "(train/bucket_plan.hpp cuts a layout's tied_range alike on each)");
  }

  std::vector<std::span<T>> mine_, other_;  // other_: the peer's pieces as received, or the second chunk's
  Buffer<T, Device> received_;
  int peer_ = -1;
  std::vector<SendOp<T>> sends_;  // the swap: mine_ out, other_ in (made once)
  std::vector<RecvOp<T>> recvs_;
};

}  // namespace fived::pipeline
