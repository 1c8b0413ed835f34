#pragma once
// LayerNorm under tensor parallelism (Megatron). The weight and bias [C] are
// replicated on TP; the activation is placed Replicate, or Shard<1> (the
// sequence) with sequence parallelism, and the layer normalises the rows this
// rank holds. It issues no collective:
//   forward   y = LN(x) on the local rows                   (same placement)
//   backward  dx += LN'(dy) on the local rows               (same placement)
//             dweight, dbias += sums over the local rows:   complete without SP;
//             with SP a partial sum per sequence shard (the gradients are
//             placed Partial), which the owner reduces over TP once per
//             backward (Megatron's all-reduce of the sequence-parallel
//             LayerNorm gradients).

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/kernels/host/layernorm.hpp"
#include "fived/nn/tp/linear.hpp"

namespace fived::nn::tp {

template <MeshType M, bool SP = false, class T = float>
class LayerNorm : private detail::ParamStorage<T> {
  using param_layout = ParamLayout<M, 1, Replicate>;

 public:
  using mesh = M;
  using value_type = T;
  static constexpr bool sequence_parallel = SP;
  using input_placement = std::conditional_t<SP, Shard<1>, Replicate>;
  using output_placement = input_placement;
  using param_placement = Replicate;
  using grad_placement = rows_grad_placement<input_placement>;  // Replicate, or Partial with SP
  using input_type = Activation<T, M, input_placement>;
  using output_type = input_type;
  using param_type = ShardedView<T, param_layout>;
  using grad_type = ShardedView<T, ParamLayout<M, 1, grad_placement>>;

  // Alone: copies the serial weight and bias [C].
  LayerNorm(std::int64_t C, std::span<const T> weight, std::span<const T> bias, Coord coord)
      : c_(C), w_(param_layout({C}, coord), this->own_slice(param_layout({C}, coord), weight, "weight")),
        b_(param_layout({C}, coord), this->own_slice(param_layout({C}, coord), bias, "bias")),
        dw_({{C}, coord}, this->own_zeros(C)), db_({{C}, coord}, this->own_zeros(C)) {}
  // Inside a model: views of its buffers.
  LayerNorm(std::int64_t C, ParamSlot<T> weight, ParamSlot<T> bias, Coord coord)
      : c_(C), w_(param_layout({C}, coord), weight.value), b_(param_layout({C}, coord), bias.value),
        dw_({{C}, coord}, weight.grad), db_({{C}, coord}, bias.grad) {}

  output_type forward(const input_type& x) {
    detail::check_width(x, c_, "tp::LayerNorm::forward");
    x_.emplace(x);
    const int rows = local_rows(x), C = detail::checked_int(c_, "C");
    mean_.resize(static_cast<std::size_t>(rows));
    rstd_.resize(static_cast<std::size_t>(rows));
    std::vector<T> y(x.local().size());
    kernels::host::layernorm_forward(y.data(), mean_.data(), rstd_.data(), x.local().data(), w_.local().data(),
                                     b_.local().data(), rows, C);
    return output_type(x.layout(), std::move(y));
  }

  // Adds the input gradient to dx (the residual stream's gradient) and the
  // parameter gradients to weight_grad() and bias_grad().
  void backward(const output_type& dy, input_type& dx) {
    if (!x_) throw std::logic_error("tp::LayerNorm::backward called before forward");
    if (dy.layout().global_shape() != x_->layout().global_shape() ||
        dx.layout().global_shape() != x_->layout().global_shape())
      throw std::invalid_argument("tp::LayerNorm::backward: dy and dx must have the shape of the input");
    kernels::host::layernorm_backward(dx.local().data(), dw_.local().data(), db_.local().data(), dy.local().data(),
                                      x_->local().data(), w_.local().data(), mean_.data(), rstd_.data(),
                                      local_rows(*x_), detail::checked_int(c_, "C"));
  }

  void zero_grad() {
    std::fill(dw_.local().begin(), dw_.local().end(), T{});
    std::fill(db_.local().begin(), db_.local().end(), T{});
  }
  const param_type& weight() const { return w_; }
  const param_type& bias() const { return b_; }
  const grad_type& weight_grad() const { return dw_; }
  const grad_type& bias_grad() const { return db_; }

 private:
  int local_rows(const input_type& x) const {
    return detail::checked_int(static_cast<std::int64_t>(x.local().size()) / c_, "rows");
  }

  std::int64_t c_;
  param_type w_, b_;
  grad_type dw_, db_;
  std::optional<input_type> x_;
  std::vector<acc_t<T>> mean_, rstd_;
};

}  // namespace fived::nn::tp
