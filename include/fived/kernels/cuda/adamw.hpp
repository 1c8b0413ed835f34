#pragma once
// AdamW with fp32 master weights, contract of fived/kernels/host/adamw.hpp:
//   adamw_update(s, param, master, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step[, grad_scale])
//   adamw_update_chunks(s, param, master, grad, m, v, chunks, count, step, beta1, beta2, eps, weight_decay,
//                       clip)   chunks and step (AdamWStep: the learning rate and bias corrections)
//                       in device memory: one launch, a block per chunk, its arguments the same
//                       at every step; the clip factor computed by each thread from the squared
//                       norm in device memory, and with clip.skip_non_finite a norm that is not
//                       finite makes every block leave at once (nothing written)
// Decoupled weight decay (master -= lr*wd*master), then the Adam step with
// bias correction (step counts from 1) on grad * grad_scale; param = T(master). With
// master == nullptr the update is done on param itself (float only). Elementwise.

#include <cmath>
#include <cstddef>
#include <string>

#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/host/adamw.hpp>  // AdamWChunk

namespace fived::kernels::cuda {

namespace detail {

// A step's scalars, in double on the host and rounded once to float (the state's precision),
// as the host reference does.
struct AdamWScalars {
  float lr, beta1, beta2, one_beta1, one_beta2, eps, weight_decay, bc1, bc2, grad_scale;
};

// (Host and device: adamw_chunks_kernel takes the step's part from device memory.)
__host__ __device__ inline AdamWScalars adamw_scalars(const AdamWStep& step, double beta1, double beta2, double eps,
                                                      double weight_decay, double grad_scale) {
  auto f = [](double x) { return static_cast<float>(x); };
  return {f(step.lr),    f(beta1),  f(beta2),
          f(1 - beta1),  f(1 - beta2), f(eps),
          f(weight_decay), f(step.bias_correction1), f(step.bias_correction2),
          f(grad_scale)};
}

template <class T>
__device__ __forceinline__ void adamw_element(std::size_t i, T* param, float* master, const T* grad, float* m,
                                              float* v, const AdamWScalars& s, float weight_decay) {
  const float g = to_float(grad[i]) * s.grad_scale;
  float w = master != nullptr ? master[i] : to_float(param[i]);
  w -= s.lr * weight_decay * w;
  const float mi = s.beta1 * m[i] + s.one_beta1 * g;
  const float vi = s.beta2 * v[i] + s.one_beta2 * g * g;
  m[i] = mi;
  v[i] = vi;
  w -= s.lr * (mi / s.bc1) / (sqrtf(vi / s.bc2) + s.eps);
  if (master != nullptr) master[i] = w;
  param[i] = from_float<T>(w);
}

template <class T>
__global__ void adamw_kernel(T* param, float* master, const T* grad, float* m, float* v, std::size_t n,
                             AdamWScalars s) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    adamw_element(i, param, master, grad, m, v, s, s.weight_decay);
}

// kernels/host/adamw.hpp's grad_scale of a GradClip: computed in double from the norm the
// step left in device memory and rounded once to float, as adamw_scalars rounds a host one.
__device__ __forceinline__ float clip_scale_of(const GradClip& clip) {
  if (clip.sum_of_squares == nullptr || clip.max_norm <= 0) return 1.0f;
  const double f = clip.max_norm / (sqrt(*clip.sum_of_squares) + 1e-6);
  return static_cast<float>(f < 1.0 ? f : 1.0);
}

// Block b updates chunk b, with its tensor's decay or none: a whole range of many tensors in
// one launch, where a launch per tensor spent more time starting than updating the small ones.
template <class T>
__global__ void adamw_chunks_kernel(T* __restrict__ param, float* __restrict__ master, const T* __restrict__ grad,
                                    float* __restrict__ m, float* __restrict__ v, const AdamWChunk* chunks,
                                    const AdamWStep* step, double beta1, double beta2, double eps,
                                    double weight_decay, GradClip clip) {
  // A skipped step (GradClip::skip_non_finite): every block reads the same norm and leaves.
  if (clip.skip_non_finite && clip.sum_of_squares != nullptr && !isfinite(*clip.sum_of_squares)) return;
  AdamWScalars s = adamw_scalars(*step, beta1, beta2, eps, weight_decay, 1.0);
  s.grad_scale = clip_scale_of(clip);
  const AdamWChunk c = chunks[blockIdx.x];
  const float decay = c.decays ? s.weight_decay : 0.0f;
  for (std::size_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x)
    adamw_element(i, param + c.param, master, grad + c.grad, m, v, s, decay);
}

template <class T>
void check_adamw(const char* fn, const float* master) {
  static_assert(is_element_v<T>, "adamw_update: element type must be float or fived::bf16");
  if constexpr (!std::is_same_v<T, float>)
    require(master != nullptr, fn, "bf16 parameters need fp32 master weights (master is null)");
}

}  // namespace detail

template <class T>
void adamw_update(cudaStream_t stream, T* param, float* master, const T* grad, float* m, float* v, std::size_t n,
                  double lr, double beta1, double beta2, double eps, double weight_decay, int step,
                  double grad_scale = 1.0) {
  detail::check_adamw<T>("adamw_update", master);
  const AdamWStep at = AdamWStep::at(step, lr, beta1, beta2);  // throws for step < 1
  if (n == 0) return;
  detail::adamw_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(
      dev(param), master, dev(grad), m, v, n, detail::adamw_scalars(at, beta1, beta2, eps, weight_decay, grad_scale));
  FIVED_CUDA_CHECK_LAUNCH("adamw_kernel");
}

template <class T>
void adamw_update_chunks(cudaStream_t stream, T* param, float* master, const T* grad, float* m, float* v,
                         const AdamWChunk* chunks, std::size_t count, const AdamWStep* step, double beta1,
                         double beta2, double eps, double weight_decay, GradClip clip) {
  detail::check_adamw<T>("adamw_update_chunks", master);
  if (count == 0) return;
  detail::require(count <= 0x7fffffffu, "adamw_update_chunks", "more chunks than a grid has blocks");
  detail::require(step != nullptr, "adamw_update_chunks", "the step's learning rate and bias corrections are null");
  detail::adamw_chunks_kernel<<<static_cast<unsigned>(count), 256, 0, stream>>>(
      dev(param), master, dev(grad), m, v, chunks, step, beta1, beta2, eps, weight_decay, clip);
  FIVED_CUDA_CHECK_LAUNCH("adamw_chunks_kernel");
}

}  // namespace fived::kernels::cuda
