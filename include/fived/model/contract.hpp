#pragma once
// The model contract: what a model type declares so that the Trainer, DataParallel, the
// pipeline executor and checkpoints can drive it on any mesh without knowing what it is.
// docs/model.md is the prose version; fived::GPT (nn/gpt.hpp) is the model written against it.
//
// Two levels:
//   ModelType<M>   facts read from the type alone. The Trainer reads them from the whole
//                  model's type (on a PP mesh never built: each rank builds its parts).
//   ModelPart<M>   what one rank's object does in a step: its flat buffers, forward and
//                  backward of a micro-batch in a slot (with the UnitHooks DataParallel uses
//                  to reduce and gather as units finish), and, for a part that neither
//                  starts nor ends the model, the stream it receives and hands on.
//
// check_model<M> states each requirement as its own static_assert, so a model that misses
// one fails to compile with a sentence naming it (fived::Trainer checks every model it is
// given; tests/compile_fail/model_without_part.cpp).

#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "fived/model/layers.hpp"
#include "fived/model/unit_hooks.hpp"
#include "fived/optim/flat_range.hpp"

namespace fived {

template <class M>
concept ModelType = requires(int T) {
  typename M::mesh;
  typename M::value_type;
  typename M::device;
  typename M::ops_type;
  typename M::init_type;
  typename M::layout;         // this rank's parameter table (nn/param_table.hpp)
  typename M::serial_layout;  // the same tensors whole, at TP 1: files, checkpoints, gathers
  typename M::template part<Layers<0, 1>>;
  { M::layers } -> std::convertible_to<int>;
  { M::has_embedding } -> std::convertible_to<bool>;
  { M::has_head } -> std::convertible_to<bool>;
  { M::block_flops() } -> std::convertible_to<double>;
  { M::embedding_flops() } -> std::convertible_to<double>;
  { M::head_flops() } -> std::convertible_to<double>;
  { M::flops_per_token(T) } -> std::convertible_to<double>;
  { M::config_name() } -> std::convertible_to<std::string>;
};

template <class M>
concept ModelPart = ModelType<M> && requires(M& m, const M& cm, const int* ids, const UnitHooks& h, FlatRange r,
                                             std::span<double> s, int k) {
  { m.ops() } -> std::same_as<typename M::ops_type&>;
  { m.params() } -> std::convertible_to<std::span<typename M::value_type>>;
  { m.grads() } -> std::convertible_to<std::span<typename M::value_type>>;
  m.zero_grad();
  m.set_slots(k);
  m.enqueue_forward(ids, ids, k, k, h, k);
  m.backward(h, k);
  { cm.loss(k) } -> std::convertible_to<double>;
  { cm.norm_parts(r) } -> std::convertible_to<std::vector<FlatRange>>;
  m.sum_over_tp(s);
  { m.params_to_host() } -> std::convertible_to<std::vector<typename M::value_type>>;
  { m.gather_params() } -> std::convertible_to<std::vector<typename M::value_type>>;
  { M::local_length(k) } -> std::convertible_to<int>;
  { M::boundary_size(k, k) } -> std::convertible_to<std::size_t>;
} && (M::has_embedding || requires(M& m, int k) {
  { m.input(k, k, k) } -> std::convertible_to<typename M::value_type*>;
  { m.input_grad() } -> std::convertible_to<const typename M::value_type*>;
}) && (M::has_head || requires(M& m, int k) {
  { m.output(k) } -> std::convertible_to<const typename M::value_type*>;
  { m.output_grad(k, k) } -> std::convertible_to<typename M::value_type*>;
}) && (!M::has_head || requires(M& m, int k) { m.add_to_loss_sum(k); });

// Each requirement of ModelType as a sentence (instantiate to check; `ok` is then true).
template <class M>
struct check_model {
  static_assert(requires { typename M::mesh; typename M::value_type; typename M::device; typename M::ops_type; },
                "fived model contract: the model type declares `mesh`, `value_type`, `device` and `ops_type` (its "
                "Ops<T, Device>)");
  static_assert(requires { typename M::init_type; },
                "fived model contract: the model type declares `init_type`, what its constructor takes to "
                "initialise the weights (GPT: GptInit)");
  static_assert(requires { typename M::layout; typename M::serial_layout; },
                "fived model contract: the model type declares `layout` (this rank's parameter table) and "
                "`serial_layout` (the whole tensors at TP 1): ParamTable<Specs, TP> and ParamTable<Specs, 1>");
  static_assert(requires { typename M::template part<Layers<0, 1>>; },
                "fived model contract: the model type declares `template <class P> using part = ...`, the same model "
                "holding the layers P (Layers<first, count>: a pipeline stage; AllLayers: the whole model)");
  static_assert(requires { { M::layers } -> std::convertible_to<int>; { M::has_embedding } -> std::convertible_to<bool>; { M::has_head } -> std::convertible_to<bool>; },
                "fived model contract: the model type declares `static constexpr int layers` (the blocks pipeline "
                "stages cut) and `has_embedding`, `has_head` (whether this part starts or ends the model)");
  static_assert(requires(int T) {
    { M::block_flops() } -> std::convertible_to<double>;
    { M::embedding_flops() } -> std::convertible_to<double>;
    { M::head_flops() } -> std::convertible_to<double>;
    { M::flops_per_token(T) } -> std::convertible_to<double>;
  },
                "fived model contract: the model type declares `static constexpr double block_flops()`, "
                "`embedding_flops()`, `head_flops()` (forward matmul FLOPs per token, to balance pipeline stages) "
                "and `flops_per_token(int T)` (a training step's, for MFU)");
  static_assert(requires { { M::config_name() } -> std::convertible_to<std::string>; },
                "fived model contract: the model type declares `static std::string config_name()`, its "
                "configuration's name, the same on every mesh and part: a checkpoint records it and checks it when "
                "loaded");
  static constexpr bool ok = ModelType<M>;
};

}  // namespace fived
