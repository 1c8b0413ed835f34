#pragma once
// Megatron's tensor-parallel MLP: c_fc column-parallel (C -> 4C, hidden split
// over TP), GELU on the local hidden slice, c_proj row-parallel (4C -> C).
// Input and output are placed Replicate on TP, or Shard<1> (the sequence) with
// sequence parallelism. Per step on the TP group: without SP one all-reduce
// forward (c_proj) and one backward (c_fc's input gradient); with SP one
// all-gather + one reduce-scatter forward, one all-gather + one reduce-scatter
// backward. c_proj's bias gradient is Partial with SP (see RowParallelLinear).

#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "fived/kernels/host/gelu.hpp"
#include "fived/nn/tp/linear.hpp"

namespace fived::nn::tp {

template <MeshType M, bool SP = false, class T = float>
class MLP {
 public:
  using Fc = ColumnParallelLinear<M, SP, T>;
  using Proj = RowParallelLinear<M, SP, T>;
  static_assert(Chain<Fc, Proj>::ok);
  using mesh = M;
  using input_placement = typename Fc::input_placement;
  using output_placement = typename Proj::output_placement;
  using input_type = typename Fc::input_type;
  using output_type = typename Proj::output_type;
  static_assert(std::is_same_v<input_placement, output_placement>,
                "MLP: the block's input and output placements must agree, so blocks chain through the residual");

  // Serial weights: fc_w [C, H], fc_b [H], proj_w [H, C], proj_b [C]; H is split over TP.
  MLP(std::int64_t c, std::int64_t hidden, std::span<const T> fc_w, std::span<const T> fc_b, std::span<const T> proj_w,
      std::span<const T> proj_b, Coord coord)
      : fc_(c, hidden, fc_w, fc_b, coord), proj_(hidden, c, proj_w, proj_b, coord) {}
  // Inside a model: views of its buffers.
  MLP(std::int64_t c, std::int64_t hidden, ParamSlot<T> fc_w, ParamSlot<T> fc_b, ParamSlot<T> proj_w,
      ParamSlot<T> proj_b, Coord coord)
      : fc_(c, hidden, fc_w, fc_b, coord), proj_(hidden, c, proj_w, proj_b, coord) {}

  template <Communicator C>
  output_type forward(const input_type& x, C& tp) {
    auto h = fc_.forward(x, tp);
    pre_ = h.storage();
    kernels::host::gelu_forward(h.local().data(), pre_.data(), pre_.size());
    return proj_.forward(h, tp);
  }

  template <Communicator C>
  input_type backward(const output_type& dy, C& tp) {
    auto da = proj_.backward(dy, tp);
    kernels::host::gelu_backward(da.local().data(), pre_.data(), da.local().data(), pre_.size());
    return fc_.backward(da, tp);
  }

  void zero_grad() {
    fc_.zero_grad();
    proj_.zero_grad();
  }
  Fc& c_fc() { return fc_; }
  Proj& c_proj() { return proj_; }
  const Fc& c_fc() const { return fc_; }
  const Proj& c_proj() const { return proj_; }

 private:
  Fc fc_;
  Proj proj_;
  std::vector<T> pre_;  // c_fc output before GELU, local hidden slice
};

}  // namespace fived::nn::tp
