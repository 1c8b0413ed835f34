#pragma once
// Action: one step of a pipeline rank's program.
//
// A pipeline schedule is, for every rank, an ordered list of actions. Compute
// actions run one model chunk on one micro-batch: F (forward), B (the full
// backward), or the backward split in two as in the zero-bubble schedules:
// I, the gradient with respect to the chunk's input (what the previous stage
// waits for), and W, the gradient with respect to its weights (which nobody
// waits for, so it can be moved into a bubble). Comm actions move a
// micro-batch's activations to the next virtual stage or its gradient back to
// the previous one, and name the rank on the other end.
//
// Comm actions that must be issued together are marked: an action with
// `joins_previous` (written `.with_previous()`) belongs to the same NCCL group
// (ncclGroupStart/End) as the action before it. Blocking point-to-point needs
// this: two ranks that each send to the other before receiving wait for each
// other forever, unless the send and the receive are one group.
//
// By hand (names from fived::pipeline::notation):
//   F(0), send_act(0, /*to=*/1), F(1), send_act(1, 1), recv_grad(0, /*from=*/1).with_previous(), B(0)

#include <cstdint>

namespace fived::pipeline {

enum class Op : std::uint8_t {
  none,         // an empty slot: past the end of a program
  forward,      // F
  backward,     // B = I + W
  input_grad,   // I: gradient of the chunk's input, sent to the previous stage
  weight_grad,  // W: gradient of the chunk's weights, needed by nobody downstream
  send_act,     // this chunk's output activations, to the rank of the next virtual stage
  recv_act,     // this chunk's input activations, from the rank of the previous virtual stage
  send_grad,    // the gradient of this chunk's input, to the rank of the previous virtual stage
  recv_grad,    // the gradient of this chunk's output, from the rank of the next virtual stage
};

constexpr bool is_compute(Op op) { return op >= Op::forward && op <= Op::weight_grad; }
constexpr bool is_comm(Op op) { return op >= Op::send_act && op <= Op::recv_grad; }
constexpr bool is_send(Op op) { return op == Op::send_act || op == Op::send_grad; }
constexpr bool is_recv(Op op) { return op == Op::recv_act || op == Op::recv_grad; }
// B or I: the part of the backward that produces the gradient the previous stage waits for.
constexpr bool makes_input_grad(Op op) { return op == Op::backward || op == Op::input_grad; }

// F, B, I, W for compute; s, r (activations) and S, R (gradients) for comm.
constexpr char op_letter(Op op) {
  constexpr char letters[] = "-FBIWsrSR";
  return letters[static_cast<int>(op)];
}

constexpr const char* op_name(Op op) {
  switch (op) {
    case Op::none: return "none";
    case Op::forward: return "F";
    case Op::backward: return "B";
    case Op::input_grad: return "I";
    case Op::weight_grad: return "W";
    case Op::send_act: return "send_act";
    case Op::recv_act: return "recv_act";
    case Op::send_grad: return "send_grad";
    case Op::recv_grad: return "recv_grad";
  }
  return "?";
}

struct Action {
  Op op = Op::none;
  bool joins_previous = false;  // comm only: issued in one NCCL group with the action before it
  int mb = 0;                   // micro-batch
  int chunk = 0;                // model chunk of this rank (0 .. V-1)
  int peer = -1;                // comm only: the rank on the other end

  // The same comm action, issued in one NCCL group with the action before it.
  constexpr Action with_previous() const {
    Action a = *this;
    a.joins_previous = true;
    return a;
  }
  friend constexpr bool operator==(const Action&, const Action&) = default;
};

constexpr Action forward(int mb, int chunk = 0) { return {Op::forward, false, mb, chunk, -1}; }
constexpr Action backward(int mb, int chunk = 0) { return {Op::backward, false, mb, chunk, -1}; }
constexpr Action input_grad(int mb, int chunk = 0) { return {Op::input_grad, false, mb, chunk, -1}; }
constexpr Action weight_grad(int mb, int chunk = 0) { return {Op::weight_grad, false, mb, chunk, -1}; }
constexpr Action send_act(int mb, int to, int chunk = 0) { return {Op::send_act, false, mb, chunk, to}; }
constexpr Action recv_act(int mb, int from, int chunk = 0) { return {Op::recv_act, false, mb, chunk, from}; }
constexpr Action send_grad(int mb, int to, int chunk = 0) { return {Op::send_grad, false, mb, chunk, to}; }
constexpr Action recv_grad(int mb, int from, int chunk = 0) { return {Op::recv_grad, false, mb, chunk, from}; }

// The papers' letters, for tables written by hand: `using namespace fived::pipeline::notation;`.
namespace notation {
constexpr Action F(int mb, int chunk = 0) { return forward(mb, chunk); }
constexpr Action B(int mb, int chunk = 0) { return backward(mb, chunk); }
constexpr Action I(int mb, int chunk = 0) { return input_grad(mb, chunk); }
constexpr Action W(int mb, int chunk = 0) { return weight_grad(mb, chunk); }
using pipeline::recv_act;
using pipeline::recv_grad;
using pipeline::send_act;
using pipeline::send_grad;
}  // namespace notation

}  // namespace fived::pipeline
