#pragma once
// The output projection and the vocab-parallel cross-entropy (Megatron).
//
// logits [N, Vp/TP] = x_full · W^T with W [Vp, C] split over TP by rows (the tied wte, or
// lm_head): a column-parallel layer whose weight is stored transposed. The logits are
// never gathered: the loss takes three all-reduces of per-row statistics [N] over TP,
//   1. max of the logits               all-reduce(max)
//   2. sum of exp(logit - max)          all-reduce(sum)
//   3. the target's logit               all-reduce(sum) (zero on the ranks without it)
// then each rank has every row's loss and writes its shard of d-logits over the logits.
// Padding columns (>= V) never count. Backward: dx = dlogits · W is a Partial sum ->
// reduce_rows into the stream; dW += dlogits^T x_full.

#include <array>
#include <cstdint>

#include "fived/device/buffer.hpp"
#include "fived/nn/linear.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/stream.hpp"

namespace fived {

// An untied head's lm_head.weight [Vp, C] (stream 16); a tied one has no tensor of its own.
constexpr std::array<TensorSpec, 1> head_specs(int V, int Vp, int C, int unit) {
  return {matrix_spec("lm_head.weight", -1, Vp, C, {0, 1}, unit, Init::normal, 16, V)};
}

template <class S>
struct Head {
  using T = typename S::value_type;
  using stat_t = typename S::stat_t;

  struct Saved {
    Buffer<T, typename S::device> x_full;  // SP: the gathered input
    Buffer<T, typename S::device> logits;  // [N, Vp/TP]; d-logits after a forward with targets
    Buffer<stat_t, typename S::device> max, sumexp, target;
    Buffer<stat_t, typename S::device> losses;
    void reserve(typename S::ops_type& ops, std::size_t N, std::size_t C, std::size_t Vp) {
      if constexpr (S::sp) x_full = ops.template make_buffer<T>(N * C);
      logits = ops.template make_buffer<T>(N * Vp / S::tp);
      max = ops.template make_buffer<stat_t>(N);
      sumexp = ops.template make_buffer<stat_t>(N);
      target = ops.template make_buffer<stat_t>(N);
      losses = ops.template make_buffer<stat_t>(N);
    }
  };

  static void forward(S& s, Saved& a, const T* x, const T* w, int Vp, int C) {
    const T* x_full = s.gather_rows(x, a.x_full.data(), C);
    s.ops.matmul(a.logits.data(), x_full, w, static_cast<const T*>(nullptr), s.rows(), Vp / S::tp, C, false, true);
  }

  // The fused loss: statistics over TP, then d(mean loss)/d logits written over the logits.
  static void loss(S& s, Saved& a, const int* targets, int V, int Vp) {
    const int N = s.rows(), Vl = Vp / S::tp, first = s.rank() * Vl;
    if constexpr (S::tp == 1) {  // the whole vocabulary here: one pass (one kernel on CUDA)
      s.ops.crossentropy_fused(a.losses.data(), a.logits.data(), a.max.data(), a.sumexp.data(), a.target.data(),
                               a.logits.data(), targets, N, Vp, V, 1.0 / N);
      return;
    }
    const std::span<stat_t> max(a.max.data(), static_cast<std::size_t>(N)),
        sumexp(a.sumexp.data(), static_cast<std::size_t>(N)), target(a.target.data(), static_cast<std::size_t>(N));
    s.ops.logits_max(max.data(), a.logits.data(), N, Vl, first, V);
    s.comm.all_reduce(max, ReduceOp::max);
    s.ops.crossentropy_partials(sumexp.data(), target.data(), a.logits.data(), targets, max.data(), N, Vl, first, V);
    s.comm.all_reduce(sumexp);
    s.comm.all_reduce(target);
    s.ops.crossentropy_backward(a.losses.data(), a.logits.data(), a.logits.data(), targets, max.data(), sumexp.data(),
                                target.data(), N, Vl, first, V, 1.0 / N);
  }

  // dx (the stream's rows, "=") from the d-logits; dW "+=" as the weight half
  // (Step::weight_grad: the d-logits and x stay in the slot). partial: [N, C] when SP.
  static void backward(S& s, T* dx, T* dw, const Saved& a, const T* x, const T* w, int Vp, int C, T* partial) {
    const int Vl = Vp / S::tp, N = s.rows();
    const T* x_full = S::sp ? a.x_full.data() : x;
    const T* dlogits = a.logits.data();
    T* p = s.partial_buffer(dx, partial);
    s.ops.matmul(p, dlogits, w, static_cast<const T*>(nullptr), N, C, Vl, false, false);
    linear_weight_grad<TorchLinear>(s, dw, static_cast<T*>(nullptr), dlogits, x_full, N, C, Vl);
    s.reduce_rows(p, dx, C);
  }
};

}  // namespace fived
