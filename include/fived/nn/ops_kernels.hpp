#pragma once
// The kernels of the Ops contract (nn/ops.hpp) that every device forwards alike, each
// written once with its parameters: FIVED_OPS_KERNELS(X) calls X(name, (parameters),
// (arguments)) for each, and a device's Ops expands it into its member functions:
//
//   Ops<T, Host>   void name(parameters) { kernels::host::name(arguments); }
//   Ops<T, Cuda>   void name(parameters) { kernels::cuda::name(stream(), arguments); }
//
// T and stat_t are the Ops' element and statistics types. What a device runs its own way is
// written in its Ops: matmul (cuBLASLt on Cuda), whole-sequence attention (cuDNN where fived
// was built with it), the MoE dispatch plan (its scratch and the counts read back), regroup,
// and the loss sum read back once (loss_sum).
//
// (A macro, because a kernel's name must be spelled in each device's namespace: the list is
// the one place that names a kernel's parameters above the kernels.)

// The arguments of an entry without their parentheses.
#define FIVED_OPS_ARGS(...) __VA_ARGS__

#define FIVED_OPS_KERNELS(X)                                                                                     \
  X(layernorm_forward, (T* out, stat_t* mean, stat_t* rstd, const T* inp, const T* weight, const T* bias, int N, \
      int C),                                                                                                    \
    (out, mean, rstd, inp, weight, bias, N, C))                                                                  \
  X(layernorm_backward, (T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,            \
      const stat_t* mean, const stat_t* rstd, int N, int C),                                                     \
    (dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C))                                                 \
  X(rmsnorm_forward, (T* out, stat_t* rstd, const T* inp, const T* weight, int N, int C),                        \
    (out, rstd, inp, weight, N, C))                                                                              \
  X(residual_layernorm_forward, (T* res, T* out, stat_t* mean, stat_t* rstd, const T* a, const T* b,             \
      const T* weight, const T* bias, int N, int C),                                                             \
    (res, out, mean, rstd, a, b, weight, bias, N, C))                                                            \
  X(residual_rmsnorm_forward, (T* res, T* out, stat_t* rstd, const T* a, const T* b, const T* weight, int N,     \
      int C),                                                                                                    \
    (res, out, rstd, a, b, weight, N, C))                                                                        \
  X(rmsnorm_backward, (T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, const stat_t* rstd,    \
      int N, int C),                                                                                             \
    (dinp, dweight, dout, inp, weight, rstd, N, C))                                                              \
  X(swiglu_forward, (T* h, const T* gu, int N, int F), (h, gu, N, F))                                            \
  X(swiglu_backward, (T* dgu, const T* dh, const T* gu, int N, int F), (dgu, dh, gu, N, F))                      \
  X(rotary_forward, (T* qkv, const stat_t* inv_freq, int N, int H, int KV, int hd, RowPositions pos),            \
    (qkv, inv_freq, N, H, KV, hd, pos))                                                                          \
  X(rotary_backward, (T* dqkv, const stat_t* inv_freq, int N, int H, int KV, int hd, RowPositions pos),          \
    (dqkv, inv_freq, N, H, KV, hd, pos))                                                                         \
  X(gelu_forward, (T* out, const T* inp, std::size_t n), (out, inp, n))                                          \
  X(gelu_backward, (T* dinp, const T* inp, const T* dout, std::size_t n), (dinp, inp, dout, n))                  \
  X(residual_forward, (T* out, const T* a, const T* b, std::size_t n), (out, a, b, n))                           \
  X(attention_block_forward, (stat_t* o, stat_t* lse, const T* q, const T* k, const T* v, int ldq, int ldkv,     \
      int B, int n, int C, int NH, int NKV, bool causal, DocumentMask docs, bool first),                         \
    (o, lse, q, k, v, ldq, ldkv, B, n, C, NH, NKV, causal, docs, first))                                         \
  X(attention_row_dot, (stat_t* Dd, const T* dout, const T* out, int B, int n, int C, int NH),                   \
    (Dd, dout, out, B, n, C, NH))                                                                                \
  X(attention_block_backward, (stat_t* dq, stat_t* dk, stat_t* dv, int lddkv, const T* dout, const stat_t* Dd,   \
      const stat_t* lse, const T* q, const T* k, const T* v, int ldq, int ldkv, int B, int n, int C, int NH,     \
      int NKV, bool causal, DocumentMask docs),                                                                  \
    (dq, dk, dv, lddkv, dout, Dd, lse, q, k, v, ldq, ldkv, B, n, C, NH, NKV, causal, docs))                      \
  X(embedding_forward, (T* out, const int* tokens, const T* wte, int vocab_begin, int vocab_rows, const T* wpe,  \
      int B, int T_, int C),                                                                                     \
    (out, tokens, wte, vocab_begin, vocab_rows, wpe, B, T_, C))                                                  \
  X(embedding_backward, (T* dwte, T* dwpe, const T* dout, const int* tokens, int B, int T_, int C,               \
      int vocab_begin, int vocab_rows),                                                                          \
    (dwte, dwpe, dout, tokens, B, T_, C, vocab_begin, vocab_rows))                                               \
  X(logits_max, (stat_t* max, const T* logits, int N, int Vs, int offset, int V),                                \
    (max, logits, N, Vs, offset, V))                                                                             \
  X(crossentropy_partials, (stat_t* sumexp, stat_t* target_logit, const T* logits, const int* targets,           \
      const stat_t* max, int N, int Vs, int offset, int V),                                                      \
    (sumexp, target_logit, logits, targets, max, N, Vs, offset, V))                                              \
  X(crossentropy_backward, (stat_t* losses, T* dlogits, const T* logits, const int* targets, const stat_t* max,  \
      const stat_t* sumexp, const stat_t* target_logit, int N, int Vs, int offset, int V, double dloss),         \
    (losses, dlogits, logits, targets, max, sumexp, target_logit, N, Vs, offset, V, dloss))                      \
  X(crossentropy_fused, (stat_t* losses, T* dlogits, stat_t* max, stat_t* sumexp, stat_t* target_logit,          \
      const T* logits, const int* targets, int N, int Vp, int V, double dloss),                                  \
    (losses, dlogits, max, sumexp, target_logit, logits, targets, N, Vp, V, dloss))                              \
  X(adamw_update_chunks, (T* param, adamw_state_t<T>* master, const T* grad, adamw_state_t<T>* m,              \
      adamw_state_t<T>* v, const AdamWChunk* chunks, std::size_t count, const AdamWStep* step, double beta1,     \
      double beta2, double eps, double weight_decay, GradClip clip),                                             \
    (param, master, grad, m, v, chunks, count, step, beta1, beta2, eps, weight_decay, clip))                     \
  X(sum_of_squares_chunks, (double* out, double* partials, const T* base, const SquaresChunk* chunks,           \
      std::size_t count),                                                                                        \
    (out, partials, base, chunks, count))                                                                        \
  X(add_scalar, (double* into, const double* x), (into, x))                                                      \
  X(scale, (T* g, std::size_t n, double factor), (g, n, factor))                                                 \
  X(to_fp32, (float* dst, const T* src, std::size_t n), (dst, src, n))                                           \
  X(from_acc, (T* dst, const stat_t* src, std::size_t n), (dst, src, n))                                         \
  X(add_acc, (stat_t* into, const stat_t* x, std::size_t n), (into, x, n))                                       \
  X(scale_acc, (stat_t* out, const stat_t* x, std::size_t n, double factor), (out, x, n, factor))                 \
  X(router_scores, (stat_t* scores, const T* logits, int N, int E, bool sigmoid),                                \
    (scores, logits, N, E, sigmoid))                                                                             \
  X(router_topk, (int* expert, stat_t* gate, const stat_t* scores, const float* bias, int N, int E, int k,       \
      bool renormalize),                                                                                         \
    (expert, gate, scores, bias, N, E, k, renormalize))                                                          \
  X(gather_rows, (T* out, const T* x, const int* index, int rows, int C), (out, x, index, rows, C))              \
  X(moe_combine, (T* out, const T* y, const int* pos, const stat_t* gate, int N, int k, int C),                  \
    (out, y, pos, gate, N, k, C))                                                                                \
  X(moe_combine_backward, (T* dy, stat_t* dgate, const T* dout, const T* y, const int* pos, const stat_t* gate,  \
      int N, int k, int C),                                                                                      \
    (dy, dgate, dout, y, pos, gate, N, k, C))                                                                    \
  X(moe_dispatch_backward, (T* dx, const T* dxp, const int* pos, int N, int k, int C), (dx, dxp, pos, N, k, C))  \
  X(router_backward, (T* dlogits, const stat_t* dgate, const stat_t* scores, const int* expert,                  \
      const stat_t* gate, const stat_t* daux, int N, int E, int k, bool renormalize, bool sigmoid),              \
    (dlogits, dgate, scores, expert, gate, daux, N, E, k, renormalize, sigmoid))                                 \
  X(router_score_sums, (stat_t* sums, const stat_t* scores, int N, int E), (sums, scores, N, E))            \
  X(expert_bias_step, (float* bias, const stat_t* loads, int blocks, int E, double rate,                         \
      const double* skip_if_non_finite),                                                                         \
    (bias, loads, blocks, E, rate, skip_if_non_finite))
