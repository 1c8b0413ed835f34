#pragma once
// Verdict: what a schedule's proof says, the first property that fails and
// where. The properties, in the order verify() (verify.hpp) checks them, are
// listed there; each has its sentence (sentences.hpp).

#include <string_view>

#include "fived/pipeline/sentences.hpp"

namespace fived::pipeline {

enum class Property : unsigned char {
  none,  // nothing failed
  shape,
  well_formed,
  one_forward_each,
  one_backward_each,
  forward_before_backward,
  input_grad_before_weight_grad,
  peers_are_neighbours,
  one_send_each,
  one_receive_each,
  sends_after_compute,
  forward_after_input,
  backward_after_gradient,
  sends_match_receives,
  no_crossed_sends,
  progresses,
};

constexpr std::string_view describe(Property p) {
  switch (p) {
    case Property::none: return "fived::pipeline: the schedule is proven";
    case Property::shape: return FIVED_PIPELINE_SAYS_SHAPE;
    case Property::well_formed: return FIVED_PIPELINE_SAYS_WELL_FORMED;
    case Property::one_forward_each: return FIVED_PIPELINE_SAYS_ONE_FORWARD_EACH;
    case Property::one_backward_each: return FIVED_PIPELINE_SAYS_ONE_BACKWARD_EACH;
    case Property::forward_before_backward: return FIVED_PIPELINE_SAYS_FORWARD_BEFORE_BACKWARD;
    case Property::input_grad_before_weight_grad: return FIVED_PIPELINE_SAYS_INPUT_GRAD_BEFORE_WEIGHT_GRAD;
    case Property::peers_are_neighbours: return FIVED_PIPELINE_SAYS_PEERS_ARE_NEIGHBOURS;
    case Property::one_send_each: return FIVED_PIPELINE_SAYS_ONE_SEND_EACH;
    case Property::one_receive_each: return FIVED_PIPELINE_SAYS_ONE_RECEIVE_EACH;
    case Property::sends_after_compute: return FIVED_PIPELINE_SAYS_SENDS_AFTER_COMPUTE;
    case Property::forward_after_input: return FIVED_PIPELINE_SAYS_FORWARD_AFTER_INPUT;
    case Property::backward_after_gradient: return FIVED_PIPELINE_SAYS_BACKWARD_AFTER_GRADIENT;
    case Property::sends_match_receives: return FIVED_PIPELINE_SAYS_SENDS_MATCH_RECEIVES;
    case Property::no_crossed_sends: return FIVED_PIPELINE_SAYS_NO_CROSSED_SENDS;
    case Property::progresses: return FIVED_PIPELINE_SAYS_PROGRESSES;
  }
  return "?";
}

struct Verdict {
  Property failed = Property::none;
  int rank = -1, position = -1, mb = -1, chunk = -1;  // where it first fails
  constexpr bool ok() const { return failed == Property::none; }
};

namespace detail {

// A proof's passes record each property's first failure in the order verify()
// promises (actions in program order, slots in rank, chunk, micro-batch order);
// the earliest property wins.
struct Findings {
  Verdict first;  // the earliest property found failing so far, and where

  // Whether a failure of `p` could still be the one reported.
  constexpr bool open(Property p) const { return first.ok() || p < first.failed; }
  constexpr void found(Property p, int rank, int position, int mb, int chunk) {
    if (open(p)) first = {p, rank, position, mb, chunk};
  }
};

}  // namespace detail

}  // namespace fived::pipeline
