#pragma once
// A mixture of experts' balance from one step to the next, all in device memory.
//
// The rows each expert took in a step's training forwards are added up per MoE block in
// device memory (the forwards wait for nothing). After the optimizer step, in the step's
// stream order, they are summed over the group that routes tokens (every rank of DP x CP)
// and become the last step's loads; with AuxLossFreeBias (DeepSeek-V3) each block's selection
// bias, which the router adds to its scores before choosing experts, then moves by
// bias_update_rate towards the mean load there (expert_bias_step: up for an expert below it,
// down above), as Megatron-Core moves it in its optimizer step. Nothing is read back in a
// step, so a step with a selection bias waits for nothing and is captured as a graph whole;
// the loads and the bias are read when asked.
//
//   ExpertBalance<Config, Device, Stat> balance(ops, moe_blocks);
//   balance.count(ops, m, loads);        // a training forward's rows per expert of MoE block m
//                                        // (device memory, Stat)
//   balance.step(sum_over_group, ops);   // after the optimizer step; sum_over_group(span<Stat>)
//                                        // sums device memory over the group in stream order
//   balance.device_bias(m)               // what MoE block m's router reads (device memory)
//   balance.last_loads(ops), bias(m, ops)   // read back (a wait for the device)

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/device/buffer.hpp"

namespace fived {

template <class Config, class Device, class Stat>
class ExpertBalance {
  static constexpr int experts = Config::experts;

 public:
  template <class Ops>
  ExpertBalance(Ops& ops, int moe_blocks)
      : blocks_(moe_blocks),
        device_bias_(ops.template make_buffer<float>(size(1))),
        device_loads_(ops.template make_buffer<Stat>(size(0))),
        last_loads_(ops.template make_buffer<Stat>(size(0))) {}

  // Adds a training forward's rows per expert of MoE block m (device memory).
  template <class Ops>
  void count(Ops& ops, int m, const Stat* rows) {
    ops.add_acc(device_loads_.data() + m * experts, rows, experts);
  }

  // The step's loads summed over the group become last_loads(); with a selection bias, it
  // moves, unless *skip_if_non_finite (device memory, or null) is not finite (a skipped
  // optimizer step). Queued in stream order; every rank of the group calls it (the same MoE
  // blocks).
  template <class SumOverGroup, class Ops>
  void step(SumOverGroup&& sum_over_group, Ops& ops, const double* skip_if_non_finite = nullptr) {
    if (blocks_ == 0) return;
    // Whole rows: exact while an expert takes fewer than 2^24 of a step's rows over the group
    // (in float; their total, which may pass that, is taken in double by the bias step).
    sum_over_group(std::span<Stat>(device_loads_.data(), size(0)));
    if constexpr (Config::balancing::bias)
      ops.expert_bias_step(device_bias_.data(), device_loads_.data(), blocks_, experts, Config::bias_update_rate,
                           skip_if_non_finite);
    ops.copy(last_loads_.data(), device_loads_.data(), size(0));
    ops.zero(device_loads_);
    balanced_ = true;
  }

  // Rows per expert in the last step, [MoE block][expert] (empty before the first).
  template <class Ops>
  std::vector<double> last_loads(Ops& ops) const {
    if (!balanced_) return {};
    const std::vector<Stat> loads = ops.to_host(std::span<const Stat>(last_loads_.data(), size(0)));
    return std::vector<double>(loads.begin(), loads.end());
  }
  // MoE block m's selection bias, [expert], read back, and where its router reads it.
  template <class Ops>
  std::vector<float> bias(int m, Ops& ops) const {
    check_block(m, "router_bias");
    return ops.to_host(std::span<const float>(device_bias_.data() + m * experts, experts));
  }
  float* device_bias(int m) { return device_bias_.data() + m * experts; }
  // Sets it (a resumed run's, or a test's skewed router); `who` names the caller in errors.
  template <class Ops>
  void set_bias(int m, std::span<const float> bias, Ops& ops, const std::string& who) {
    if (bias.size() != static_cast<std::size_t>(experts))
      throw std::invalid_argument(who + ": " + std::to_string(bias.size()) + " values for " +
                                  std::to_string(experts) + " experts");
    check_block(m, who);
    ops.upload(device_bias(m), bias.data(), bias.size());
  }

 private:
  // [MoE block][expert] elements, or `least` when that is more.
  std::size_t size(int least) const { return static_cast<std::size_t>(std::max(blocks_ * experts, least)); }
  void check_block(int m, const std::string& who) const {
    if (m < 0 || m >= blocks_)
      throw std::invalid_argument(who + ": block " + std::to_string(m) + " of " + std::to_string(blocks_) +
                                  " MoE blocks");
  }

  int blocks_;
  bool balanced_ = false;
  Buffer<float, Device> device_bias_;  // [MoE block][expert]
  Buffer<Stat, Device> device_loads_;  // [MoE block][expert]: rows counted since the last step
  Buffer<Stat, Device> last_loads_;    // [MoE block][expert]: the last step's, summed over the group
};

}  // namespace fived
