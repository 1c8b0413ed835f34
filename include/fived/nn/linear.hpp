#pragma once
// Megatron's tensor-parallel linear layers over the residual stream (nn/stream.hpp), as
// functions of a Step: they hold no storage; weights, gradients and activations are
// pointers into the model's flat buffers and activation slots. A weight is stored as its
// Hugging Face file has it (the second template argument):
//   Conv1D       [in, out], y = x W + b (GPT-2): dW = x^T dy, dx = dy W^T
//   TorchLinear  [out, in], y = x W^T + b (torch.nn.Linear: Llama): dW = dy^T x, dx = dy W
// Either way the output features are what ColumnParallel splits and the input features
// what RowParallel splits. A null bias (and bias gradient) is no bias.
//
//   ColumnParallel  weight [in, out/TP] or [out/TP, in], bias Shard<0>; reads every row of x
//                   (gather_rows), writes [N, out/TP]. Backward: dx = dy W^T is a Partial
//                   sum over TP -> reduce_rows into the stream.
//   RowParallel     weight [in/TP, out] or [out, in/TP], bias Replicate; reads [N, in/TP], its
//                   output is a Partial sum -> reduce_rows into the stream. The bias joins
//                   the sum on TP rank 0 only (fused into the GEMM, as on one rank).
//                   Backward gathers dy's rows once for dx, dW and the bias gradient, so
//                   the bias gradient is complete on every rank (no collective of its own).
//
// At TP 1 the collectives vanish and these are the serial model's GEMMs, call for call.

#include "fived/nn/stream.hpp"

namespace fived {

struct Conv1D {
  static constexpr bool transposed = false;
};
struct TorchLinear {
  static constexpr bool transposed = true;
};

namespace detail_linear {
// y[N, out] = x[N, in] W (+ b), W as stored.
template <class W, class S, class T, class... Epi>
void apply(S& s, T* y, const T* x, const T* w, const T* b, int in, int out, Epi... epilogue) {
  s.ops.matmul(y, x, w, b, s.rows(), out, in, false, W::transposed, false, epilogue...);
}
}  // namespace detail_linear

// A linear map's weight half over `rows` rows, as Step::weight_grad runs it (now, or at W):
// dW += x^T dy in W's storage, db += the sum of dy's rows (a null db: no bias). dy and x must
// outlive the call: pass what backward overwrites through Step::hold. For every layer with
// a weight of its own (the experts' slices, the router, the head) as for these below; batch:
// several such maps of one shape at once (padded experts, nn/moe.hpp).
template <class W, class S, class T>
void linear_weight_grad(S& s, T* dw, T* db, const T* dy, const T* x, int rows, int in, int out,
                        typename S::ops_type::WeightGradBatch batch = {}) {
  s.weight_grad([=](auto& ops) { ops.matmul_weight_grad(dw, db, dy, x, rows, in, out, W::transposed, batch); });
}

namespace detail_linear {
// dx[N, in] = dy[N, out] W^T; then the weight half, with dy and a recomputed x held. With
// gelu_pre (x = GELU(gelu_pre)), dx is carried through that GELU: the gradient at gelu_pre,
// the GELU's backward fused into this GEMM.
template <class W, class S, class T>
void backward(S& s, T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int in, int out,
              const T* gelu_pre = nullptr) {
  const int N = s.rows();
  if (gelu_pre != nullptr) s.ops.matmul_dgelu(dx, dy, w, gelu_pre, N, in, out, false, !W::transposed);
  else s.ops.matmul(dx, dy, w, static_cast<const T*>(nullptr), N, in, out, false, !W::transposed);
  linear_weight_grad<W>(s, dw, db, s.hold(dy, static_cast<std::size_t>(N) * static_cast<std::size_t>(out)),
                        s.hold_saved(x, static_cast<std::size_t>(N) * static_cast<std::size_t>(in)), N, in, out);
}
}  // namespace detail_linear

template <class S, class W = Conv1D>
struct ColumnParallel {
  using T = typename S::value_type;
  using Epilogue = typename S::ops_type::Epilogue;

  // y[N, out] = x_full[N, in] W + b, out = this rank's output features.
  static void forward(S& s, T* y, const T* x_full, const T* w, const T* b, int in, int out,
                      Epilogue ep = Epilogue::none, T* pre_act = nullptr) {
    detail_linear::apply<W>(s, y, x_full, w, b, in, out, ep, pre_act);
  }
  // dx (the stream's rows, "=") from dy [N, out]; dW, db "+=". scratch: [N, in] when SP.
  static void backward(S& s, T* dx, T* dw, T* db, const T* dy, const T* x_full, const T* w, int in, int out,
                       T* scratch) {
    T* p = s.partial_buffer(dx, scratch);
    detail_linear::backward<W>(s, p, dw, db, dy, x_full, w, in, out);
    s.reduce_rows(p, dx, in);
  }
};

template <class S, class W = Conv1D>
struct RowParallel {
  using T = typename S::value_type;

  // y (the stream's rows, "=") = sum over TP of x[N, in] W + b. scratch: [N, out] when SP.
  static void forward(S& s, T* y, const T* x, const T* w, const T* b, int in, int out, T* scratch) {
    T* p = s.partial_buffer(y, scratch);
    detail_linear::apply<W>(s, p, x, w, s.rank() == 0 ? b : static_cast<const T*>(nullptr), in, out);
    s.reduce_rows(p, y, out);
  }
  // dx[N, in] ("=") from dy (the stream's rows); dW, db "+=". gather: [N, out] when SP.
  // gelu_pre: x is GELU(gelu_pre) (an MLP's hidden units), and dx the gradient at gelu_pre.
  static void backward(S& s, T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int in, int out, T* gather,
                       const T* gelu_pre = nullptr) {
    detail_linear::backward<W>(s, dx, dw, db, s.gather_rows(dy, gather, out), x, w, in, out, gelu_pre);
  }
};

}  // namespace fived
