#pragma once
// Host AdamW (decoupled weight decay, Loshchilov & Hutter), one step over n values:
//   w -= lr * weight_decay * w
//   m  = beta1 m + (1 - beta1) g
//   v  = beta2 v + (1 - beta2) g^2
//   w -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
// step counts from 1. The state S (moments, and master weights where there are any) is
// adamw_state_t<T>: double for a double model, float otherwise, and the update is computed
// in S. With master weights (master != nullptr) w is the master copy and param =
// T(master) afterwards: bf16 parameters never accumulate rounding error over steps. With
// master == nullptr the update is done on param itself; that is only allowed for T = float
// or double (a bf16 parameter without a master copy throws). The hyperparameters arrive in
// double; the bias corrections are computed in double and rounded once to S.
// Weight decay is applied to whatever tensor it is given: the caller passes
// weight_decay = 0 for biases, LayerNorm parameters and embeddings if it wants the
// GPT-2 convention. grad_scale multiplies each gradient as it is read (the clip factor of
// the global norm, rounded once to S): the same numbers as scaling the gradients first, for
// float and double, without another pass over them.
//
//   adamw_update_chunks(param, master, grad, m, v, chunks, count, step, beta1, ..., clip)
//     the same over the chunks of a range (AdamWChunk, below: elements [begin, end) of every
//     array, weight decay or none), which a device runs as one launch: an optimizer's whole
//     range in one call, each tensor with its own decay. What changes from step to step, the
//     learning rate and the bias corrections, is read from the device's memory (AdamWStep,
//     below), so that the launch is the same at every step (a step captured as a graph
//     replays it: nn/step_graph.hpp). grad_scale is the clip factor of `clip` (GradClip,
//     below), computed where the kernel runs from the global norm the step's earlier kernels
//     left in the device's memory: the host never reads the norm before the update.

#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fived/device/bf16.hpp"
#include "fived/kernels/host/norm.hpp"

namespace fived {
// The precision of AdamW's state (moments, masters) for parameters of type T.
template <class T>
using adamw_state_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// A piece of what adamw_update_chunks updates: elements [begin, end) of the state (m, v,
// master), with the weight decay or without, whose parameters and gradients are `param` and
// `grad` elements further on in theirs (0 where the three arrays line up: adamw_chunks; an
// optimizer owning pieces of many buckets finds a ZeRO rank's gradients, and under ZeRO-3
// its parameters, in buffers of pieces, and updates all of them in one launch). At most
// max_elements long, since a device gives each chunk one block (AdamW cuts its ranges so:
// optim/adamw.hpp, adamw_chunks). Short, so that a block ends soon: a launch lasts at least
// as long as its slowest block. At 32Ki elements (128 a thread) GPT-2's 68 bucket launches
// on one GPU, ~56 blocks each, took ~60 us apiece on an H200: the step was 4 ms slower than
// with the launch per tensor before them (bench/results/train-step-h200.txt).
struct AdamWChunk {
  static constexpr std::size_t max_elements = std::size_t{1} << 11;  // 8 elements a thread of 256
  std::size_t begin = 0, end = 0;
  bool decays = false;
  std::ptrdiff_t param = 0, grad = 0;
};

// A step's clip to the global gradient norm, as adamw_update_chunks reads it: each gradient
// times min(1, max_norm / (sqrt(*sum_of_squares) + 1e-6)) (kernels/host/norm.hpp,
// clip_factor), the squared norm one double in the device's memory. No clip where
// sum_of_squares is null or max_norm is 0. With skip_non_finite a squared norm that is not
// finite (a nan or inf gradient anywhere) makes the update write nothing: no parameter,
// moment or master moves (AdamWConfig::skip_non_finite).
struct GradClip {
  const double* sum_of_squares = nullptr;
  double max_norm = 0;
  bool skip_non_finite = false;
  // A step captured as a graph knows its calls by their arguments' bytes (util/call_hash.hpp):
  // the padding is spelled out and zeroed, so that no stray byte makes a replay look changed.
  char zeroed_padding_[7] = {};
};
static_assert(sizeof(GradClip) == 24, "fived::GradClip: every byte is a member (its bytes are hashed)");

// What one AdamW step changes, as adamw_update_chunks reads it from the device's memory: the
// learning rate and the bias corrections 1 - beta^step, in double (each kernel rounds them
// once to the state's precision).
struct AdamWStep {
  double lr = 0, bias_correction1 = 1, bias_correction2 = 1;

  // Step `step` (counting from 1) at learning rate lr.
  static AdamWStep at(int step, double lr, double beta1, double beta2) {
    if (step < 1) throw std::invalid_argument("fived::AdamWStep: step counts from 1 (got " + std::to_string(step) + ")");
    return {lr, 1 - std::pow(beta1, step), 1 - std::pow(beta2, step)};
  }
};
}  // namespace fived

namespace fived::kernels::host {

// One step over n values, what changes per step given as an AdamWStep.
template <class T, class S>
void adamw_update(T* param, std::type_identity_t<S>* master, const T* grad, S* m, S* v, std::size_t n,
                  const AdamWStep& step, double beta1, double beta2, double eps, double weight_decay,
                  double grad_scale = 1.0) {
  static_assert(std::is_same_v<S, adamw_state_t<T>>,
                "fived::kernels::host::adamw_update: the state must be adamw_state_t<T> (double for double parameters, "
                "float otherwise)");
  if (master == nullptr && !(std::is_same_v<T, float> || std::is_same_v<T, double>))
    throw std::invalid_argument(
        "fived::kernels::host::adamw_update: a bf16 parameter needs fp32 master weights (master is nullptr)");
  const S b1 = static_cast<S>(beta1), b2 = static_cast<S>(beta2), e = static_cast<S>(eps);
  const S wd = static_cast<S>(weight_decay), l = static_cast<S>(step.lr);
  const S one_b1 = static_cast<S>(1 - beta1), one_b2 = static_cast<S>(1 - beta2);
  const S bc1 = static_cast<S>(step.bias_correction1), bc2 = static_cast<S>(step.bias_correction2);
  const S scale = static_cast<S>(grad_scale);
  for (std::size_t i = 0; i < n; ++i) {
    const S g = static_cast<S>(grad[i]) * scale;
    m[i] = b1 * m[i] + one_b1 * g;
    v[i] = b2 * v[i] + one_b2 * g * g;
    S w = master != nullptr ? master[i] : static_cast<S>(param[i]);
    w -= l * wd * w;
    w -= l * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + e);
    if (master != nullptr) master[i] = w;
    param[i] = static_cast<T>(w);
  }
}

// ... step `step` (from 1) at learning rate lr.
template <class T, class S>
void adamw_update(T* param, std::type_identity_t<S>* master, const T* grad, S* m, S* v, std::size_t n, double lr,
                  double beta1, double beta2, double eps, double weight_decay, int step, double grad_scale = 1.0) {
  adamw_update(param, master, grad, m, v, n, AdamWStep::at(step, lr, beta1, beta2), beta1, beta2, eps, weight_decay,
               grad_scale);
}

template <class T, class S>
void adamw_update_chunks(T* param, std::type_identity_t<S>* master, const T* grad, S* m, S* v,
                         const AdamWChunk* chunks, std::size_t count, const AdamWStep* step, double beta1, double beta2,
                         double eps, double weight_decay, GradClip clip) {
  if (clip.skip_non_finite && clip.sum_of_squares != nullptr && !std::isfinite(*clip.sum_of_squares)) return;
  const double grad_scale =
      clip.sum_of_squares != nullptr && clip.max_norm > 0 ? clip_factor(*clip.sum_of_squares, clip.max_norm) : 1.0;
  for (const AdamWChunk& c : std::span<const AdamWChunk>(chunks, count))
    adamw_update(param + c.param + c.begin, master != nullptr ? master + c.begin : nullptr, grad + c.grad + c.begin,
                 m + c.begin, v + c.begin, c.end - c.begin, *step, beta1, beta2, eps, c.decays ? weight_decay : 0.0,
                 grad_scale);
}

}  // namespace fived::kernels::host
