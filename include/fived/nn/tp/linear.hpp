#pragma once
// Tensor-parallel linear layers (Megatron), with the collectives chosen by the
// placement types.
//
// Activations are row-major [B, T, C] Sharded tensors; only the TP axis is
// placed (the other axes are Replicate here). Weights are HF Conv1D [in, out].
// Convention: a gradient has the placement of its value, so a layer's backward
// takes dy placed as output_placement and returns dx placed as
// input_placement; the one exception is a replicated parameter whose gradient
// comes from sequence-sharded rows (SP), which is Partial until its owner
// reduces it. Every collective is a redistribute<Axis::tp, P> between what the
// local arithmetic produced and the placement the type demands:
//
//   ColumnParallelLinear<M, SP>   weight Shard<1>, bias Shard<0>
//     in:  Replicate (SP: Shard<1>, the sequence)      out: Shard<2> (hidden)
//     fwd  x_full = redistribute<tp, Replicate>(x)     identity   | all-gather
//          y      = x_full W_local + b_local           Shard<2>
//     bwd  dx     = dy W_local^T  (Partial)
//          redistribute<tp, in>(dx)                    all-reduce | reduce-scatter
//          dW_local += x_full^T dy, db_local += colsum(dy)   (no collective)
//
//   RowParallelLinear<M, SP>      weight Shard<0>, bias Replicate
//     in:  Shard<2>                                    out: Replicate (SP: Shard<1>)
//     fwd  y = x_local W_local (Partial) -> redistribute<tp, out>(y) + b
//                                                      all-reduce | reduce-scatter
//     bwd  dy_full = redistribute<tp, Replicate>(dy)   identity   | all-gather
//          dx_local = dy_full W_local^T (Shard<2>), dW_local += x_local^T dy_full
//          db += colsum of the local rows of dy: Replicate (no SP) or Partial
//          (SP: each rank saw only its sequence shard; no collective here,
//          the owner reduces it: nn::tp::GPT once per backward for all such
//          gradients, a test with redistribute<tp, Replicate>)
//
// So a Column -> Row pair (the MLP, attention) issues, per step, one
// all-reduce forward and one backward without SP, and one all-gather plus one
// reduce-scatter each way with SP. Chain<A, B> refuses, at compile time, to
// connect a layer to one whose input placement differs from the first one's
// output placement.
//
// Parameters are ShardedViews: of a model's flat buffers (ParamSlot), or of
// storage the layer owns when built alone by slicing the serial layer's full
// weight, so a TP-split layer computes what the serial layer computes.

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/comm/communicator.hpp"
#include "fived/kernels/host/gemm.hpp"
#include "fived/mesh/mesh.hpp"
#include "fived/place/redistribute.hpp"
#include "fived/place/sharded.hpp"

namespace fived::nn::tp {

// An activation [B, T, C] placed as P on the TP axis.
template <MeshType M, class P>
using ActivationLayout = ShardLayout<M, 3, Placements<On<Axis::tp, P>>>;
template <class T, MeshType M, class P>
using Activation = Sharded<T, ActivationLayout<M, P>>;

// A parameter of rank R placed as P on the TP axis.
template <MeshType M, std::size_t R, class P>
using ParamLayout = ShardLayout<M, R, Placements<On<Axis::tp, P>>>;

// Where a layer's parameter lives inside a model: its piece of the model's flat
// parameter buffer and of the buffer its gradient accumulates into.
template <class T>
struct ParamSlot {
  std::span<T> value, grad;
};

namespace detail {

inline int checked_int(std::int64_t v, const char* what) {
  if (v < 0 || v > INT32_MAX) throw std::invalid_argument(std::string("fived::nn::tp: ") + what + " does not fit an int");
  return static_cast<int>(v);
}

template <class T, class L>
void check_width(const Sharded<T, L>& x, std::int64_t want, const char* layer) {
  if (x.layout().global_shape()[2] != want)
    throw std::invalid_argument(std::string(layer) + ": the input has " + std::to_string(x.layout().global_shape()[2]) +
                                " features, the layer takes " + std::to_string(want));
}

// Storage for the parameters of a TP layer built alone from the serial tensors
// (tests, or a model made of separate layers); inside a model the layers view
// the model's flat buffers instead (ParamSlot). A layer derives from it first,
// so it exists before the views into it are made. The pieces are
// std::vectors, whose buffers a move keeps: the layer is movable. It is not
// copyable (a copy would view the original).
template <class T>
class ParamStorage {
 public:
  ParamStorage() = default;
  ParamStorage(ParamStorage&&) noexcept = default;
  ParamStorage& operator=(ParamStorage&&) noexcept = default;
  ParamStorage(const ParamStorage&) = delete;
  ParamStorage& operator=(const ParamStorage&) = delete;

 protected:
  // This rank's piece of `full`, placed by `layout`, in storage of its own.
  template <class L>
  std::span<T> own_slice(const L& layout, std::span<const T> full, const char* what) {
    if (static_cast<std::int64_t>(full.size()) != layout.global_size())
      throw std::invalid_argument(std::string("fived::nn::tp: the full ") + what + " has " +
                                  std::to_string(full.size()) + " elements, the layer needs " +
                                  std::to_string(layout.global_size()));
    return owned_.emplace_back(Sharded<T, L>::slice_of(layout, full).storage());
  }
  // n zeros (a gradient), in storage of its own.
  std::span<T> own_zeros(std::int64_t n) { return owned_.emplace_back(static_cast<std::size_t>(n), T{}); }

 private:
  std::vector<std::vector<T>> owned_;
};

// The parameters of a TP linear layer [in, out] (HF Conv1D) with their
// gradients. WeightLayout/BiasLayout place the values; the bias gradient may be
// placed differently (BiasGradLayout: Partial when each rank sums only its
// sequence shard's rows, and the owner reduces it once per backward).
template <class T, class WeightLayout, class BiasLayout, class BiasGradLayout = BiasLayout>
class LinearParams : private ParamStorage<T> {
 public:
  using weight_layout = WeightLayout;
  using bias_layout = BiasLayout;
  using weight_placement = typename WeightLayout::placements::template on<Axis::tp>;
  using bias_placement = typename BiasLayout::placements::template on<Axis::tp>;
  using bias_grad_placement = typename BiasGradLayout::placements::template on<Axis::tp>;
  using weight_type = ShardedView<T, WeightLayout>;
  using bias_type = ShardedView<T, BiasLayout>;
  using bias_grad_type = ShardedView<T, BiasGradLayout>;

  // Alone: slices the serial weight and bias (row-major, ws and bs elements).
  LinearParams(std::int64_t in, std::int64_t out, typename WeightLayout::Shape ws, typename BiasLayout::Shape bs,
               std::span<const T> weight, std::span<const T> bias, Coord coord)
      : in_(in), out_(out), w_(WeightLayout(ws, coord), this->own_slice(WeightLayout(ws, coord), weight, "weight")),
        b_(BiasLayout(bs, coord), this->own_slice(BiasLayout(bs, coord), bias, "bias")),
        dw_(w_.layout(), this->own_zeros(w_.layout().local_size())),
        db_(BiasGradLayout(bs, coord), this->own_zeros(BiasGradLayout(bs, coord).local_size())) {}

  // Inside a model: views of its buffers (already initialised).
  LinearParams(std::int64_t in, std::int64_t out, typename WeightLayout::Shape ws, typename BiasLayout::Shape bs,
               ParamSlot<T> weight, ParamSlot<T> bias, Coord coord)
      : in_(in), out_(out), w_(WeightLayout(ws, coord), weight.value), b_(BiasLayout(bs, coord), bias.value),
        dw_(w_.layout(), weight.grad), db_(BiasGradLayout(bs, coord), bias.grad) {}

  void zero_grad() {
    std::fill(dw_.local().begin(), dw_.local().end(), T{});
    std::fill(db_.local().begin(), db_.local().end(), T{});
  }
  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }
  const weight_type& weight() const { return w_; }
  const bias_type& bias() const { return b_; }
  const weight_type& weight_grad() const { return dw_; }
  const bias_grad_type& bias_grad() const { return db_; }

 protected:
  std::int64_t in_, out_;
  weight_type w_;
  bias_type b_;
  weight_type dw_;
  bias_grad_type db_;
};

}  // namespace detail

// Fused = 1: a plain [in, out] weight, output columns split over TP.
// Fused = G > 1: the output is G equal blocks side by side ([q|k|v] for G = 3),
// each split over TP, so a rank holds the same slice of every block. The weight
// is then placed as [in, G, out/G] Shard<2>, the bias as [G, out/G] Shard<1>
// and the output as [B, T, G, out/G] Shard<3>: the local output is the G
// blocks of this rank's slice side by side (the [q|k|v] of its heads).
template <MeshType M, bool SP = false, class T = float, int Fused = 1>
class ColumnParallelLinear
    : public detail::LinearParams<
          T, std::conditional_t<Fused == 1, ParamLayout<M, 2, Shard<1>>, ParamLayout<M, 3, Shard<2>>>,
          std::conditional_t<Fused == 1, ParamLayout<M, 1, Shard<0>>, ParamLayout<M, 2, Shard<1>>>> {
  static_assert(Fused >= 1, "ColumnParallelLinear: Fused counts the output blocks, at least 1");
  using base = detail::LinearParams<
      T, std::conditional_t<Fused == 1, ParamLayout<M, 2, Shard<1>>, ParamLayout<M, 3, Shard<2>>>,
      std::conditional_t<Fused == 1, ParamLayout<M, 1, Shard<0>>, ParamLayout<M, 2, Shard<1>>>>;
  using base::in_, base::out_, base::w_, base::b_, base::dw_, base::db_;

 public:
  using mesh = M;
  using value_type = T;
  static constexpr bool sequence_parallel = SP;
  static constexpr int fused = Fused;
  using input_placement = std::conditional_t<SP, Shard<1>, Replicate>;
  using output_placement = std::conditional_t<Fused == 1, Shard<2>, Shard<3>>;
  using typename base::weight_placement;  // Shard<1> (Fused: Shard<2> of [in, G, out/G])
  using typename base::bias_placement;    // Shard<0> (Fused: Shard<1> of [G, out/G])
  using output_layout = ShardLayout<M, Fused == 1 ? 3 : 4, Placements<On<Axis::tp, output_placement>>>;
  using input_type = Activation<T, M, input_placement>;
  using output_type = Sharded<T, output_layout>;
  using typename base::weight_type;
  using typename base::bias_type;

  // Alone: slices the serial layer's weight [in, out] and bias [out]; `coord` is this rank's.
  ColumnParallelLinear(std::int64_t in, std::int64_t out, std::span<const T> weight, std::span<const T> bias,
                       Coord coord)
      : base(in, out, weight_shape(in, out), bias_shape(out), weight, bias, coord) {}
  // Inside a model: views of its flat buffers.
  ColumnParallelLinear(std::int64_t in, std::int64_t out, ParamSlot<T> weight, ParamSlot<T> bias, Coord coord)
      : base(in, out, weight_shape(in, out), bias_shape(out), weight, bias, coord) {}

  template <Communicator C>
  output_type forward(const input_type& x, C& tp) {
    detail::check_width(x, in_, "ColumnParallelLinear::forward");
    x_full_.emplace(redistribute<Axis::tp, Replicate>(x, tp));
    const auto g = x.layout().global_shape();
    output_layout yl(output_shape(g), x.layout().coord());
    const int rows = detail::checked_int(g[0] * g[1], "B*T"), n = local_out(), k = detail::checked_int(in_, "in");
    std::vector<T> y(static_cast<std::size_t>(yl.local_size()));
    kernels::host::matmul(y.data(), x_full_->local().data(), w_.local().data(), b_.local().data(), rows, n, k, false,
                          false);
    return output_type(std::move(yl), std::move(y));
  }

  // Takes dy placed like the output, accumulates dW and db, returns dx placed like the input.
  template <Communicator C>
  input_type backward(const output_type& dy, C& tp) {
    if (!x_full_) throw std::logic_error("ColumnParallelLinear::backward called before forward");
    const auto g = x_full_->layout().global_shape();
    const int rows = detail::checked_int(g[0] * g[1], "B*T"), n = local_out(), k = detail::checked_int(in_, "in");
    if (dy.layout().global_shape() != output_shape(g))
      throw std::invalid_argument("ColumnParallelLinear::backward: dy does not have the shape of the output");
    kernels::host::matmul(dw_.local().data(), x_full_->local().data(), dy.local().data(), nullptr, k, n, rows, true,
                          false, true);
    kernels::host::bias_backward(db_.local().data(), dy.local().data(), rows, n);
    ActivationLayout<M, Partial> dl(g, dy.layout().coord());
    std::vector<T> dx(static_cast<std::size_t>(dl.local_size()));
    kernels::host::matmul(dx.data(), dy.local().data(), w_.local().data(), nullptr, rows, k, n, false, true);
    const Activation<T, M, Partial> dx_partial(std::move(dl), std::move(dx));
    return redistribute<Axis::tp, input_placement>(dx_partial, tp);
  }

 private:
  static std::array<std::int64_t, Fused == 1 ? 2 : 3> weight_shape(std::int64_t in, std::int64_t out) {
    check_fused(out);
    if constexpr (Fused == 1) return {in, out};
    else return {in, Fused, out / Fused};
  }
  static std::array<std::int64_t, Fused == 1 ? 1 : 2> bias_shape(std::int64_t out) {
    if constexpr (Fused == 1) return {out};
    else return {Fused, out / Fused};
  }
  typename output_layout::Shape output_shape(const std::array<std::int64_t, 3>& x) const {
    if constexpr (Fused == 1) return {x[0], x[1], out_};
    else return {x[0], x[1], Fused, out_ / Fused};
  }
  static void check_fused(std::int64_t out) {
    if (out % Fused != 0)
      throw std::invalid_argument("ColumnParallelLinear: " + std::to_string(out) + " output features do not split into " +
                                  std::to_string(Fused) + " fused blocks");
  }
  int local_out() const { return detail::checked_int(dw_.layout().local_size() / in_, "out/TP"); }

  std::optional<Activation<T, M, Replicate>> x_full_;  // saved for dW
};

// Where a gradient computed from the rows of an activation placed as P sits
// before it is reduced over TP: complete when every rank holds every row
// (Replicate), one partial sum per sequence shard with SP (Shard: Partial).
template <class P>
using rows_grad_placement = std::conditional_t<is_shard_v<P>, Partial, P>;

// The bias is replicated and added after the reduction. Its gradient is the
// column sum of the rows of dy this rank holds: complete without SP; with SP a
// partial sum (bias_grad() is placed Partial), which the owner reduces over TP
// once (the model does it for all such gradients together; a test gathers it
// with redistribute<Axis::tp, Replicate>).
template <MeshType M, bool SP = false, class T = float>
class RowParallelLinear
    : public detail::LinearParams<T, ParamLayout<M, 2, Shard<0>>, ParamLayout<M, 1, Replicate>,
                                  ParamLayout<M, 1, rows_grad_placement<std::conditional_t<SP, Shard<1>, Replicate>>>> {
  using base = detail::LinearParams<T, ParamLayout<M, 2, Shard<0>>, ParamLayout<M, 1, Replicate>,
                                    ParamLayout<M, 1, rows_grad_placement<std::conditional_t<SP, Shard<1>, Replicate>>>>;
  using base::in_, base::out_, base::w_, base::b_, base::dw_, base::db_;

 public:
  using mesh = M;
  using value_type = T;
  static constexpr bool sequence_parallel = SP;
  using input_placement = Shard<2>;
  using output_placement = std::conditional_t<SP, Shard<1>, Replicate>;
  using typename base::weight_placement;     // Shard<0>: input features split
  using typename base::bias_placement;       // Replicate: added after the reduction
  using typename base::bias_grad_placement;  // Replicate, or Partial with SP
  using input_type = Activation<T, M, input_placement>;
  using output_type = Activation<T, M, output_placement>;
  using typename base::weight_type;
  using typename base::bias_type;

  RowParallelLinear(std::int64_t in, std::int64_t out, std::span<const T> weight, std::span<const T> bias, Coord coord)
      : base(in, out, {in, out}, {out}, weight, bias, coord) {}
  RowParallelLinear(std::int64_t in, std::int64_t out, ParamSlot<T> weight, ParamSlot<T> bias, Coord coord)
      : base(in, out, {in, out}, {out}, weight, bias, coord) {}

  template <Communicator C>
  output_type forward(const input_type& x, C& tp) {
    detail::check_width(x, in_, "RowParallelLinear::forward");
    x_.emplace(x);
    const auto g = x.layout().global_shape();
    ActivationLayout<M, Partial> pl({g[0], g[1], out_}, x.layout().coord());
    const int rows = detail::checked_int(g[0] * g[1], "B*T"), n = detail::checked_int(out_, "out"), k = local_in();
    std::vector<T> y(static_cast<std::size_t>(pl.local_size()));
    kernels::host::matmul(y.data(), x.local().data(), w_.local().data(), nullptr, rows, n, k, false, false);
    auto out = redistribute<Axis::tp, output_placement>(Activation<T, M, Partial>(std::move(pl), std::move(y)), tp);
    // The bias is added once, after the reduction, to whatever rows this rank holds.
    auto o = out.local();
    const auto b = b_.local();
    for (std::size_t i = 0; i < o.size(); ++i) o[i] += b[i % b.size()];
    return out;
  }

  template <Communicator C>
  input_type backward(const output_type& dy, C& tp) {
    if (!x_) throw std::logic_error("RowParallelLinear::backward called before forward");
    const auto g = x_->layout().global_shape();
    if (dy.layout().global_shape() != std::array<std::int64_t, 3>{g[0], g[1], out_})
      throw std::invalid_argument("RowParallelLinear::backward: dy does not have the shape of the output");
    const int rows = detail::checked_int(g[0] * g[1], "B*T"), n = detail::checked_int(out_, "out"), k = local_in();
    const int local_rows = detail::checked_int(static_cast<std::int64_t>(dy.local().size()) / out_, "rows");
    kernels::host::bias_backward(db_.local().data(), dy.local().data(), local_rows, n);

    const auto dy_full = redistribute<Axis::tp, Replicate>(dy, tp);
    kernels::host::matmul(dw_.local().data(), x_->local().data(), dy_full.local().data(), nullptr, k, n, rows, true,
                          false, true);
    ActivationLayout<M, input_placement> dl(g, dy.layout().coord());
    std::vector<T> dx(static_cast<std::size_t>(dl.local_size()));
    kernels::host::matmul(dx.data(), dy_full.local().data(), w_.local().data(), nullptr, rows, k, n, false, true);
    return input_type(std::move(dl), std::move(dx));
  }

 private:
  int local_in() const { return detail::checked_int(w_.layout().local_shape()[0], "in/TP"); }

  std::optional<input_type> x_;  // saved for dW
};

// Chain<Producer, Consumer>: Consumer takes Producer's output. Instantiating
// it (static_assert(Chain<A, B>::ok)) checks at compile time that the two
// layers live on the same mesh and agree on the placement between them.
template <class Producer, class Consumer>
struct Chain {
  static_assert(std::is_same_v<typename Producer::mesh, typename Consumer::mesh>,
                "Chain: the two layers are on different meshes");
  static_assert(std::is_same_v<typename Producer::output_placement, typename Consumer::input_placement>,
                "Chain: the first layer's output placement on the TP axis is not the placement the next layer "
                "takes as input; give both layers the same sequence-parallel setting, or put a "
                "redistribute<Axis::tp, P> between them");
  static_assert(!std::is_same_v<typename Producer::output_placement, typename Consumer::input_placement> ||
                    std::is_same_v<typename Producer::output_type, typename Consumer::input_type>,
                "Chain: the first layer's output type is not the next layer's input type (element type differs)");
  static constexpr bool ok = true;
};

}  // namespace fived::nn::tp
