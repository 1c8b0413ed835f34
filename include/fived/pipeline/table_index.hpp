#pragma once
// What the proofs look up in a table, found in one walk over it: where each
// (rank, chunk, micro-batch)'s actions sit, each message's number on its
// channel, what can be checked of each action alone, and each rank's compute
// counts and peaks (the schedule's figures but its makespan).
//
// The proofs run inside the compiler for every schedule type a program names,
// where each operation is interpreted: a Table of P = 16, M = 128, V = 4 has
// about 48,000 actions, and every statement per action costs tens of
// milliseconds over the table. What is cheap there, measured on GCC 12 and
// Clang 14 with loops of 500,000 turns (bench/schedule_compile_cost.sh measures
// the whole proof):
//   - arrays indexed as arrays (a member `a[k]` of an object): GCC builds new
//     trees for each access through a pointer, 3 to 6 times the time and about
//     100 bytes of compiler memory that live to the end of the file;
//   - variables declared once, before the loops: Clang makes a new object for a
//     declaration in a loop body on each turn, and keeps it until the function
//     returns (a microsecond and more, and memory, per declaration and turn).
// So the passes take the table's own arrays (`t.actions[r][i]`, packed ints: table.hpp; `t.sizes[r]`),
// write into arrays that are members of a constant (FixedIndex, for Proven<>)
// or sized at run time (Index, for a Schedule), and declare nothing in a loop.
// And a walk over the actions costs even when it does little there (Clang: about
// half a second over 48,000 actions), so the proof walks them twice in all:
// here, and in the dry run (dry_run.hpp); verify.hpp's other checks go over the
// (rank, chunk, micro-batch) slots instead, a third as many.

#include <vector>

#include "fived/pipeline/table.hpp"
#include "fived/pipeline/verdict.hpp"

namespace fived::pipeline::detail {

// The action kinds a slot may hold: the ops after Op::none.
inline constexpr int kinds = static_cast<int>(Op::recv_grad);

// What the proofs read of a table: `shape`, `packing`, `actions[r][i]` (packed,
// table.hpp), `sizes[r]` and `unpacked`. A Table has them; a Schedule is read
// through ScheduleRows, which packs it.
struct ScheduleRows {
  Shape shape;
  Packing packing;
  Scratch<int> sizes, offset, packed;
  Unpacked unpacked;

  // actions[r]: rank r's packed actions.
  struct Programs {
    const int* packed;
    const int* offset;
    constexpr const int* operator[](int r) const { return packed + offset[r]; }
  } actions;

  constexpr explicit ScheduleRows(const Schedule& s)
      : shape(s.shape), packing(s.shape), sizes(ranks_of(s)), offset(ranks_of(s) + 1), packed(length(s)),
        actions{packed.data(), offset.data()} {
    offset[0] = 0;
    for (int r = 0; r < ranks_of(s); ++r) {
      const auto& p = s.programs[static_cast<std::size_t>(r)];
      sizes[r] = static_cast<int>(p.size()), offset[r + 1] = offset[r] + sizes[r];
      for (int i = 0; i < sizes[r]; ++i)
        packed[offset[r] + i] = unpacked.pack(packing, r, i, p[static_cast<std::size_t>(i)]);
    }
  }
  ScheduleRows(const ScheduleRows&) = delete;

  constexpr Action action(int r, int i) const { return unpacked.unpack(packing, r, i, actions[r][i]); }

 private:
  static constexpr int ranks_of(const Schedule& s) { return static_cast<int>(s.programs.size()); }
  static constexpr int length(const Schedule& s) {
    int n = 0;
    for (const auto& p : s.programs) n += static_cast<int>(p.size());
    return n;
  }
};

template <class S>
constexpr decltype(auto) rows_of(const S& s) {
  if constexpr (requires { s.programs; }) return ScheduleRows(s);
  else return (s);
}

template <class Rows>
constexpr int total_actions(const Rows& t) {
  int n = 0;
  for (int r = 0; r < t.shape.ranks; ++r) n += t.sizes[r];
  return n;
}

// The index's arrays (Ix: FixedIndex or Index, the same members), filled from
// table t in one walk over its actions:
//   offset[r]          the number of rank r's first action (actions are numbered rank by rank); offset[P]: all
//   next[rc], prev[rc] the stage after and before (rank, chunk), each as rank · V + chunk; -1: none
//   first[slot · kinds + op - 1]  1 + the index of the slot's first such action in its rank's program; 0: none
//                      (slot: (rank · V + chunk) · M + micro-batch; must come zeroed)
//   repeated[slot]     bit op - 1 set when that op comes again (must come zeroed)
//   meets[k]           for comm action k: where the action it meets is recorded in `first`, the slot · kinds
//                      + op - 1 of the opposite kind for its micro-batch on the neighbouring stage; -1: no such
//                      stage (the dry run reads it for every message: so it is found here, once)
//   number[k]          1 + a send's or receive's place among those between the same two ranks in its
//                      direction (NCCL matches the k-th send with the k-th receive); 0 for others (must
//                      come zeroed). channel[2P] is the walk's count per direction and peer.
//   findings           the first action that is not well formed, or names a peer that is not the
//                      neighbouring stage's rank (verify.hpp's first two action properties)
//   computes[r · 4 + op - 1]      rank r's count of F, B, I and W (its busy time, under any Cost)
//   peak_activations[r], peak_pending[r], peak_deferred[r]  the most (micro-batch, chunk) pairs rank r
//                      holds from F to the end of B or I, from F to the end of B or W, and from the end of
//                      I to the end of W (simulate.hpp)
// Whom a message meets is found through meets and first: partner() below.
template <class Rows, class Ix>
constexpr void survey(const Rows& t, Ix& ix) {
  const Shape& sh = t.shape;
  const int P = sh.ranks, V = sh.chunks, M = sh.micro_batches, peers = P + 1;
  int r = 0, i = 0, n = 0, k = 0, p = 0, fields = 0, op = 0, peer = 0, rank_slots = 0, slot = 0, rc = 0, at = 0,
      other = 0, forwards = 0, backwards = 0, input_grads = 0, weight_grads = 0, held = 0, pending = 0, deferred = 0,
      peak = 0, peak_pending = 0, peak_deferred = 0;
  bool comm = false, formed = false, previous_comm = false;
  stage_neighbours(sh, ix);
  ix.offset[0] = 0;
  for (r = 0; r < P; ++r) ix.offset[r + 1] = ix.offset[r] + t.sizes[r];
  for (r = 0; r < P; ++r) {
    for (k = 0; k < 2 * P; ++k) ix.channel[k] = 0;
    forwards = backwards = input_grads = weight_grads = held = pending = deferred = peak = peak_pending =
        peak_deferred = 0, previous_comm = false;
    for (i = 0, n = t.sizes[r], k = ix.offset[r], rank_slots = r * V * M; i < n; ++i, ++k) {
      // The packed action read once, then its fields (table.hpp's Packing; the peer only of a comm
      // action); few statements per action (Clang counts them). An empty slot (or an action that
      // did not pack) has no place.
      p = t.actions[r][i], op = p % 9, fields = p / 18, slot = rank_slots + fields / peers, comm = op >= 5,
      formed = op != 0 && (comm ? (peer = fields % peers - 1) >= 0 && peer != r && (p / 9 % 2 == 0 || previous_comm)
                                : p / 9 % 2 == 0),
      previous_comm = comm;
      if (!formed) {
        ix.findings.found(Property::well_formed, r, i, t.action(r, i).mb, t.action(r, i).chunk);
        if (op == 0) continue;
      }
      // The rest in two statements (Clang counts statements, not expressions: a table of 100,000
      // actions must fit in its 1,048,576 steps with the other walks): where the action sits, and
      // its message's number and neighbour, or the compute counts.
      at = slot * kinds + op - 1,
      ix.first[at] == 0 ? (void)(ix.first[at] = i + 1)
                        : (void)(ix.repeated[slot] |= static_cast<unsigned char>(1 << (op - 1)));
      if (comm)
        // Activations go to the next stage and gradients come from it; the other two, the previous.
        rc = slot / M, other = op == 5 || op == 8 ? ix.next[rc] : ix.prev[rc],
        ix.meets[k] = other < 0 ? -1 : (other * M + slot % M) * kinds + (op % 2 == 1 ? op : op - 2),
        (void)(formed && (other < 0 || other / V == r || other / V != peer) &&
               (ix.findings.found(Property::peers_are_neighbours, r, i, slot % M, rc % V), true)),
        (void)(formed && (ix.number[k] = ++ix.channel[(op == 5 || op == 7 ? 0 : P) + peer]));
      else
        forwards += op == 1, backwards += op == 2, input_grads += op == 3, weight_grads += op == 4,
            held += op == 1 ? 1 : op == 2 || op == 3 ? -1 : 0, pending += op == 1 ? 1 : op == 2 || op == 4 ? -1 : 0,
            deferred += op == 3 ? 1 : op == 4 ? -1 : 0, peak = held > peak ? held : peak,
            peak_pending = pending > peak_pending ? pending : peak_pending,
            peak_deferred = deferred > peak_deferred ? deferred : peak_deferred;
    }
    ix.computes[r * 4] = forwards, ix.computes[r * 4 + 1] = backwards, ix.computes[r * 4 + 2] = input_grads,
    ix.computes[r * 4 + 3] = weight_grads, ix.peak_activations[r] = peak, ix.peak_pending[r] = peak_pending,
    ix.peak_deferred[r] = peak_deferred;
  }
}

// 1 + the number of the action that comm action number k meets: the first of the opposite
// kind for the same micro-batch on the neighbouring stage (send_act <-> recv_act, send_grad
// <-> recv_grad: ops 5 <-> 6 and 7 <-> 8); 0: none. Its rank is *rank.
template <class Ix>
constexpr int partner(const Shape& sh, const Ix& ix, int k, int* rank) {
  const int key = ix.meets[k];
  if (key < 0) return 0;
  *rank = key / (kinds * sh.chunks * sh.micro_batches);
  return ix.first[key] == 0 ? 0 : ix.offset[*rank] + ix.first[key];
}

// The index of a Table, in arrays of fixed size: a constant of Proven<>.
template <class TableType>
struct FixedIndex {
  static constexpr int P = TableType::ranks, stages = P * TableType::chunks,
                       slots = stages * TableType::micro_batches, actions = P * TableType::capacity;
  int offset[P + 1]{}, next[stages]{}, prev[stages]{}, first[slots * kinds]{};
  unsigned char repeated[slots]{};
  int meets[actions]{}, number[actions]{}, channel[2 * P]{};
  Findings findings;
  int computes[4 * P]{}, peak_activations[P]{}, peak_pending[P]{}, peak_deferred[P]{};

  constexpr explicit FixedIndex(const TableType& t) { survey(t, *this); }
};

// The index of any table, in arrays sized at run time.
struct Index {
  Scratch<int> offset, next, prev, first;
  Scratch<unsigned char> repeated;
  Scratch<int> meets, number, channel;
  Findings findings;
  Scratch<int> computes, peak_activations, peak_pending, peak_deferred;

  template <class Rows>
  constexpr explicit Index(const Rows& t) : Index(t, total_actions(t)) {}

 private:
  template <class Rows>
  constexpr Index(const Rows& t, int actions)
      : offset(t.shape.ranks + 1),
        next(t.shape.stages()),
        prev(t.shape.stages()),
        first(t.shape.stages() * t.shape.micro_batches * kinds, 0),
        repeated(t.shape.stages() * t.shape.micro_batches, 0),
        meets(actions),
        number(actions, 0),
        channel(2 * t.shape.ranks),
        computes(4 * t.shape.ranks),
        peak_activations(t.shape.ranks),
        peak_pending(t.shape.ranks),
        peak_deferred(t.shape.ranks) {
    survey(t, *this);
  }
};

}  // namespace fived::pipeline::detail
