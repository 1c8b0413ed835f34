#pragma once
// Vocab-parallel embedding and cross-entropy (Megatron), host backend.
//
// The token table wte [Vp, C] is split over TP by rows (Param Shard<0>): rank r
// holds the ids [r*Vp/TP, (r+1)*Vp/TP). Vp is the padded vocabulary, a multiple
// of TP (padded_vocab(V, multiple) rounds up); the padding rows are never looked
// up (ids are < V) and the padding logits of the tied head never count in the
// loss (the cross-entropy kernels treat columns >= V as -inf).
//
//   VocabParallelEmbedding<M, SP>   wte Shard<0>
//     in:  token ids [B, T], replicated on TP          out: Replicate (SP: Shard<1>)
//     fwd  y = rows of wte for the ids in this shard, zero rows for the others
//          (Partial [B, T, C]) -> redistribute<tp, out>   all-reduce | reduce-scatter
//     bwd  dy_full = redistribute<tp, Replicate>(dy)     identity   | all-gather
//          dwte_local[id - lo] += dy_full[b, t]  for the in-shard ids (no collective)
//   Position embeddings (wpe, replicated) are not part of this layer: the model
//   adds them to the output (with SP, to its sequence shard) and accumulates
//   their gradient from dy, as the serial model does.
//
//   VocabParallelCrossEntropy<M>    logits Shard<2> ([B, T, Vp/TP] per rank, the
//     tied head's column-parallel output), targets replicated. The logits are
//     never gathered: three all-reduces of per-row statistics [B*T] over TP,
//       1. max of the logits            all_reduce(max)  (direct call, see below)
//       2. sum of exp(logit - max)      Partial -> Replicate: all-reduce (sum)
//       3. the target's logit           Partial -> Replicate: all-reduce (sum)
//     then each rank forms the loss of every row (identical on all ranks) and
//     its shard of d-logits, written over the logits (Shard<2>, like them).

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/comm/communicator.hpp"
#include "fived/device/bf16.hpp"
#include "fived/kernels/host/crossentropy.hpp"
#include "fived/mesh/mesh.hpp"
#include "fived/nn/tp/linear.hpp"
#include "fived/place/redistribute.hpp"
#include "fived/place/sharded.hpp"

namespace fived::nn::tp {

// The smallest multiple of `multiple` that is >= V (pad the vocabulary with it:
// multiple = TP, or lcm(TP, 64/128) for fast kernels).
constexpr std::int64_t padded_vocab(std::int64_t V, std::int64_t multiple) {
  return multiple <= 0 ? V : (V + multiple - 1) / multiple * multiple;
}

// Per-row statistics [B*T] placed as P on the TP axis.
template <MeshType M, class P>
using RowStatsLayout = ShardLayout<M, 1, Placements<On<Axis::tp, P>>>;
template <class A, MeshType M, class P>
using RowStats = Sharded<A, RowStatsLayout<M, P>>;

namespace detail {

template <MeshType M>
void check_vocab_split(std::int64_t Vp, const char* layer) {
  constexpr int tp = M::extent(Axis::tp);
  if (Vp <= 0 || Vp % tp != 0)
    throw std::invalid_argument(std::string(layer) + ": the padded vocabulary Vp=" + std::to_string(Vp) +
                                " does not split into " + std::to_string(tp) + " equal shards over TP of " + M::name() +
                                "; pad the vocabulary to a multiple of TP (padded_vocab(V, " + std::to_string(tp) +
                                ") = " + std::to_string(padded_vocab(Vp, tp)) + ")");
}

// The communicator must be this rank's TP communicator (as redistribute checks).
template <MeshType M, class C>
void check_tp_comm(const C& comm, const Coord& c, const char* layer) {
  constexpr int n = M::extent(Axis::tp);
  if (comm.size() != n || comm.rank() != c[Axis::tp] ||
      std::string(comm.name()) != AxisGroup<M, axis_bit(Axis::tp)>::name())
    throw std::invalid_argument(std::string(layer) + " needs this rank's tp communicator of " + M::name() +
                                " (size " + std::to_string(n) + ", rank " + std::to_string(c[Axis::tp]) +
                                "), but got '" + comm.name() + "'");
}

}  // namespace detail

template <MeshType M, bool SP = false, class T = float>
class VocabParallelEmbedding : private detail::ParamStorage<T> {
 public:
  using mesh = M;
  using value_type = T;
  static constexpr bool sequence_parallel = SP;
  static constexpr int tp_size = M::extent(Axis::tp);
  using output_placement = std::conditional_t<SP, Shard<1>, Replicate>;
  using weight_placement = Shard<0>;  // vocabulary rows split
  using output_type = Activation<T, M, output_placement>;
  using weight_layout = ParamLayout<M, 2, weight_placement>;
  using weight_type = ShardedView<T, weight_layout>;

  // Alone: slices the serial table wte [Vp, C] (row-major); Vp must be a multiple
  // of TP (pad the vocabulary: padded_vocab(V, TP)). `coord` is this rank's.
  VocabParallelEmbedding(std::int64_t Vp, std::int64_t C, std::span<const T> wte, Coord coord)
      : vp_((detail::check_vocab_split<M>(Vp, "VocabParallelEmbedding"), Vp)), c_(C),
        w_(weight_layout({Vp, C}, coord), this->own_slice(weight_layout({Vp, C}, coord), wte, "token embedding")),
        dw_(w_.layout(), this->own_zeros(w_.layout().local_size())) {}
  // Inside a model: views of its buffers.
  VocabParallelEmbedding(std::int64_t Vp, std::int64_t C, ParamSlot<T> wte, Coord coord)
      : vp_((detail::check_vocab_split<M>(Vp, "VocabParallelEmbedding"), Vp)), c_(C),
        w_(weight_layout({Vp, C}, coord), wte.value), dw_(w_.layout(), wte.grad) {}

  // tokens [B, T_] (row-major, the same on every TP rank), ids in [0, Vp).
  template <Communicator Comm>
  output_type forward(std::span<const int> tokens, std::int64_t B, std::int64_t T_, Comm& tp) {
    if (static_cast<std::int64_t>(tokens.size()) != B * T_)
      throw std::invalid_argument("VocabParallelEmbedding::forward: " + std::to_string(tokens.size()) +
                                  " token ids for B*T = " + std::to_string(B * T_));
    for (std::size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] < 0 || tokens[i] >= vp_)
        throw std::invalid_argument("VocabParallelEmbedding::forward: token " + std::to_string(tokens[i]) +
                                    " at position " + std::to_string(i) + " is outside the vocabulary [0, " +
                                    std::to_string(vp_) + ")");
    tokens_.assign(tokens.begin(), tokens.end());
    b_ = B, t_ = T_;
    have_forward_ = true;
    const std::int64_t lo = lo_id(), n = local_rows();
    ActivationLayout<M, Partial> pl({B, T_, c_}, w_.layout().coord());
    std::vector<T> y(static_cast<std::size_t>(pl.local_size()), T{});  // out-of-shard ids: zero rows
    const std::size_t sC = static_cast<std::size_t>(c_);
    const auto w = w_.local();
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      const std::int64_t local = tokens_[i] - lo;
      if (local < 0 || local >= n) continue;
      std::copy_n(w.begin() + static_cast<std::size_t>(local) * sC, sC, y.begin() + i * sC);
    }
    return redistribute<Axis::tp, output_placement>(Activation<T, M, Partial>(std::move(pl), std::move(y)), tp);
  }

  // Takes dy placed like the output; accumulates the gradient of this rank's rows of wte.
  template <Communicator Comm>
  void backward(const output_type& dy, Comm& tp) {
    if (!have_forward_) throw std::logic_error("VocabParallelEmbedding::backward called before forward");
    if (dy.layout().global_shape() != std::array<std::int64_t, 3>{b_, t_, c_})
      throw std::invalid_argument("VocabParallelEmbedding::backward: dy does not have the shape of the output");
    const auto dy_full = redistribute<Axis::tp, Replicate>(dy, tp);
    using A = acc_t<T>;
    const std::int64_t lo = lo_id(), n = local_rows();
    // In-shard positions grouped by id (stable: in position order), each group
    // summed in acc_t and added once, as kernels::host::embedding_backward does.
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < tokens_.size(); ++i)
      if (tokens_[i] - lo >= 0 && tokens_[i] - lo < n) order.push_back(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return tokens_[a] < tokens_[b]; });
    const std::size_t sC = static_cast<std::size_t>(c_);
    const auto g = dy_full.local();
    auto dw = dw_.local();
    std::vector<A> sum(sC);
    for (std::size_t k = 0; k < order.size();) {
      const int tok = tokens_[order[k]];
      std::fill(sum.begin(), sum.end(), A(0));
      for (; k < order.size() && tokens_[order[k]] == tok; ++k)
        for (std::size_t c = 0; c < sC; ++c) sum[c] += static_cast<A>(g[order[k] * sC + c]);
      T* e = dw.data() + static_cast<std::size_t>(tok - lo) * sC;
      for (std::size_t c = 0; c < sC; ++c) e[c] = static_cast<T>(static_cast<A>(e[c]) + sum[c]);
    }
  }

  void zero_grad() { std::fill(dw_.local().begin(), dw_.local().end(), T{}); }
  std::int64_t padded_vocab_size() const { return vp_; }
  std::int64_t embedding_dim() const { return c_; }
  // This rank's ids: [vocab_begin(), vocab_begin() + Vp/TP).
  std::int64_t vocab_begin() const { return lo_id(); }
  const weight_type& weight() const { return w_; }
  const weight_type& weight_grad() const { return dw_; }

 private:
  std::int64_t local_rows() const { return w_.layout().local_shape()[0]; }
  std::int64_t lo_id() const { return w_.layout().offset()[0]; }

  std::int64_t vp_, c_;
  weight_type w_, dw_;
  std::vector<int> tokens_;
  std::int64_t b_ = 0, t_ = 0;
  bool have_forward_ = false;
};

// The output projection of a GPT over the split vocabulary: logits = x · W^T
// with W [Vp, C] placed Shard<0> (the tied wte, or lm_head), i.e. a
// column-parallel linear whose weight is stored transposed.
//   in:  Replicate (SP: Shard<1>)                     out: Shard<2> (vocabulary)
//   fwd  x_full = redistribute<tp, Replicate>(x)      identity   | all-gather
//        logits_local = x_full W_local^T              [B, T, Vp/TP]
//   bwd  dW_local += dlogits^T x_full                 (no collective)
//        dx = dlogits W_local (Partial) -> redistribute<tp, in>
//                                                     all-reduce | reduce-scatter
// The weight is a view of the model's buffer (a tied head shares the
// embedding's slot, so both gradients add into one).
template <MeshType M, bool SP = false, class T = float>
class VocabParallelHead {
 public:
  using mesh = M;
  using value_type = T;
  using input_placement = std::conditional_t<SP, Shard<1>, Replicate>;
  using output_placement = Shard<2>;
  using weight_layout = ParamLayout<M, 2, Shard<0>>;
  using input_type = Activation<T, M, input_placement>;
  using output_type = Activation<T, M, output_placement>;

  VocabParallelHead(std::int64_t Vp, std::int64_t C, ParamSlot<T> weight, Coord coord)
      : vp_((detail::check_vocab_split<M>(Vp, "VocabParallelHead"), Vp)), c_(C),
        w_(weight_layout({Vp, C}, coord), weight.value), dw_(w_.layout(), weight.grad) {}

  template <Communicator Comm>
  output_type forward(const input_type& x, Comm& tp) {
    detail::check_width(x, c_, "VocabParallelHead::forward");
    x_full_.emplace(redistribute<Axis::tp, Replicate>(x, tp));
    const auto g = x.layout().global_shape();
    ActivationLayout<M, output_placement> yl({g[0], g[1], vp_}, x.layout().coord());
    std::vector<T> y(static_cast<std::size_t>(yl.local_size()));
    kernels::host::matmul(y.data(), x_full_->local().data(), w_.local().data(), nullptr, rows(), local_vocab(), c(),
                          false, true);
    return output_type(std::move(yl), std::move(y));
  }

  template <Communicator Comm>
  input_type backward(const output_type& dlogits, Comm& tp) {
    if (!x_full_) throw std::logic_error("VocabParallelHead::backward called before forward");
    const auto g = x_full_->layout().global_shape();
    if (dlogits.layout().global_shape() != std::array<std::int64_t, 3>{g[0], g[1], vp_})
      throw std::invalid_argument("VocabParallelHead::backward: d-logits do not have the shape of the logits");
    kernels::host::matmul(dw_.local().data(), dlogits.local().data(), x_full_->local().data(), nullptr, local_vocab(),
                          c(), rows(), true, false, true);
    ActivationLayout<M, Partial> dl(g, dlogits.layout().coord());
    std::vector<T> dx(static_cast<std::size_t>(dl.local_size()));
    kernels::host::matmul(dx.data(), dlogits.local().data(), w_.local().data(), nullptr, rows(), c(), local_vocab(),
                          false, false);
    return redistribute<Axis::tp, input_placement>(Activation<T, M, Partial>(std::move(dl), std::move(dx)), tp);
  }

 private:
  int rows() const {
    const auto g = x_full_->layout().global_shape();
    return detail::checked_int(g[0] * g[1], "B*T");
  }
  int local_vocab() const { return detail::checked_int(w_.layout().local_shape()[0], "Vp/TP"); }
  int c() const { return detail::checked_int(c_, "C"); }

  std::int64_t vp_, c_;
  ShardedView<T, weight_layout> w_, dw_;
  std::optional<Activation<T, M, Replicate>> x_full_;  // saved for dW
};

template <MeshType M, class T = float>
class VocabParallelCrossEntropy {
 public:
  using mesh = M;
  using value_type = T;
  using acc_type = acc_t<T>;
  static constexpr int tp_size = M::extent(Axis::tp);
  using input_placement = Shard<2>;  // logits split over the vocabulary
  using logits_type = Activation<T, M, input_placement>;

  // V: the real vocabulary; logit columns >= V are padding and never count.
  explicit VocabParallelCrossEntropy(std::int64_t V) : v_(V) {
    if (V <= 0) throw std::invalid_argument("VocabParallelCrossEntropy: the vocabulary must be >= 1");
  }

  // logits [B, T, Vp] (this rank's columns), targets [B*T] in [0, V), the same
  // on every TP rank. Returns the mean loss over the B*T rows (the same on every
  // rank, from acc_t statistics summed in double, as the serial model's loss())
  // and overwrites the logits with d(loss_scale * mean loss)/d logits.
  template <Communicator Comm>
  double forward_backward(logits_type& logits, std::span<const int> targets, Comm& tp, float loss_scale = 1.0f) {
    using A = acc_type;
    const auto g = logits.layout().global_shape();
    const Coord coord = logits.layout().coord();
    detail::check_vocab_split<M>(g[2], "VocabParallelCrossEntropy");
    detail::check_tp_comm<M>(tp, coord, "VocabParallelCrossEntropy");
    if (g[2] < v_)
      throw std::invalid_argument("VocabParallelCrossEntropy: the logits have " + std::to_string(g[2]) +
                                  " columns, fewer than the vocabulary V=" + std::to_string(v_));
    const std::int64_t rows64 = g[0] * g[1];
    if (static_cast<std::int64_t>(targets.size()) != rows64)
      throw std::invalid_argument("VocabParallelCrossEntropy: " + std::to_string(targets.size()) +
                                  " targets for B*T = " + std::to_string(rows64));
    const int N = detail::checked_int(rows64, "B*T"), Vs = detail::checked_int(g[2] / tp_size, "Vp/TP"),
              V = detail::checked_int(v_, "V"), offset = detail::checked_int(logits.layout().offset()[2], "offset");
    const std::size_t sN = static_cast<std::size_t>(N);
    T* x = logits.local().data();

    // 1. Global max per row. A max is not a sum, so this is not a placement
    //    change (Partial means "the value is the sum of the ranks' pieces";
    //    redistribute<tp, Replicate> of a Partial is an all-reduce *sum*): it is
    //    a direct all_reduce(max) of the per-row local maxima.
    std::vector<A> max(sN);
    kernels::host::logits_max(max.data(), x, N, Vs, offset, V);
    tp.all_reduce(std::span<const A>(max), std::span<A>(max), ReduceOp::max);

    // 2./3. Sum of exp and the target's logit: each rank holds the part from its
    //    columns, so they are Partial [B*T] statistics, and the sum over TP is
    //    redistribute<tp, Replicate> (an all-reduce each).
    RowStatsLayout<M, Partial> sl({rows64}, coord);
    std::vector<A> sumexp(sN), target_logit(sN);
    kernels::host::crossentropy_partials(sumexp.data(), target_logit.data(), x, targets.data(), max.data(), N, Vs,
                                         offset, V);
    const auto s = redistribute<Axis::tp, Replicate>(RowStats<A, M, Partial>(sl, std::move(sumexp)), tp);
    const auto t = redistribute<Axis::tp, Replicate>(RowStats<A, M, Partial>(sl, std::move(target_logit)), tp);

    const float dloss = N > 0 ? loss_scale / static_cast<float>(N) : 0.0f;
    // d-logits only: the loss comes from the statistics, in double, below
    kernels::host::crossentropy_backward(static_cast<float*>(nullptr), x, x, targets.data(), max.data(),
                                         s.local().data(), t.local().data(), N, Vs, offset, V, dloss);
    return kernels::host::mean_loss(max.data(), s.local().data(), t.local().data(), N);
  }

  std::int64_t vocab_size() const { return v_; }

 private:
  std::int64_t v_;
};

}  // namespace fived::nn::tp
