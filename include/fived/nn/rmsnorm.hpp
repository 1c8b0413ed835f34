#pragma once
// RMSNorm over the stream's rows on this rank (Llama): out = x / rms(x) * weight, the mean
// square in acc_t, eps 1e-5. Like LayerNorm (nn/layernorm.hpp) its weight is replicated on
// TP, it issues no collective, and its gradient is a Partial sum over TP under sequence
// parallelism (spec.sp_partial), which the model all-reduces per unit.

#include <array>
#include <cstdint>

#include "fived/device/buffer.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/stream.hpp"

namespace fived {

// weight (ones) [C].
constexpr std::array<TensorSpec, 1> rmsnorm_specs(const char* weight, int layer, int unit, int C, std::uint64_t stream) {
  return {vector_spec(weight, layer, C, {}, unit, Init::ones, stream, true)};
}

template <class S>
struct RMSNorm {
  using T = typename S::value_type;
  using stat_t = typename S::stat_t;

  struct Params {
    T* w;
  };
  static Params bind(TensorCursor<T>& c) { return {c.take()}; }

  // What backward needs: the output and the per-row 1/rms.
  struct Saved {
    Buffer<T, typename S::device> out;
    Buffer<stat_t, typename S::device> rstd;
    void reserve(typename S::ops_type& ops, std::size_t rows, std::size_t C) {
      out = ops.template make_buffer<T>(rows * C);
      rstd = ops.template make_buffer<stat_t>(rows);
    }
  };

  static void forward(S& s, Saved& a, const T* x, Params p, int C) {
    s.ops.rmsnorm_forward(a.out.data(), a.rstd.data(), x, p.w, s.local_rows(), C);
  }
  // The residual add before the norm, fused into it: res = x + y, then forward(res). res is
  // the input backward takes.
  static void forward_residual(S& s, Saved& a, T* res, const T* x, const T* y, Params p, int C) {
    s.ops.residual_rmsnorm_forward(res, a.out.data(), a.rstd.data(), x, y, p.w, s.local_rows(), C);
  }
  // dx, dw "+=" from dy (the stream's rows); x is the forward's input. Both in one pass over
  // dy and x, or, when the backward is split, dx now and dw as the weight half
  // (Step::weight_grad).
  static void backward(S& s, T* dx, Params g, const T* dy, const T* x, Params p, const Saved& a, int C) {
    const int n = s.local_rows();
    if (!s.defers_weight_grads()) {
      s.ops.rmsnorm_backward(dx, g.w, dy, x, p.w, a.rstd.data(), n, C);
      return;
    }
    const std::size_t rows = static_cast<std::size_t>(n), elems = rows * static_cast<std::size_t>(C);
    s.ops.rmsnorm_backward(dx, static_cast<T*>(nullptr), dy, x, p.w, a.rstd.data(), n, C);
    const T *d = s.hold(dy, elems), *xs = s.hold_saved(x, elems);
    const stat_t* rstd = s.hold_saved(a.rstd.data(), rows);
    T* dw = g.w;
    s.weight_grad([=](auto& ops) {
      ops.rmsnorm_backward(static_cast<T*>(nullptr), dw, d, xs, static_cast<const T*>(nullptr), rstd, n, C);
    });
  }
};

}  // namespace fived
