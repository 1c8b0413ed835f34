#pragma once
// Megatron's tensor-parallel causal self-attention: the heads are split over TP.
//
//   c_attn  ColumnParallelLinear<M, SP, T, 3>: the fused [q|k|v] projection,
//           each of q, k, v split by heads, so rank r's local output is the
//           [q|k|v] of heads [r*NH/TP, (r+1)*NH/TP)   -> [B, T, 3, C] Shard<3>
//   core    causal attention of the local heads on the full sequence (no
//           collective: heads are independent)          -> [B, T, C] Shard<2>
//   c_proj  RowParallelLinear<M, SP, T>                  -> Replicate (SP: Shard<1>)
//
// Collectives per step on the TP group, as the MLP: without SP one all-reduce
// forward (c_proj) and one backward (c_attn's input gradient); with SP one
// all-gather + one reduce-scatter each way. c_proj's bias gradient is Partial
// with SP (see RowParallelLinear).

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <span>
#include <type_traits>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/kernels/host/attention.hpp"
#include "fived/nn/tp/linear.hpp"

namespace fived::nn::tp {

template <MeshType M, int Heads, bool SP = false, class T = float>
class Attention {
 public:
  static constexpr int tp_size = M::extent(Axis::tp);
  static_assert(Heads >= 1 && Heads % tp_size == 0,
                "tp::Attention splits the heads over TP: the number of heads must be a multiple of the TP extent "
                "(change the heads of the model, or the TP of the mesh)");
  static constexpr int heads = Heads;
  static constexpr int local_heads = Heads / tp_size;

  using Qkv = ColumnParallelLinear<M, SP, T, 3>;
  using Proj = RowParallelLinear<M, SP, T>;
  using mesh = M;
  using value_type = T;
  using input_placement = typename Qkv::input_placement;
  using output_placement = typename Proj::output_placement;
  using input_type = typename Qkv::input_type;
  using output_type = typename Proj::output_type;
  static_assert(std::is_same_v<input_placement, output_placement>,
                "tp::Attention: the block's input and output placements must agree, so blocks chain through the "
                "residual");

  // Alone: the serial c_attn [C, 3C] / [3C] and c_proj [C, C] / [C].
  Attention(std::int64_t C, std::span<const T> attn_w, std::span<const T> attn_b, std::span<const T> proj_w,
            std::span<const T> proj_b, Coord coord)
      : c_(checked_width(C)), qkv_(C, 3 * C, attn_w, attn_b, coord), proj_(C, C, proj_w, proj_b, coord) {}
  // Inside a model: views of its buffers.
  Attention(std::int64_t C, ParamSlot<T> attn_w, ParamSlot<T> attn_b, ParamSlot<T> proj_w, ParamSlot<T> proj_b,
            Coord coord)
      : c_(checked_width(C)), qkv_(C, 3 * C, attn_w, attn_b, coord), proj_(C, C, proj_w, proj_b, coord) {}

  template <Communicator C>
  output_type forward(const input_type& x, C& tp) {
    qkv_out_.emplace(qkv_.forward(x, tp));
    const auto g = qkv_out_->layout().global_shape();  // [B, T, 3, C]
    ActivationLayout<M, Shard<2>> al({g[0], g[1], c_}, x.layout().coord());
    std::vector<T> a(static_cast<std::size_t>(al.local_size()));
    lse_.resize(static_cast<std::size_t>(g[0] * g[1] * local_heads));
    kernels::host::attention_forward(a.data(), lse_.data(), qkv_out_->local().data(), batch(), seq(), local_c(),
                                     local_heads);
    atty_.emplace(std::move(al), std::move(a));
    return proj_.forward(*atty_, tp);
  }

  template <Communicator C>
  input_type backward(const output_type& dy, C& tp) {
    if (!atty_) throw std::logic_error("tp::Attention::backward called before forward");
    const auto da = proj_.backward(dy, tp);
    std::vector<T> dqkv(qkv_out_->local().size());
    kernels::host::attention_backward(dqkv.data(), da.local().data(), qkv_out_->local().data(), atty_->local().data(),
                                      lse_.data(), batch(), seq(), local_c(), local_heads);
    return qkv_.backward(typename Qkv::output_type(qkv_out_->layout(), std::move(dqkv)), tp);
  }

  void zero_grad() {
    qkv_.zero_grad();
    proj_.zero_grad();
  }
  Qkv& c_attn() { return qkv_; }
  Proj& c_proj() { return proj_; }
  const Qkv& c_attn() const { return qkv_; }
  const Proj& c_proj() const { return proj_; }

 private:
  static std::int64_t checked_width(std::int64_t C) {
    if (C <= 0 || C % Heads != 0)
      throw std::invalid_argument("tp::Attention: d_model " + std::to_string(C) + " does not split into " +
                                  std::to_string(Heads) + " heads");
    return C;
  }
  int batch() const { return detail::checked_int(qkv_out_->layout().global_shape()[0], "B"); }
  int seq() const { return detail::checked_int(qkv_out_->layout().global_shape()[1], "T"); }
  int local_c() const { return detail::checked_int(c_ / tp_size, "C/TP"); }

  std::int64_t c_;
  Qkv qkv_;
  Proj proj_;
  std::optional<typename Qkv::output_type> qkv_out_;  // saved for backward
  std::optional<Activation<T, M, Shard<2>>> atty_;
  std::vector<acc_t<T>> lse_;
};

}  // namespace fived::nn::tp
