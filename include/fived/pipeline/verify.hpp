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

// The checks, each pass linear in the table and reading its index
// (table_index.hpp: where each action is, whom it meets, each message's number
// on its channel): one over the actions (their form, their peers), one over the
// (rank, chunk, micro-batch) slots (counts and orders), one over the receives
// (pairing), then the dry run. A pass records each
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

// Pass 1, over the actions: well_formed and peers_are_neighbours.
template <class Rows, class Ix>
constexpr void check_actions(const Rows& t, const Ix& ix, Findings& f) {
  const int P = t.shape.ranks, V = t.shape.chunks, M = t.shape.micro_batches;
  int r = 0, i = 0, n = 0, op = 0, mb = 0, chunk = 0, peer = 0, other = 0;
  bool comm = false;
  for (r = 0; r < P; ++r)
    for (i = 0, n = t.sizes[r]; i < n; ++i) {
      op = static_cast<int>(t.actions[r][i].op);
      mb = t.actions[r][i].mb;
      chunk = t.actions[r][i].chunk;
      peer = t.actions[r][i].peer;
      comm = op >= 5 && op <= 8;
      if (op == 0 || op > 8 || mb < 0 || mb >= M || chunk < 0 || chunk >= V ||
          (comm && (peer < 0 || peer >= P || peer == r)) ||
          (t.actions[r][i].joins_previous && (!comm || i == 0 || t.actions[r][i - 1].op < Op::send_act))) {
        f.found(Property::well_formed, r, i, mb, chunk);
      } else if (comm) {
        // Activations go to the next stage and gradients come from it; the other two, the previous.
        other = op == 5 || op == 8 ? ix.next[r * V + chunk] : ix.prev[r * V + chunk];
        if (other < 0 || other / V == r || other / V != peer) f.found(Property::peers_are_neighbours, r, i, mb, chunk);
      }
    }
}

// The second `op` of a stage's micro-batch, for the report (only when there is one).
template <class Rows, class Ix>
constexpr int repeat_of(const Rows& t, const Ix& ix, Op op, int r, int c, int m) {
  const int V = t.shape.chunks, M = t.shape.micro_batches;
  for (int i = ix.first[((r * V + c) * M + m) * kinds + static_cast<int>(op) - 1]; i < t.sizes[r]; ++i)
    if (t.actions[r][i].op == op && t.actions[r][i].mb == m && t.actions[r][i].chunk == c) return i;
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
  int at[slot_kind::count];
  int many, back, input, grad;
  bool forward_message, backward_message, has_prev, has_next;
};

template <class Rows, class Ix>
constexpr void report_slot(const Rows& t, const Ix& ix, const Slot& s, Findings& f) {
  using namespace slot_kind;
  const int* at = s.at;
  auto once = [&](int kind, bool needed) { return (at[kind] >= 0) == needed && !(s.many >> kind & 1); };
  auto where = [&](Property p, int position) { f.found(p, s.r, position, s.m, s.c); };
  auto again = [&](int kind) { return repeat_of(t, ix, static_cast<Op>(kind + 1), s.r, s.c, s.m); };
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

// The slot's positions are read as 1 + index (0: none), which orders them as the
// indices do with -1 for none.
template <class Rows, class Ix>
constexpr void check_slots(const Rows& t, const Ix& ix, Findings& f) {
  const int P = t.shape.ranks, V = t.shape.chunks, M = t.shape.micro_batches;
  int r = 0, c = 0, m = 0, slot = 0, next = 0, prev = 0, at = 0, theirs = 0, fF = 0, fB = 0, fI = 0, fW = 0, fSA = 0,
      fRA = 0, fSG = 0, fRG = 0, back = 0, input = 0, grad = 0;
  bool forward_message = false, backward_message = false;
  for (r = 0; r < P; ++r)
    for (c = 0; c < V; ++c) {
      next = ix.next[r * V + c];
      prev = ix.prev[r * V + c];
      forward_message = next >= 0 && next / V != r;
      backward_message = prev >= 0 && prev / V != r;
      for (m = 0; m < M; ++m) {
        slot = (r * V + c) * M + m;
        at = slot * kinds;
        fF = ix.first[at];
        fB = ix.first[at + 1];
        fI = ix.first[at + 2];
        fW = ix.first[at + 3];
        fSA = ix.first[at + 4];
        fRA = ix.first[at + 5];
        fSG = ix.first[at + 6];
        fRG = ix.first[at + 7];
        // What makes the input gradient (B, or I); what F waits for (its activations received, or the
        // previous stage's F on this rank); what B or I waits for (the output gradient received, or the
        // next stage's B or I on this rank).
        back = fB != 0 ? fB : fI;
        input = prev < 0 ? 0 : backward_message ? fRA : ix.first[(prev * M + m) * kinds];
        theirs = next < 0 ? 0 : (next * M + m) * kinds;
        grad = next < 0 ? 0 : forward_message ? fRG : ix.first[theirs + 1] != 0 ? ix.first[theirs + 1] : ix.first[theirs + 2];
        if (ix.repeated[slot] == 0 && fF != 0 && ((fB != 0 && fI == 0 && fW == 0) || (fB == 0 && fI != 0 && fW != 0)) &&
            back > fF && (fW == 0 || fW > fI) && (fSA != 0) == forward_message && (fSG != 0) == backward_message &&
            (fRA != 0) == backward_message && (fRG != 0) == forward_message && (fSA == 0 || fSA > fF) &&
            (fSG == 0 || fSG > back) && (prev < 0 || input < fF) && (next < 0 || grad < back))
          continue;
        report_slot(t, ix,
                    {r, c, m, {fF - 1, fB - 1, fI - 1, fW - 1, fSA - 1, fRA - 1, fSG - 1, fRG - 1}, ix.repeated[slot],
                     back - 1, input - 1, grad - 1, forward_message, backward_message, prev >= 0, next >= 0},
                    f);
      }
    }
}

// Pass 3, over the receives: NCCL matches the k-th send from a rank with the
// k-th receive posted for it, so a message's two ends must have the same number.
template <class Rows, class Ix>
constexpr Verdict check_pairing(const Rows& t, const Ix& ix) {
  int r = 0, i = 0, n = 0, k = 0;
  for (r = 0; r < t.shape.ranks; ++r)
    for (i = 0, n = t.sizes[r], k = ix.offset[r]; i < n; ++i, ++k)
      if ((t.actions[r][i].op == Op::recv_act || t.actions[r][i].op == Op::recv_grad) && ix.partner[k] != 0 &&
          ix.number[ix.partner[k] - 1] != ix.number[k])
        return {Property::sends_match_receives, r, i, t.actions[r][i].mb, t.actions[r][i].chunk};
  return {};
}

// Passes 1 to 3: everything but the dry run.
template <class Rows, class Ix>
constexpr Verdict check_table(const Rows& t, const Ix& ix) {
  Findings f;
  check_actions(t, ix, f);
  check_slots(t, ix, f);
  if (!f.first.ok()) return f.first;
  return check_pairing(t, ix);
}

// The dry run under blocking sends: it must reach the end of every program.
template <class Rows, class Ix, class State>
constexpr Verdict check_run(const Rows& t, const Ix& ix, const State& run) {
  if (run.finished) return {};
  const Place crossed = crossed_sends(t, ix, run);
  const Property p = crossed.rank >= 0 ? Property::no_crossed_sends : Property::progresses;
  int r = crossed.rank, i = crossed.index;
  for (int q = 0; r < 0 && q < t.shape.ranks; ++q)
    if (run.at[q] < t.sizes[q]) r = q, i = run.at[q];
  return {p, r, i, t.actions[r][i].mb, t.actions[r][i].chunk};
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
  const auto& t = detail::rows_of(s);
  const detail::Index ix(t);
  if (const Verdict v = detail::check_table(t, ix); !v.ok()) return v;
  detail::DryRun run(t.shape.ranks, ix.offset[t.shape.ranks]);
  detail::dry_run(t, ix, Cost{}, Sends::blocking, run);
  return detail::check_run(t, ix, run);
}

}  // namespace fived::pipeline
