#pragma once
// A mixture of experts' balance from one step to the next.
//
// The rows each expert took in a step's training forwards are added up per MoE block in
// device memory (the forwards wait for nothing); after the optimizer step they are read,
// summed over the group that routes tokens (every rank of DP x CP) and become the last
// step's loads. With AuxLossFreeBias (DeepSeek-V3) each block's
// selection bias, which the router adds to its scores before choosing experts, then moves
// by bias_update_rate towards the mean load: up for an expert below it, down above.
//
//   ExpertBalance<Config, Device, Stat> balance(ops, moe_blocks);
//   balance.count(ops, m, loads);       // a training forward's rows per expert of MoE block m
//                                       // (device memory, Stat)
//   balance.step(group, ops);           // after the optimizer step (a collective of the group)
//   balance.device_bias(m)              // what MoE block m's router reads (device memory)

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/device/buffer.hpp"
#include "fived/mesh/mesh_comm.hpp"

namespace fived {

template <class Config, class Device, class Stat>
class ExpertBalance {
  static constexpr int experts = Config::experts;

 public:
  template <class Ops>
  ExpertBalance(Ops& ops, int moe_blocks)
      : blocks_(moe_blocks),
        device_bias_(ops.template make_buffer<float>(static_cast<std::size_t>(std::max(moe_blocks * experts, 1)))),
        device_loads_(ops.template make_buffer<Stat>(static_cast<std::size_t>(moe_blocks * experts))),
        bias_(static_cast<std::size_t>(moe_blocks * experts), 0.0f),
        loads_(bias_.size(), 0.0) {}

  // Adds a training forward's rows per expert of MoE block m (device memory).
  template <class Ops>
  void count(Ops& ops, int m, const Stat* rows) {
    ops.add_acc(device_loads_.data() + m * experts, rows, experts);
  }

  // The step's loads summed over `group` become last_loads(); with a selection bias, it moves.
  template <GroupView G, class Ops>
  void step(MeshComm<G>& group, Ops& ops) {
    if (!loads_.empty()) {  // (whole rows: exact in a float up to 2^24 a step)
      const std::vector<Stat> counted = ops.to_host(std::span<const Stat>(device_loads_.data(), loads_.size()));
      std::copy(counted.begin(), counted.end(), loads_.begin());
      ops.zero(device_loads_);
    }
    group.all_reduce_host(std::span<double>(loads_));
    last_loads_ = loads_;
    if constexpr (Config::balancing::bias) {
      for (int m = 0; m < blocks_; ++m) {
        const std::span<const double> load(loads_.data() + m * experts, experts);
        double mean = 0;
        for (double x : load) mean += x / experts;
        for (int e = 0; e < experts; ++e) {
          const double d = mean - load[static_cast<std::size_t>(e)];
          bias_[static_cast<std::size_t>(m * experts + e)] +=
              static_cast<float>(Config::bias_update_rate * ((d > 0) - (d < 0)));
        }
      }
      ops.upload(device_bias_.data(), bias_.data(), bias_.size());
    }
    std::fill(loads_.begin(), loads_.end(), 0.0);
  }

  // Rows per expert in the last step, [MoE block][expert] (empty before the first).
  const std::vector<double>& last_loads() const { return last_loads_; }
  // MoE block m's selection bias, [expert], in host memory, and where its router reads it.
  std::span<const float> bias(int m) const {
    return std::span<const float>(bias_).subspan(static_cast<std::size_t>(m * experts), experts);
  }
  float* device_bias(int m) { return device_bias_.data() + m * experts; }
  // Sets it (a resumed run's, or a test's skewed router); `who` names the caller in errors.
  template <class Ops>
  void set_bias(int m, std::span<const float> bias, Ops& ops, const std::string& who) {
    if (m < 0 || m >= blocks_ || bias.size() != static_cast<std::size_t>(experts))
      throw std::invalid_argument(who + ": block " + std::to_string(m) + " of " + std::to_string(blocks_) +
                                  " MoE blocks, " + std::to_string(bias.size()) + " values for " +
                                  std::to_string(experts) + " experts");
    std::copy(bias.begin(), bias.end(), bias_.begin() + static_cast<std::ptrdiff_t>(m * experts));
    ops.upload(device_bias_.data(), bias_.data(), bias_.size());
  }

 private:
  int blocks_;
  Buffer<float, Device> device_bias_;  // [MoE block][expert]
  Buffer<Stat, Device> device_loads_;  // [MoE block][expert]: rows counted since the last step
  std::vector<float> bias_;            // the same, in host memory
  std::vector<double> loads_, last_loads_;
};

}  // namespace fived
