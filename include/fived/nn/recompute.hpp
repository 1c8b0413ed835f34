#pragma once
// Activation recomputation: what a GPT keeps from forward for backward, and what it computes
// again. Chosen per model by a type in its configuration:
//
//   struct cfg : fived::gpt_config { using recompute = fived::SelectiveRecompute; };
//
//   NoRecompute         every activation of every block is kept per micro-batch slot.
//   SelectiveRecompute  attention's inner activations (the core attention's output and its
//                       log-sum-exp, [N, C/TP] and [N, heads/TP]) are not kept: backward runs
//                       the core attention forward again from the kept q|k|v (under context
//                       parallelism that is the ring again). Megatron's "selective".
//   FullRecompute       only each block's input is kept; backward runs the whole block's
//                       forward again (its collectives included) into one set of buffers
//                       shared by every block and slot, then its backward. Megatron's "full"
//                       with one block per recomputed unit.
//
// None of them changes a value: the recomputed forward is the same arithmetic on the same
// inputs, so losses and gradients are bit for bit those of NoRecompute (tests/test_recompute).
// What each saves is in the planner (plan/) and GPT::activation_bytes.

#include <concepts>

namespace fived {

struct NoRecompute {
  static constexpr bool attention_core = false, whole_block = false;
  static constexpr const char* name = "none";
};
struct SelectiveRecompute {
  static constexpr bool attention_core = true, whole_block = false;
  static constexpr const char* name = "selective";
};
struct FullRecompute {
  static constexpr bool attention_core = false, whole_block = true;  // the block recomputes its attention too
  static constexpr const char* name = "full";
};

template <class R>
concept RecomputePolicy = requires {
  { R::attention_core } -> std::convertible_to<bool>;
  { R::whole_block } -> std::convertible_to<bool>;
};

}  // namespace fived
