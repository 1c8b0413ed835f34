#pragma once
// Llama's tensor-parallel SwiGLU MLP: down(silu(gate(x)) * up(x)). gate_proj and up_proj
// are ColumnParallel (the hidden units split over TP) and adjacent in the flat buffer, so
// one GEMM computes both ([N, 2F/TP]: this rank's gate columns, then its up columns);
// down_proj is RowParallel back to the stream. torch.nn.Linear weights [out, in], no
// biases. Per step on the TP group: as the GELU MLP (nn/mlp.hpp).

#include <array>
#include <cstdint>
#include <stdexcept>

#include "fived/device/buffer.hpp"
#include "fived/nn/linear.hpp"
#include "fived/nn/param_table.hpp"

namespace fived {

// mlp.gate_proj.weight [F, C], mlp.up_proj.weight [F, C], mlp.down_proj.weight [C, F];
// streams stream .. stream + 2.
constexpr std::array<TensorSpec, 3> swiglu_specs(int layer, int unit, int C, int F, std::uint64_t stream) {
  return {matrix_spec("mlp.gate_proj.weight", layer, F, C, {0, 1}, unit, Init::normal, stream),
          matrix_spec("mlp.up_proj.weight", layer, F, C, {0, 1}, unit, Init::normal, stream + 1),
          matrix_spec("mlp.down_proj.weight", layer, C, F, {1, 1}, unit, Init::normal_residual, stream + 2)};
}

template <class S>
struct SwiGLU {
  using T = typename S::value_type;
  using Linear = TorchLinear;

  struct Saved {
    Buffer<T, typename S::device> x_full;  // SP: the gathered input (gate and up's dW)
    Buffer<T, typename S::device> gu, h;   // [gate | up] [N, 2F/TP] and silu(gate) * up [N, F/TP]
    void reserve(typename S::ops_type& ops, std::size_t N, std::size_t C, std::size_t F) {
      if constexpr (S::sp) x_full = ops.template make_buffer<T>(N * C);
      gu = ops.template make_buffer<T>(N * 2 * F / S::tp);
      h = ops.template make_buffer<T>(N * F / S::tp);
    }
  };
  // gate and up as one [2F/TP, C] weight: the two pieces lie back to back.
  struct Params {
    T *gate_up, *down;
  };
  static Params bind(TensorCursor<T>& c, int C, int F) {
    T* gate = c.take();
    if (c.take() != gate + static_cast<std::size_t>(F / S::tp) * static_cast<std::size_t>(C))
      throw std::logic_error("SwiGLU: gate_proj and up_proj must be adjacent in the flat buffer (in spec order)");
    return {gate, c.take()};
  }

  static void forward(S& s, Saved& a, T* y, const T* x, Params p, int C, int F, T* partial) {
    const int Fl = F / S::tp;
    const T* x_full = s.gather_rows(x, a.x_full.data(), C);
    ColumnParallel<S, Linear>::forward(s, a.gu.data(), x_full, p.gate_up, nullptr, C, 2 * Fl);
    s.ops.swiglu_forward(a.h.data(), a.gu.data(), s.rows(), Fl);
    RowParallel<S, Linear>::forward(s, y, a.h.data(), p.down, nullptr, Fl, C, partial);
  }

  // dx (the stream's rows, "=") from dy; gradients "+=". Work buffers: dh [N, F/TP],
  // dgu [N, 2F/TP], full [N, C] when SP.
  static void backward(S& s, T* dx, Params g, const T* dy, const T* x, const Saved& a, Params p, int C, int F, T* dh,
                       T* dgu, T* full) {
    const int Fl = F / S::tp;
    const T* x_full = S::sp ? a.x_full.data() : x;
    RowParallel<S, Linear>::backward(s, dh, g.down, nullptr, dy, a.h.data(), p.down, Fl, C, full);
    s.ops.swiglu_backward(dgu, dh, a.gu.data(), s.rows(), Fl);
    ColumnParallel<S, Linear>::backward(s, dx, g.gate_up, nullptr, dgu, x_full, p.gate_up, C, 2 * Fl, full);
  }
};

}  // namespace fived
