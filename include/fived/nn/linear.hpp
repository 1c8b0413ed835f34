#pragma once
// Megatron's tensor-parallel linear layers over the residual stream (nn/stream.hpp), as
// functions of a Step: they hold no storage; weights, gradients and activations are
// pointers into the model's flat buffers and activation slots. Weights are Hugging Face
// Conv1D [in, out] (y = x W + b): the forward GEMMs use no transpose, dW = x^T dy uses
// trans_a and dx = dy W^T uses trans_b.
//
//   ColumnParallel  weight Shard<1> [in, out/TP], bias Shard<0>; reads every row of x
//                   (gather_rows), writes [N, out/TP]. Backward: dx = dy W^T is a Partial
//                   sum over TP -> reduce_rows into the stream.
//   RowParallel     weight Shard<0> [in/TP, out], bias Replicate; reads [N, in/TP], its
//                   output is a Partial sum -> reduce_rows into the stream. The bias joins
//                   the sum on TP rank 0 only (fused into the GEMM, as on one rank).
//                   Backward gathers dy's rows once for dx, dW and the bias gradient, so
//                   the bias gradient is complete on every rank (no collective of its own).
//
// At TP 1 the collectives vanish and these are the serial model's GEMMs, call for call.

#include "fived/nn/stream.hpp"

namespace fived {

template <class S>
struct ColumnParallel {
  using T = typename S::value_type;
  using Epilogue = typename S::ops_type::Epilogue;

  // y[N, out] = x_full[N, in] W[in, out] + b, out = this rank's columns.
  static void forward(S& s, T* y, const T* x_full, const T* w, const T* b, int in, int out,
                      Epilogue ep = Epilogue::none, T* pre_act = nullptr) {
    s.ops.matmul(y, x_full, w, b, s.rows(), out, in, false, false, false, ep, pre_act);
  }
  // dx (the stream's rows, "=") from dy [N, out]; dW, db "+=". scratch: [N, in] when SP.
  static void backward(S& s, T* dx, T* dw, T* db, const T* dy, const T* x_full, const T* w, int in, int out,
                       T* scratch) {
    T* p = s.partial_buffer(dx, scratch);
    s.ops.matmul(p, dy, w, static_cast<const T*>(nullptr), s.rows(), in, out, false, true);
    s.ops.matmul(dw, x_full, dy, static_cast<const T*>(nullptr), in, out, s.rows(), true, false, true);
    s.ops.bias_backward(db, dy, s.rows(), out);
    s.reduce_rows(p, dx, in);
  }
};

template <class S>
struct RowParallel {
  using T = typename S::value_type;

  // y (the stream's rows, "=") = sum over TP of x[N, in] W[in, out] + b. scratch: [N, out] when SP.
  static void forward(S& s, T* y, const T* x, const T* w, const T* b, int in, int out, T* scratch) {
    T* p = s.partial_buffer(y, scratch);
    s.ops.matmul(p, x, w, s.rank() == 0 ? b : static_cast<const T*>(nullptr), s.rows(), out, in, false, false);
    s.reduce_rows(p, y, out);
  }
  // dx[N, in] ("=") from dy (the stream's rows); dW, db "+=". gather: [N, out] when SP.
  static void backward(S& s, T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int in, int out, T* gather) {
    const T* dy_full = s.gather_rows(dy, gather, out);
    s.ops.matmul(dx, dy_full, w, static_cast<const T*>(nullptr), s.rows(), in, out, false, true);
    s.ops.matmul(dw, x, dy_full, static_cast<const T*>(nullptr), in, out, s.rows(), true, false, true);
    s.ops.bias_backward(db, dy_full, s.rows(), out);
  }
};

}  // namespace fived
