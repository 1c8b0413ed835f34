#pragma once
// How much of the training state each rank of a data-parallel group holds
// (train/data_parallel.hpp says what each stage does and costs), the kinds of that state a
// checkpoint carries, and what a trainer asks of a model to drive it.
//
//   DataParallel<Model, ZeRO<2>> dp(model, ctx, adamw);   // NoZeRO, ZeRO<1>, ZeRO<2>, ZeRO<3>

#include <type_traits>

namespace fived {

// No optimizer sharding: gradients all-reduced, every rank holds all the optimizer state.
struct NoZeRO {
  static constexpr int stage = 0;
};
// ZeRO stage 1 (optimizer state sharded over DP), 2 (+ gradients), 3 (+ parameters).
template <int Stage>
struct ZeRO {
  static_assert(Stage >= 1 && Stage <= 3, "fived::ZeRO<S>: the ZeRO stages are 1, 2 and 3");
  static constexpr int stage = Stage;
};

// The kinds of state a training step carries over to the next (checkpoints save each).
enum class TrainState { params, master, exp_avg, exp_avg_sq };

template <class Policy>
inline constexpr bool is_zero_policy = false;
template <>
inline constexpr bool is_zero_policy<NoZeRO> = true;
template <int S>
inline constexpr bool is_zero_policy<ZeRO<S>> = true;

namespace dp_detail {
// The group a model's gradients reduce over: its own (a model's experts: the expert-data group)
// or its mesh's gradient group (DP x CP).
template <class Model>
struct reduce_group {
  using type = typename Model::mesh::grad_group;
};
template <class Model>
  requires requires { typename Model::grad_group; }
struct reduce_group<Model> {
  using type = typename Model::grad_group;
};
template <class Model>
constexpr double grad_scale() {
  if constexpr (requires { Model::grad_scale; }) return Model::grad_scale;
  else return 1.0;
}
}  // namespace dp_detail

// A model with a mixture of experts: its expert buffers (Model::Experts) get a DataParallel of
// their own over the expert-data group, driven by this one.
template <class Model>
concept HasExperts = requires(Model& m) {
  typename Model::Experts;
  requires Model::has_experts;
  m.experts();
};

// How a model is made to be trained under Policy: under ZeRO-3, which keeps a piece of each
// parameter, with its parameters left unwritten (GptInit::deferred, nn/init.hpp) for its
// DataParallel to initialise its owned pieces alone.
template <class Policy, class Init>
Init init_under(Init init) {
  if constexpr (Policy::stage == 3 && requires { init.deferred; }) init.deferred = true;
  return init;
}

}  // namespace fived
