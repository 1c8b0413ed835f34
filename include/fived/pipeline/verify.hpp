#pragma once
// verify(schedule): the proofs, as one constexpr function.
//
// Checks the properties below in order and reports the first that fails, with
// the place (rank, position in its program, micro-batch, chunk) where it first
// fails; position -1 means an action is missing. Proven<> (proven.hpp) turns
// each property into a static_assert with its own sentence (sentences.hpp).
//
//   well_formed                   micro-batch, chunk and peer in range; groups join comm actions only
//   one_forward_each              every stage (rank, chunk) runs M forwards, one per micro-batch
//   one_backward_each             ... and M backwards: one B, or one I and one W
//   forward_before_backward       F before its B or I, on the same stage
//   input_grad_before_weight_grad I before its W
//   peers_are_neighbours          a message names the rank of the neighbouring virtual stage
//   one_send_each                 activations and input gradients sent once, where the neighbour is on another rank
//   one_receive_each              ... and received once: every send has its receive
//   sends_after_compute           a send comes after the compute that produced what it sends
//   forward_after_input           F after its activations arrived (or after the previous stage's F on the same rank)
//   backward_after_gradient       B or I after its output gradient arrived (or after the next stage's B or I)
//   sends_match_receives          between two ranks, the k-th send is the k-th receive (NCCL matches in order)
//   no_crossed_sends              the dry run (dry_run.hpp) does not stop in two sends that wait for each other
//   progresses                    the dry run reaches the end of every program: no deadlock

#include <string_view>
#include <vector>

#include "fived/pipeline/dry_run.hpp"
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

// The checks, each pass linear in the table: one over the actions (their form,
// their peers, where each is: Positions, and each message's number on its
// channel), one over the (rank, chunk, micro-batch) slots (counts and orders),
// one over the receives (pairing), then the dry run. A pass records each
// property's first failure in the order verify() promises (actions in program
// order, slots in rank, chunk, micro-batch order); the earliest property wins.
struct Findings {
  Verdict first;  // the earliest property found failing so far, and where

  // Whether a failure of `p` could still be the one reported.
  constexpr bool open(Property p) const { return first.ok() || p < first.failed; }
  constexpr void found(Property p, int rank, int position, int mb, int chunk) {
    if (open(p)) first = {p, rank, position, mb, chunk};
  }
};

// Pass 1, over the actions: well_formed and peers_are_neighbours; numbers each
// send and receive by its order among those between the same two ranks.
constexpr void check_actions(const Programs& programs, Scratch<int>& numbers, Findings& f) {
  const Shape& sh = programs.shape;
  const int P = sh.ranks;
  Scratch<int> counters(2 * P);  // [sent to q | received from P + q], for one rank at a time
  for (int r = 0; r < P; ++r) {
    for (int q = 0; q < 2 * P; ++q) counters[q] = 0;
    const Action* prog = programs.begin[r];
    const int n = programs.size(r), base = programs.offset[r];
    for (int i = 0; i < n; ++i) {
      const Action& a = prog[i];
      const bool comm = is_comm(a.op);
      const bool peer_ok = a.peer >= 0 && a.peer < P && a.peer != r;
      if (a.op == Op::none || !in_range(sh, a) || (comm && !peer_ok) ||
          (a.joins_previous && !(comm && i > 0 && is_comm(prog[i - 1].op)))) {
        f.found(Property::well_formed, r, i, a.mb, a.chunk);
        continue;
      }
      if (!comm) continue;
      numbers[base + i] = counters[(is_send(a.op) ? 0 : P) + a.peer]++;
      const bool to_next = a.op == Op::send_act || a.op == Op::recv_grad;
      const bool exists = to_next ? sh.sends_forward(r, a.chunk) : sh.sends_backward(r, a.chunk);
      const int st = sh.stage(r, a.chunk);
      if (!exists || a.peer != sh.rank_of(to_next ? st + 1 : st - 1))
        f.found(Property::peers_are_neighbours, r, i, a.mb, a.chunk);
    }
  }
}

// The second `op` of a stage's micro-batch, for the report (only when there is one).
constexpr int repeat_of(const Programs& programs, const Positions& pos, Op op, int r, int c, int m) {
  const Action* prog = programs.begin[r];
  for (int i = pos.at(op, r, c, m) + 1; i < programs.size(r); ++i)
    if (prog[i].op == op && prog[i].mb == m && prog[i].chunk == c) return i;
  return -1;
}

// Pass 2, over the slots: the counts and orders of each stage's actions.
constexpr void check_slots(const Programs& programs, const Positions& pos, Findings& f) {
  const Shape& sh = programs.shape;
  // Exactly one of `op` where `needed` (or none where not): -2 when so, else the position to report.
  auto once = [&](Op op, bool needed, int r, int c, int m) {
    const int n = pos.how_many(op, r, c, m);
    if (n == (needed ? 1 : 0)) return -2;
    return n == 0 ? -1 : repeat_of(programs, pos, op, r, c, m);
  };
  for (int r = 0; r < sh.ranks; ++r)
    for (int c = 0; c < sh.chunks; ++c) {
      const int st = sh.stage(r, c);
      const bool forward_message = sh.sends_forward(r, c), backward_message = sh.sends_backward(r, c);
      for (int m = 0; m < sh.micro_batches; ++m) {
        auto report = [&](Property p, int at) {
          if (at >= -1) f.found(p, r, at, m, c);
        };
        const int F = pos.at(Op::forward, r, c, m), Bk = pos.input_grad_at(r, c, m);
        const int I = pos.at(Op::input_grad, r, c, m), W = pos.at(Op::weight_grad, r, c, m);
        if (f.open(Property::one_forward_each)) report(Property::one_forward_each, once(Op::forward, true, r, c, m));
        if (f.open(Property::one_backward_each)) {
          const int b = pos.how_many(Op::backward, r, c, m), i = pos.how_many(Op::input_grad, r, c, m),
                    w = pos.how_many(Op::weight_grad, r, c, m);
          if (!((b == 1 && i == 0 && w == 0) || (b == 0 && i == 1 && w == 1)))
            report(Property::one_backward_each, b > 1   ? repeat_of(programs, pos, Op::backward, r, c, m)
                                                : i > 1 ? repeat_of(programs, pos, Op::input_grad, r, c, m)
                                                : w > 1 ? repeat_of(programs, pos, Op::weight_grad, r, c, m)
                                                : b == 1 ? (i == 1 ? I : W)
                                                         : -1);
        }
        if (f.open(Property::forward_before_backward) && Bk < F) report(Property::forward_before_backward, Bk);
        if (f.open(Property::input_grad_before_weight_grad) && W >= 0 && W < I)
          report(Property::input_grad_before_weight_grad, W);
        if (f.open(Property::one_send_each)) {
          const int a = once(Op::send_act, forward_message, r, c, m);
          report(Property::one_send_each, a >= -1 ? a : once(Op::send_grad, backward_message, r, c, m));
        }
        if (f.open(Property::one_receive_each)) {
          const int a = once(Op::recv_act, backward_message, r, c, m);
          report(Property::one_receive_each, a >= -1 ? a : once(Op::recv_grad, forward_message, r, c, m));
        }
        if (f.open(Property::sends_after_compute)) {
          const int a = pos.at(Op::send_act, r, c, m), g = pos.at(Op::send_grad, r, c, m);
          if (a >= 0 && a < F) report(Property::sends_after_compute, a);
          else if (g >= 0 && g < Bk) report(Property::sends_after_compute, g);
        }
        if (f.open(Property::forward_after_input) && st > 0) {
          const int before = backward_message ? pos.at(Op::recv_act, r, c, m)
                                              : pos.at(Op::forward, r, sh.chunk_of(st - 1), m);
          if (!(before < F)) report(Property::forward_after_input, F);
        }
        if (f.open(Property::backward_after_gradient) && st + 1 < sh.stages()) {
          const int before = forward_message ? pos.at(Op::recv_grad, r, c, m)
                                             : pos.input_grad_at(r, sh.chunk_of(st + 1), m);
          if (!(before < Bk)) report(Property::backward_after_gradient, Bk);
        }
      }
    }
}

// Pass 3, over the receives: NCCL matches the k-th send from a rank with the
// k-th receive posted for it, so a message's two ends must have the same number.
constexpr Verdict check_pairing(const Programs& programs, const Positions& pos, const Scratch<int>& numbers) {
  for (int r = 0; r < programs.ranks(); ++r) {
    const Action* prog = programs.begin[r];
    const int n = programs.size(r), base = programs.offset[r];
    for (int i = 0; i < n; ++i) {
      if (!is_recv(prog[i].op)) continue;
      const Place from = partner(pos, r, prog[i]);
      if (numbers[programs.offset[from.rank] + from.index] != numbers[base + i])
        return {Property::sends_match_receives, r, i, prog[i].mb, prog[i].chunk};
    }
  }
  return {};
}

// Passes 1 to 3: everything but the dry run.
constexpr Verdict check_table(const Programs& programs, const Positions& pos) {
  Findings f;
  Scratch<int> numbers(programs.total());
  check_actions(programs, numbers, f);
  check_slots(programs, pos, f);
  if (!f.first.ok()) return f.first;
  return check_pairing(programs, pos, numbers);
}

// The dry run under blocking sends: it must reach the end of every program.
constexpr Verdict check_run(const Programs& programs, const Positions& pos, const DryRun& run) {
  if (run.finished) return {};
  const Place crossed = crossed_sends(programs, pos, run);
  const Property p = crossed.rank >= 0 ? Property::no_crossed_sends : Property::progresses;
  int r = crossed.rank, i = crossed.index;
  for (int q = 0; r < 0 && q < programs.ranks(); ++q)
    if (run.at[q] < programs.size(q)) r = q, i = run.at[q];
  const Action& a = programs.begin[r][i];
  return {p, r, i, a.mb, a.chunk};
}

template <class S>
constexpr bool shape_is_valid(const S& s) {
  if constexpr (requires { s.programs.size(); })
    return s.shape.valid() && static_cast<int>(s.programs.size()) == s.shape.ranks;
  else
    return s.shape.valid();
}

}  // namespace detail

// Any table: a Schedule, or a Table<P, M, V, Order>.
template <class S>
constexpr Verdict verify(const S& s) {
  if (!detail::shape_is_valid(s)) return {Property::shape};
  const detail::Programs programs(s);
  const Positions pos = positions(programs);
  if (const Verdict v = detail::check_table(programs, pos); !v.ok()) return v;
  return detail::check_run(programs, pos, detail::dry_run(programs, pos, Cost{}, Sends::blocking));
}

}  // namespace fived::pipeline
