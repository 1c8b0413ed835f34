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
  const int P = sh.ranks, V = sh.chunks, M = sh.micro_batches;
  const StageMap map(sh);
  Scratch<int> counters(2 * P);  // [sent to q | received from P + q], for one rank at a time
  for (int r = 0; r < P; ++r) {
    for (int q = 0; q < 2 * P; ++q) counters[q] = 0;
    const Action* prog = programs.begin[r];
    const int base = programs.offset[r], n = programs.offset[r + 1] - base;
    for (int i = 0; i < n; ++i) {
      const Action& a = prog[i];
      // Activations go to the next stage and gradients come from it; the other two, the previous.
      const bool comm = a.op >= Op::send_act && a.op <= Op::recv_grad,
                 formed = a.op != Op::none && a.mb >= 0 && a.mb < M && a.chunk >= 0 && a.chunk < V &&
                          (!comm || (a.peer >= 0 && a.peer < P && a.peer != r)) &&
                          (!a.joins_previous ||
                           (comm && i > 0 && prog[i - 1].op >= Op::send_act && prog[i - 1].op <= Op::recv_grad)),
                 send = a.op == Op::send_act || a.op == Op::send_grad;
      const int other = !formed || !comm                                 ? -1
                        : a.op == Op::send_act || a.op == Op::recv_grad ? map.next[r * V + a.chunk]
                                                                        : map.prev[r * V + a.chunk];
      if (!formed) f.found(Property::well_formed, r, i, a.mb, a.chunk);
      else if (comm && (numbers[base + i] = counters[(send ? 0 : P) + a.peer]++,
                        other < 0 || other / V == r || other / V != a.peer))
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

// Pass 2, over the slots: the counts and orders of each stage's actions. A slot
// is checked first in one expression (the usual slot passes); one that fails
// is looked at again, property by property, to say which and where.
namespace slot_kind {
constexpr int F = 0, B = 1, I = 2, W = 3, SA = 4, RA = 5, SG = 6, RG = 7, count = 8;  // op - 1
}

// `at`: index of the slot's first action of each kind, or -1; `many`: kinds that come again;
// `input` and `grad`: what its F and its B or I wait for (-1: nothing there).
struct Slot {
  int r, c, m;
  const int* at;
  int many, back, input, grad;
  bool forward_message, backward_message, has_prev, has_next;
};

constexpr void report_slot(const Programs& programs, const Positions& pos, const Slot& s, Findings& f) {
  using namespace slot_kind;
  const int* at = s.at;
  auto once = [&](int kind, bool needed) { return (at[kind] >= 0) == needed && !(s.many >> kind & 1); };
  auto where = [&](Property p, int position) { f.found(p, s.r, position, s.m, s.c); };
  auto again = [&](int kind) { return repeat_of(programs, pos, static_cast<Op>(kind + 1), s.r, s.c, s.m); };
  if (!once(F, true)) where(Property::one_forward_each, at[F] < 0 ? -1 : again(F));
  const bool one_b = once(B, true) && at[I] < 0 && at[W] < 0, split = at[B] < 0 && once(I, true) && once(W, true);
  if (!one_b && !split) {
    const bool b = at[B] >= 0, i = at[I] >= 0;
    where(Property::one_backward_each, b && (s.many >> B & 1)             ? again(B)
                                       : i && (s.many >> I & 1)           ? again(I)
                                       : at[W] >= 0 && (s.many >> W & 1) ? again(W)
                                       : b                                ? (i ? at[I] : at[W])
                                                                          : -1);
  }
  if (s.back < at[F]) where(Property::forward_before_backward, s.back);
  if (at[W] >= 0 && at[W] < at[I]) where(Property::input_grad_before_weight_grad, at[W]);
  if (!(once(SA, s.forward_message) && once(SG, s.backward_message))) {
    const int kind = once(SA, s.forward_message) ? SG : SA;
    where(Property::one_send_each, at[kind] < 0 ? -1 : again(kind));
  }
  if (!(once(RA, s.backward_message) && once(RG, s.forward_message))) {
    const int kind = once(RA, s.backward_message) ? RG : RA;
    where(Property::one_receive_each, at[kind] < 0 ? -1 : again(kind));
  }
  if (at[SA] >= 0 && at[SA] < at[F]) where(Property::sends_after_compute, at[SA]);
  else if (at[SG] >= 0 && at[SG] < s.back) where(Property::sends_after_compute, at[SG]);
  if (s.has_prev && !(s.input < at[F])) where(Property::forward_after_input, at[F]);
  if (s.has_next && !(s.grad < s.back)) where(Property::backward_after_gradient, s.back);
}

constexpr void check_slots(const Programs& programs, const Positions& pos, Findings& f) {
  using namespace slot_kind;
  const Shape& sh = programs.shape;
  const int V = sh.chunks, M = sh.micro_batches;
  const StageMap map(sh);
  const int* first = pos.first;  // 1 + index; 0: none
  for (int r = 0; r < sh.ranks; ++r)
    for (int c = 0; c < V; ++c) {
      const int next = map.next[r * V + c], prev = map.prev[r * V + c];
      const bool forward_message = next >= 0 && next / V != r, backward_message = prev >= 0 && prev / V != r;
      for (int m = 0; m < M; ++m) {
        const int slot = (r * V + c) * M + m, *f1 = first + slot * count,
                  *their = next < 0 ? f1 : first + (next * M + m) * count;
        const int at[count] = {f1[0] - 1, f1[1] - 1, f1[2] - 1, f1[3] - 1, f1[4] - 1, f1[5] - 1, f1[6] - 1, f1[7] - 1};
        // What makes the input gradient (B, or I); what F waits for (its activations received, or the
        // previous stage's F on this rank); what B or I waits for (the output gradient received, or the
        // next stage's B or I on this rank).
        const int back = at[B] >= 0 ? at[B] : at[I],
                  input = prev < 0 ? -1 : backward_message ? at[RA] : first[(prev * M + m) * count + F] - 1,
                  grad = next < 0 ? -1 : forward_message ? at[RG] : (their[B] > 0 ? their[B] : their[I]) - 1;
        const bool fine = pos.repeated[slot] == 0 && at[F] >= 0 &&
                          ((at[B] >= 0 && at[I] < 0 && at[W] < 0) || (at[B] < 0 && at[I] >= 0 && at[W] >= 0)) &&
                          back > at[F] && (at[W] < 0 || at[W] > at[I]) && (at[SA] >= 0) == forward_message &&
                          (at[SG] >= 0) == backward_message && (at[RA] >= 0) == backward_message &&
                          (at[RG] >= 0) == forward_message && (at[SA] < 0 || at[SA] > at[F]) &&
                          (at[SG] < 0 || at[SG] > back) && (prev < 0 || input < at[F]) && (next < 0 || grad < back);
        if (!fine)
          report_slot(programs, pos,
                      {r, c, m, at, pos.repeated[slot], back, input, grad, forward_message, backward_message,
                       prev >= 0, next >= 0},
                      f);
      }
    }
}

// Pass 3, over the receives: NCCL matches the k-th send from a rank with the
// k-th receive posted for it, so a message's two ends must have the same number.
constexpr Verdict check_pairing(const Programs& programs, const Partners& partners, const Scratch<int>& numbers) {
  for (int r = 0; r < programs.ranks(); ++r) {
    const Action* prog = programs.begin[r];
    const int base = programs.offset[r], n = programs.offset[r + 1] - base;
    for (int i = 0; i < n; ++i)
      if ((prog[i].op == Op::recv_act || prog[i].op == Op::recv_grad) &&
          numbers[partners.action[base + i]] != numbers[base + i])
        return {Property::sends_match_receives, r, i, prog[i].mb, prog[i].chunk};
  }
  return {};
}

// Passes 1 to 3: everything but the dry run.
constexpr Verdict check_table(const Programs& programs, const Positions& pos, const Partners& partners) {
  Findings f;
  Scratch<int> numbers(programs.total());
  check_actions(programs, numbers, f);
  check_slots(programs, pos, f);
  if (!f.first.ok()) return f.first;
  return check_pairing(programs, partners, numbers);
}

// The dry run under blocking sends: it must reach the end of every program.
constexpr Verdict check_run(const Programs& programs, const Partners& partners, const DryRun& run) {
  if (run.finished) return {};
  const Place crossed = crossed_sends(programs, partners, run);
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
  const detail::Index index(programs);
  if (const Verdict v = detail::check_table(programs, index.positions(), index.partners()); !v.ok()) return v;
  return detail::check_run(programs, index.partners(),
                           detail::dry_run(programs, index.partners(), Cost{}, Sends::blocking));
}

}  // namespace fived::pipeline
