#pragma once
// AdamW with fp32 master weights, contract of fived/kernels/host/adamw.hpp:
//   adamw_update(s, param, master, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step)
// Decoupled weight decay (master -= lr*wd*master), then the Adam step with
// bias correction (step counts from 1); param = T(master). With master ==
// nullptr the update is done on param itself (float only). Elementwise.

#include <cmath>
#include <cstddef>
#include <string>

#include <fived/kernels/cuda/common.hpp>

namespace fived::kernels::cuda {

namespace detail {

template <class T>
__global__ void adamw_kernel(T* param, float* master, const T* grad, float* m, float* v, std::size_t n, float lr,
                             float beta1, float beta2, float one_beta1, float one_beta2, float eps, float weight_decay,
                             float bc1, float bc2) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float g = to_float(grad[i]);
    float w = master != nullptr ? master[i] : to_float(param[i]);
    w -= lr * weight_decay * w;
    const float mi = beta1 * m[i] + one_beta1 * g;
    const float vi = beta2 * v[i] + one_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    w -= lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
    if (master != nullptr) master[i] = w;
    param[i] = from_float<T>(w);
  }
}

}  // namespace detail

template <class T>
void adamw_update(cudaStream_t stream, T* param, float* master, const T* grad, float* m, float* v, std::size_t n,
                  double lr, double beta1, double beta2, double eps, double weight_decay, int step) {
  static_assert(is_element_v<T>, "adamw_update: element type must be float or fived::bf16");
  detail::require(step >= 1, "adamw_update", "step counts from 1 (got " + std::to_string(step) + ")");
  if constexpr (!std::is_same_v<T, float>)
    detail::require(master != nullptr, "adamw_update", "bf16 parameters need fp32 master weights (master is null)");
  if (n == 0) return;
  // In double, rounded once to float (the state's precision), as the host reference.
  auto f = [](double x) { return static_cast<float>(x); };
  detail::adamw_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(
      dev(param), master, dev(grad), m, v, n, f(lr), f(beta1), f(beta2), f(1 - beta1), f(1 - beta2), f(eps),
      f(weight_decay), f(1 - std::pow(beta1, step)), f(1 - std::pow(beta2, step)));
  FIVED_CUDA_CHECK_LAUNCH("adamw_kernel");
}

}  // namespace fived::kernels::cuda
