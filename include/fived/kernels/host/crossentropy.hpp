#pragma once
// Host fused softmax cross-entropy, ready for a vocabulary split over tensor-parallel
// ranks (Megatron's vocab-parallel loss).
//
// logits are [N, Vs]: columns [offset, offset+Vs) of the padded vocabulary. A column
// whose global index is >= V (padding up to a multiple of TP, or of 64/128 for
// speed) never counts: it acts as -inf, it never wins the max, contributes nothing
// to the sum and gets dlogits 0. targets are global ids in [0, V).
//
// Three steps, so the vocab-parallel caller needs only three all-reduces of [N]:
//   1. logits_max:            local max over valid columns (-inf if there is none);
//                             all-reduce(max) -> global max m.
//   2. crossentropy_partials: sumexp = sum_valid exp(logit - m), target_logit = the
//                             target's logit if it lies in this shard, else 0;
//                             all-reduce(sum) both.
//   3. crossentropy_backward: loss_i = log(sumexp_i) + m_i - target_logit_i and
//                             dlogits = dloss * (softmax - onehot) on valid columns,
//                             0 on padding. dlogits may alias logits: each element is
//                             read before it is written, so the probabilities are
//                             never stored next to the logits.
// crossentropy_forward_backward is the single-shard convenience (offset 0, Vs = Vp), and
// crossentropy_fused the same that also leaves max, sumexp and target_logit (the statistics
// mean_loss reads; any output may be null): one kernel on CUDA, for a model whose vocabulary
// is not split.
// losses are acc_t<T> and dloss (1/N for a mean) arrives in double, rounded once to acc_t<T>:
// a double model's loss gradient is exact to a double's precision.
// losses or dlogits may be nullptr to skip that output (e.g. evaluation only).

#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

namespace detail_ce {
inline void check_sizes(const char* what, int N, int Vs, int offset, int V) {
  if (N < 0 || Vs < 0 || offset < 0 || V <= 0)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what +
                                ": needs N >= 0, Vs >= 0, offset >= 0 and a vocabulary V >= 1 (got N=" +
                                std::to_string(N) + ", Vs=" + std::to_string(Vs) + ", offset=" + std::to_string(offset) +
                                ", V=" + std::to_string(V) + ")");
}
inline void check_target(const char* what, int target, int row, int V) {
  if (target < 0 || target >= V)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what + ": target " + std::to_string(target) +
                                " of row " + std::to_string(row) + " is outside the vocabulary [0, " +
                                std::to_string(V) + ")");
}
// Number of local columns whose global index is < V.
inline std::size_t valid_columns(int Vs, int offset, int V) {
  if (offset >= V) return 0;
  const long long n = static_cast<long long>(V) - offset;
  return static_cast<std::size_t>(n < Vs ? n : Vs);
}
}  // namespace detail_ce

template <class T>
void logits_max(acc_t<T>* max, const T* logits, int N, int Vs, int offset, int V) {
  using A = acc_t<T>;
  detail_ce::check_sizes("logits_max", N, Vs, offset, V);
  const std::size_t nv = detail_ce::valid_columns(Vs, offset, V), sVs = static_cast<std::size_t>(Vs);
  for (std::size_t i = 0; i < static_cast<std::size_t>(N); ++i) {
    const T* row = logits + i * sVs;
    A m = -std::numeric_limits<A>::infinity();
    for (std::size_t j = 0; j < nv; ++j) {
      const A x = static_cast<A>(row[j]);
      if (x > m) m = x;
    }
    max[i] = m;
  }
}

template <class T>
void crossentropy_partials(acc_t<T>* sumexp, acc_t<T>* target_logit, const T* logits, const int* targets,
                           const acc_t<T>* max, int N, int Vs, int offset, int V) {
  using A = acc_t<T>;
  detail_ce::check_sizes("crossentropy_partials", N, Vs, offset, V);
  const std::size_t nv = detail_ce::valid_columns(Vs, offset, V), sVs = static_cast<std::size_t>(Vs);
  for (std::size_t i = 0; i < static_cast<std::size_t>(N); ++i) {
    const int tgt = targets[i];
    detail_ce::check_target("crossentropy_partials", tgt, static_cast<int>(i), V);
    const T* row = logits + i * sVs;
    const A m = max[i];
    A s = 0;
    for (std::size_t j = 0; j < nv; ++j) s += std::exp(static_cast<A>(row[j]) - m);
    sumexp[i] = s;
    const long long local = static_cast<long long>(tgt) - offset;
    target_logit[i] = (local >= 0 && local < Vs) ? static_cast<A>(row[local]) : A(0);
  }
}

template <class T>
void crossentropy_backward(acc_t<T>* losses, T* dlogits, const T* logits, const int* targets, const acc_t<T>* max,
                           const acc_t<T>* sumexp, const acc_t<T>* target_logit, int N, int Vs, int offset, int V,
                           double dloss) {
  using A = acc_t<T>;
  detail_ce::check_sizes("crossentropy_backward", N, Vs, offset, V);
  const std::size_t nv = detail_ce::valid_columns(Vs, offset, V), sVs = static_cast<std::size_t>(Vs);
  for (std::size_t i = 0; i < static_cast<std::size_t>(N); ++i) {
    const int tgt = targets[i];
    detail_ce::check_target("crossentropy_backward", tgt, static_cast<int>(i), V);
    const A m = max[i], s = sumexp[i];
    if (losses != nullptr) losses[i] = std::log(s) + m - target_logit[i];
    if (dlogits == nullptr) continue;
    const T* row = logits + i * sVs;
    T* drow = dlogits + i * sVs;
    const A inv = static_cast<A>(1) / s;
    const A dl = static_cast<A>(dloss);
    const long long local = static_cast<long long>(tgt) - offset;
    for (std::size_t j = 0; j < nv; ++j) {
      const A p = std::exp(static_cast<A>(row[j]) - m) * inv;  // read before the (possibly aliased) write
      const A onehot = (static_cast<long long>(j) == local) ? A(1) : A(0);
      drow[j] = static_cast<T>(dl * (p - onehot));
    }
    for (std::size_t j = nv; j < sVs; ++j) drow[j] = static_cast<T>(A(0));
  }
}

template <class T>
void crossentropy_fused(acc_t<T>* losses, T* dlogits, acc_t<T>* max, acc_t<T>* sumexp, acc_t<T>* target_logit,
                        const T* logits, const int* targets, int N, int Vp, int V, double dloss) {
  using A = acc_t<T>;
  detail_ce::check_sizes("crossentropy_fused", N, Vp, 0, V);
  if (Vp < V)
    throw std::invalid_argument("fived::kernels::host::crossentropy_fused: the padded vocabulary Vp=" +
                                std::to_string(Vp) + " is smaller than the vocabulary V=" + std::to_string(V));
  const std::size_t sN = static_cast<std::size_t>(N);
  std::vector<A> m(max == nullptr ? sN : 0), s(sumexp == nullptr ? sN : 0), tl(target_logit == nullptr ? sN : 0);
  A* mx = max != nullptr ? max : m.data();
  A* se = sumexp != nullptr ? sumexp : s.data();
  A* tg = target_logit != nullptr ? target_logit : tl.data();
  logits_max(mx, logits, N, Vp, 0, V);
  crossentropy_partials(se, tg, logits, targets, mx, N, Vp, 0, V);
  crossentropy_backward(losses, dlogits, logits, targets, mx, se, tg, N, Vp, 0, V, dloss);
}

template <class T>
void crossentropy_forward_backward(acc_t<T>* losses, T* dlogits, const T* logits, const int* targets, int N, int Vp,
                                   int V, double dloss) {
  crossentropy_fused(losses, dlogits, static_cast<acc_t<T>*>(nullptr), static_cast<acc_t<T>*>(nullptr),
                     static_cast<acc_t<T>*>(nullptr), logits, targets, N, Vp, V, dloss);
}

// The sum over rows of log(sumexp[i]) + max[i] - target[i] (the loss from the three
// statistics), in double; mean_loss divides it by the rows.
template <class A>
double loss_sum(const A* max, const A* sumexp, const A* target, int N) {
  double sum = 0;
  for (std::size_t i = 0; i < static_cast<std::size_t>(N); ++i)
    sum += std::log(static_cast<double>(sumexp[i])) + static_cast<double>(max[i]) - static_cast<double>(target[i]);
  return sum;
}
template <class A>
double mean_loss(const A* max, const A* sumexp, const A* target, int N) {
  return N > 0 ? loss_sum(max, sumexp, target, N) / static_cast<double>(N) : 0.0;
}

}  // namespace fived::kernels::host
