#pragma once
// LayerNorm over the stream's rows on this rank. Weight and bias [C] are replicated on TP
// and issue no collective: forward and backward touch only the local rows. Their gradients
// sum over those rows, so under sequence parallelism each rank holds a Partial sum
// (spec.sp_partial); the model all-reduces a unit's such gradients over TP as soon as the
// unit's backward is done (Megatron's all-reduce of the sequence-parallel LayerNorm
// gradients, one per unit so a data-parallel trainer can reduce the unit at once).

#include <array>

#include "fived/device/buffer.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/stream.hpp"

namespace fived {

// weight (ones) and bias (zeros) [C]; `stream` is the weight's random stream, the bias's the next.
constexpr std::array<TensorSpec, 2> layernorm_specs(const char* weight, const char* bias, int layer, int unit, int C,
                                                 std::uint64_t stream) {
  return {vector_spec(weight, layer, C, {}, unit, Init::ones, stream, true),
          vector_spec(bias, layer, C, {}, unit, Init::zeros, stream + 1, true)};
}

template <class S>
struct LayerNorm {
  using T = typename S::value_type;
  using stat_t = typename S::stat_t;

  struct Params {
    T *w, *b;
  };
  static Params bind(TensorCursor<T>& c) { return {c.take(), c.take()}; }  // braces: in order

  // What backward needs: the output and the per-row statistics.
  struct Saved {
    Buffer<T, typename S::device> out;
    Buffer<stat_t, typename S::device> mean, rstd;
    void reserve(typename S::ops_type& ops, std::size_t rows, std::size_t C) {
      out = ops.template make_buffer<T>(rows * C);
      mean = ops.template make_buffer<stat_t>(rows);
      rstd = ops.template make_buffer<stat_t>(rows);
    }
  };

  static void forward(S& s, Saved& a, const T* x, const T* w, const T* b, int C) {
    s.ops.layernorm_forward(a.out.data(), a.mean.data(), a.rstd.data(), x, w, b, s.local_rows(), C);
  }
  static void forward(S& s, Saved& a, const T* x, Params p, int C) { forward(s, a, x, p.w, p.b, C); }
  // The residual add before the norm, fused into it: res = x + y, then forward(res). res is
  // the input backward takes.
  static void forward_residual(S& s, Saved& a, T* res, const T* x, const T* y, Params p, int C) {
    s.ops.residual_layernorm_forward(res, a.out.data(), a.mean.data(), a.rstd.data(), x, y, p.w, p.b, s.local_rows(),
                                     C);
  }
  // dx, dw, db "+=" from dy (the stream's rows); x is the forward's input. All three in one
  // pass over dy and x, or, when the backward is split, dx now and dw, db as the weight half
  // (Step::weight_grad): then dy and x are read twice.
  static void backward(S& s, T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const Saved& a, int C) {
    const int n = s.local_rows();
    if (!s.defers_weight_grads()) {
      s.ops.layernorm_backward(dx, dw, db, dy, x, w, a.mean.data(), a.rstd.data(), n, C);
      return;
    }
    const std::size_t rows = static_cast<std::size_t>(n), elems = rows * static_cast<std::size_t>(C);
    s.ops.layernorm_backward(dx, static_cast<T*>(nullptr), static_cast<T*>(nullptr), dy, x, w, a.mean.data(),
                             a.rstd.data(), n, C);
    const T *g = s.hold(dy, elems), *xs = s.hold_saved(x, elems);
    const stat_t *mean = s.hold_saved(a.mean.data(), rows), *rstd = s.hold_saved(a.rstd.data(), rows);
    s.weight_grad([=](auto& ops) {
      ops.layernorm_backward(static_cast<T*>(nullptr), dw, db, g, xs, static_cast<const T*>(nullptr), mean, rstd, n, C);
    });
  }
  static void backward(S& s, T* dx, Params g, const T* dy, const T* x, Params p, const Saved& a, int C) {
    backward(s, dx, g.w, g.b, dy, x, p.w, a, C);
  }
};

}  // namespace fived
