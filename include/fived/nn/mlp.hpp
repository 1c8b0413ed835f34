#pragma once
// Megatron's tensor-parallel MLP: c_fc ColumnParallel (C -> F, the hidden units split over
// TP) with GELU fused into its GEMM, c_proj RowParallel (F -> C) back to the stream, GELU's
// backward fused into c_proj's dx GEMM. Per step on the TP group: without SP one all-reduce
// forward and one backward; with SP an all-gather and a reduce-scatter each way.

#include <array>
#include <cstdint>

#include "fived/device/buffer.hpp"
#include "fived/nn/linear.hpp"
#include "fived/nn/param_table.hpp"

namespace fived {

// c_fc.weight [C, F], c_fc.bias [F], c_proj.weight [F, C], c_proj.bias [C]; streams stream .. stream + 3.
constexpr std::array<TensorSpec, 4> mlp_specs(int layer, int unit, int C, int F, std::uint64_t stream) {
  return {matrix_spec("mlp.c_fc.weight", layer, C, F, {1, 1}, unit, Init::normal, stream),
          vector_spec("mlp.c_fc.bias", layer, F, {0, 1}, unit, Init::zeros, stream + 1),
          matrix_spec("mlp.c_proj.weight", layer, F, C, {0, 1}, unit, Init::normal_residual, stream + 2),
          vector_spec("mlp.c_proj.bias", layer, C, {}, unit, Init::zeros, stream + 3)};
}

template <class S>
struct MLP {
  using T = typename S::value_type;

  struct Saved {
    Buffer<T, typename S::device> x_full;   // SP: the gathered input (c_fc's dW)
    Buffer<T, typename S::device> pre, h;   // c_fc's output before and after GELU [N, F/TP]
    void reserve(typename S::ops_type& ops, std::size_t N, std::size_t C, std::size_t F) {
      if constexpr (S::sp) x_full = ops.template make_buffer<T>(N * C);
      pre = ops.template make_buffer<T>(N * F / S::tp);
      h = ops.template make_buffer<T>(N * F / S::tp);
    }
  };
  struct Params {
    T *fc_w, *fc_b, *proj_w, *proj_b;
  };

  static void forward(S& s, Saved& a, T* y, const T* x, Params p, int C, int F, T* partial) {
    const int Fl = F / S::tp;
    const T* x_full = s.gather_rows(x, a.x_full.data(), C);
    ColumnParallel<S>::forward(s, a.h.data(), x_full, p.fc_w, p.fc_b, C, Fl, S::ops_type::Epilogue::gelu, a.pre.data());
    RowParallel<S>::forward(s, y, a.h.data(), p.proj_w, p.proj_b, Fl, C, partial);
  }

  // dx (the stream's rows, "=") from dy. Work buffers: dh [N, F/TP], full [N, C] when SP.
  static void backward(S& s, T* dx, Params g, const T* dy, const T* x, const Saved& a, Params p, int C, int F, T* dh,
                       T* full) {
    const int Fl = F / S::tp;
    const T* x_full = S::sp ? a.x_full.data() : x;
    // dh, the gradient at the GELU's input: its backward is in c_proj's dx GEMM
    RowParallel<S>::backward(s, dh, g.proj_w, g.proj_b, dy, a.h.data(), p.proj_w, Fl, C, full, a.pre.data());
    ColumnParallel<S>::backward(s, dx, g.fc_w, g.fc_b, dh, x_full, p.fc_w, C, Fl, full);
  }
};

}  // namespace fived
