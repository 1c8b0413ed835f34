#pragma once
// What a model tells its trainer while it runs, unit by unit. A unit is a contiguous range of
// the flat parameter buffer, [layout::unit_begin(u), layout::unit_begin(u + 1)); for a GPT:
// 0 = embeddings, 1..L = layers, L+1 = ln_f (and lm_head).
//
//   before_forward(u)   forward is about to read unit u's parameters
//   after_forward(u)    forward is done with them
//   before_backward(u)  backward is about to read unit u's parameters or write its gradients
//   after_backward(u)   unit u's gradients are final for this backward, and backward needs
//                       its parameters no more
//
// A backward split in two (backward_input, then backward_weight: the zero-bubble schedules'
// I and W) calls before_backward(u) and after_input_grad(u) around each unit in the first
// (it reads the parameters and writes no gradient), then before_weight_grad(u) and
// after_backward(u) around each unit in the second (it writes the gradients and reads no
// parameter):
//
//   after_input_grad(u)    the input half is done with unit u's parameters
//   before_weight_grad(u)  the weight half is about to write unit u's gradients
//
// A data-parallel trainer reduces a unit's gradient buckets at after_backward (so the
// reductions run while the rest of backward does), and ZeRO-3 gathers a unit's parameters
// at before_* and frees them at after_*. Calls come in execution order; before_* may repeat
// for a unit that is already in use (a tied head reads the embedding's unit 0 again), and the
// trainer treats a repeat as a no-op. On Cuda the kernels before a hook are queued, not
// done: the callee orders its work after the compute stream's, as the NCCL communicator does.

#include <functional>

namespace fived {

struct UnitHooks {
  std::function<void(int unit)> before_forward, after_forward, before_backward, after_backward;
  std::function<void(int unit)> after_input_grad, before_weight_grad;  // a split backward's (above)
};

namespace detail {
inline void call(const std::function<void(int)>& hook, int unit) {
  if (hook) hook(unit);
}
}  // namespace detail

}  // namespace fived
