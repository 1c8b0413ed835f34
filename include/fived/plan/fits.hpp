#pragma once
// Does a plan fit a GPU of D bytes? Two forms:
//
//   static_assert(fived::plan::fits<P>(80ull << 30));              // a bool, for any use
//   static_assert(fived::plan::fits<llama3_405b, run>(80ull << 30));
//   static_assert(fived::plan::require_fits<P, (80ull << 30)>);     // fails with a sentence
//
// require_fits fails with the sentence of the plan's largest part (parameters, gradients,
// optimizer state or activations) and what to change for it. A static_assert's message is a
// string literal, so the numbers travel in the diagnostic as the template arguments of the
// check that fails, each named: GCC prints
//
//   In instantiation of 'struct fived::plan::PlanPerGPU<false, fived::plan::Largest::optimizer,
//     fived::plan::needs_MiB<780387>, fived::plan::device_MiB<81920>,
//     fived::plan::parameters_MiB<96770>, fived::plan::gradients_MiB<96770>,
//     fived::plan::optimizer_MiB<580620>, fived::plan::activations_MiB<6228> >':
//   error: static assertion failed: the plan does not fit the device: the optimizer state is
//     its largest part ...
//
// (figures of tests/compile_fail/plan_does_not_fit.cpp). "activations" is the peak of the
// slots in flight plus the recomputation and work buffers; needs_MiB also counts ZeRO's
// staging and transient buffers. MiB are 2^20 bytes, rounded up.

#include <cstdint>

#include "fived/plan/memory.hpp"
#include "fived/plan/model.hpp"
#include "fived/plan/plan.hpp"

namespace fived::plan {

template <class P>
constexpr bool fits(Bytes device_bytes) {
  return P::memory.total() <= device_bytes;
}
template <Transformer Model, class Layout>
constexpr bool fits(Bytes device_bytes) {
  return fits<Plan<Model, Layout>>(device_bytes);
}

enum class Largest : std::uint8_t { parameters, gradients, optimizer, activations };

constexpr Bytes activation_total(const Memory& m) { return m.peak_activations + m.peak_deferred + m.recompute + m.work; }
constexpr Largest largest_part(const Memory& m) {
  const Bytes a = activation_total(m);
  if (m.optimizer >= m.parameters && m.optimizer >= m.gradients && m.optimizer >= a) return Largest::optimizer;
  if (a >= m.parameters && a >= m.gradients) return Largest::activations;
  return m.parameters >= m.gradients ? Largest::parameters : Largest::gradients;
}
constexpr Bytes mib(Bytes b) { return (b + (Bytes{1} << 20) - 1) >> 20; }

// The figures a failing require_fits shows, by name.
template <Bytes>
struct needs_MiB {};
template <Bytes>
struct device_MiB {};
template <Bytes>
struct parameters_MiB {};
template <Bytes>
struct gradients_MiB {};
template <Bytes>
struct optimizer_MiB {};
template <Bytes>
struct activations_MiB {};

template <bool Fits, Largest Part, class Needs, class Device, class Parameters, class Gradients, class Optimizer,
          class Activations>
struct PlanPerGPU {
  static_assert(Fits || Part != Largest::optimizer,
                "the plan does not fit the device: the optimizer state is its largest part (the figures in MiB are "
                "the arguments of PlanPerGPU above); shard it over the data-parallel ranks (ZeRO-1 or more, or more "
                "DP ranks), or split the model over more TP or PP ranks");
  static_assert(Fits || Part != Largest::parameters,
                "the plan does not fit the device: the parameters are its largest part (the figures in MiB are the "
                "arguments of PlanPerGPU above); shard them over the data-parallel ranks (ZeRO-3), or split the model "
                "over more TP or PP ranks");
  static_assert(Fits || Part != Largest::gradients,
                "the plan does not fit the device: the gradients are its largest part (the figures in MiB are the "
                "arguments of PlanPerGPU above); shard them over the data-parallel ranks (ZeRO-2 or 3), or split the "
                "model over more TP or PP ranks");
  static_assert(Fits || Part != Largest::activations,
                "the plan does not fit the device: the activations are its largest part (the figures in MiB are the "
                "arguments of PlanPerGPU above); recompute them (SelectiveRecompute or FullRecompute), turn on "
                "sequence parallelism, use a smaller micro-batch or a schedule with fewer micro-batches in flight, "
                "or split them over more TP, CP or PP ranks");
  static constexpr bool value = true;  // reached only when no assertion above failed
};

template <class P, Bytes DeviceBytes>
using plan_per_gpu =
    PlanPerGPU<fits<P>(DeviceBytes), largest_part(P::memory), needs_MiB<mib(P::memory.total())>,
               device_MiB<mib(DeviceBytes)>, parameters_MiB<mib(P::memory.parameters)>,
               gradients_MiB<mib(P::memory.gradients)>, optimizer_MiB<mib(P::memory.optimizer)>,
               activations_MiB<mib(activation_total(P::memory))>>;

// true, or a compile error whose sentence says which part is largest and what to change.
template <class P, Bytes DeviceBytes>
inline constexpr bool require_fits = plan_per_gpu<P, DeviceBytes>::value;

}  // namespace fived::plan
