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

#include "fived/pipeline/dry_run.hpp"
#include "fived/pipeline/verdict.hpp"

namespace fived::pipeline {

namespace detail {

// The checks, each pass linear in the table and reading its index
// (table_index.hpp: where each action is, each message's number on its
// channel, and what the walk that found them checked of the actions' form and
// peers): then one pass over the (rank, chunk, micro-batch) slots (counts,
// orders, pairing), then the dry run.

// The second `op` of a stage's micro-batch, for the report (only when there is one).
template <class Rows, class Ix>
constexpr int repeat_of(const Rows& t, const Ix& ix, Op op, int r, int c, int m) {
  const int V = t.shape.chunks, M = t.shape.micro_batches;
  for (int i = ix.first[((r * V + c) * M + m) * kinds + static_cast<int>(op) - 1]; i < t.sizes[r]; ++i)
    if (const Action a = t.action(r, i); a.op == op && a.mb == m && a.chunk == c) return i;
  return -1;
}

// The pass over the slots: the counts and orders of each stage's actions, and
// the pairing of its receives. A slot is checked first in one expression (the
// usual slot passes); one that fails is looked at again, property by property,
// to say which and where.
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
// indices do with -1 for none. NCCL matches the k-th send from a rank with the
// k-th receive posted for it, so a message's two ends must have the same number
// on their channel (sends_match_receives); that is checked where a slot passes
// all else, and the first receive in program order that fails is reported.
template <class Rows, class Ix>
constexpr void check_slots(const Rows& t, const Ix& ix, Findings& f) {
  const int P = t.shape.ranks, V = t.shape.chunks, M = t.shape.micro_batches;
  int r = 0, c = 0, m = 0, slot = 0, next = 0, prev = 0, at = 0, theirs = 0, fF = 0, fB = 0, fI = 0, fW = 0, fSA = 0,
      fRA = 0, fSG = 0, fRG = 0, back = 0, input = 0, grad = 0, sent_act = 0, sent_grad = 0, unpaired_rank = -1,
      unpaired = 0;
  bool forward_message = false, backward_message = false, act_paired = false, grad_paired = false;
  for (r = 0; r < P; ++r)
    for (c = 0; c < V; ++c) {
      next = ix.next[r * V + c], prev = ix.prev[r * V + c], forward_message = next >= 0 && next / V != r,
      backward_message = prev >= 0 && prev / V != r;
      for (m = 0; m < M; ++m) {
        // What makes the input gradient (B, or I); what F waits for (its activations received, or the
        // previous stage's F on this rank); what B or I waits for (the output gradient received, or the
        // next stage's B or I on this rank); the sends its receives meet. One statement: Clang counts them.
        slot = (r * V + c) * M + m, at = slot * kinds, fF = ix.first[at], fB = ix.first[at + 1], fI = ix.first[at + 2],
        fW = ix.first[at + 3], fSA = ix.first[at + 4], fRA = ix.first[at + 5], fSG = ix.first[at + 6],
        fRG = ix.first[at + 7], back = fB != 0 ? fB : fI,
        input = prev < 0 ? 0 : backward_message ? fRA : ix.first[(prev * M + m) * kinds],
        theirs = next < 0 ? 0 : (next * M + m) * kinds,
        grad = next < 0                ? 0
               : forward_message       ? fRG
               : ix.first[theirs + 1] != 0 ? ix.first[theirs + 1]
                                       : ix.first[theirs + 2],
        sent_act = fRA == 0 || prev < 0 ? 0 : ix.first[(prev * M + m) * kinds + 4],
        sent_grad = fRG == 0 || next < 0 ? 0 : ix.first[theirs + 6],
        act_paired = sent_act == 0 || ix.number[ix.offset[r] + fRA - 1] == ix.number[ix.offset[prev / V] + sent_act - 1],
        grad_paired = sent_grad == 0 || ix.number[ix.offset[r] + fRG - 1] == ix.number[ix.offset[next / V] + sent_grad - 1];
        if (ix.repeated[slot] == 0 && fF != 0 && ((fB != 0 && fI == 0 && fW == 0) || (fB == 0 && fI != 0 && fW != 0)) &&
            back > fF && (fW == 0 || fW > fI) && (fSA != 0) == forward_message && (fSG != 0) == backward_message &&
            (fRA != 0) == backward_message && (fRG != 0) == forward_message && (fSA == 0 || fSA > fF) &&
            (fSG == 0 || fSG > back) && (prev < 0 || input < fF) && (next < 0 || grad < back)) {
          if (!act_paired || !grad_paired)  // the earliest such receive: the first rank's, then its first
            at = !act_paired && (grad_paired || fRA < fRG) ? fRA - 1 : fRG - 1,
            unpaired = unpaired_rank < 0 || (unpaired_rank == r && at < unpaired) ? at : unpaired,
            unpaired_rank = unpaired_rank < 0 ? r : unpaired_rank;
          continue;
        }
        report_slot(t, ix,
                    {r, c, m, {fF - 1, fB - 1, fI - 1, fW - 1, fSA - 1, fRA - 1, fSG - 1, fRG - 1}, ix.repeated[slot],
                     back - 1, input - 1, grad - 1, forward_message, backward_message, prev >= 0, next >= 0},
                    f);
      }
    }
  if (unpaired_rank >= 0)
    f.found(Property::sends_match_receives, unpaired_rank, unpaired, t.action(unpaired_rank, unpaired).mb,
            t.action(unpaired_rank, unpaired).chunk);
}

// Everything but the dry run: the index's findings (the actions' own form and
// peers), then the slots.
template <class Rows, class Ix>
constexpr Verdict check_table(const Rows& t, const Ix& ix) {
  Findings f = ix.findings;
  check_slots(t, ix, f);
  return f.first;
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
  return {p, r, i, t.action(r, i).mb, t.action(r, i).chunk};
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
