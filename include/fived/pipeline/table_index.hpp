#pragma once
// What the proofs look up in a table, found in two passes over it: where each
// (rank, chunk, micro-batch)'s actions sit, and which action each message meets.
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
// So the passes take the table's own arrays (`t.actions[r][i]`, `t.sizes[r]`),
// write into arrays that are members of a constant (FixedIndex, for Proven<>)
// or sized at run time (Index, for a Schedule), and declare nothing in a loop.

#include <vector>

#include "fived/pipeline/table.hpp"

namespace fived::pipeline::detail {

// The action kinds a slot may hold: the ops after Op::none.
inline constexpr int kinds = static_cast<int>(Op::recv_grad);

// What the proofs read of a table: `shape`, `actions[r][i]` and `sizes[r]`. A
// Table has them; a Schedule is read through ScheduleRows.
struct ScheduleRows {
  Shape shape;
  const std::vector<std::vector<Action>>& actions;
  Scratch<int> sizes;

  constexpr explicit ScheduleRows(const Schedule& s)
      : shape(s.shape), actions(s.programs), sizes(static_cast<int>(s.programs.size())) {
    for (int r = 0; r < static_cast<int>(s.programs.size()); ++r)
      sizes[r] = static_cast<int>(s.programs[static_cast<std::size_t>(r)].size());
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
// table t in two passes; first, where each action is:
//   offset[r]          the number of rank r's first action (actions are numbered rank by rank); offset[P]: all
//   next[rc], prev[rc] the stage after and before (rank, chunk), each as rank · V + chunk; -1: none
//   first[slot · kinds + op - 1]  1 + the index of the slot's first such action in its rank's program; 0: none
//                      (slot: (rank · V + chunk) · M + micro-batch; must come zeroed)
//   repeated[slot]     bit op - 1 set when that op comes again (must come zeroed)
template <class Rows, class Ix>
constexpr void find_positions(const Rows& t, Ix& ix) {
  const Shape& sh = t.shape;
  const int P = sh.ranks, V = sh.chunks, M = sh.micro_batches;
  int r = 0, i = 0, n = 0, op = 0, mb = 0, chunk = 0, at = 0;
  stage_neighbours(sh, ix);
  ix.offset[0] = 0;
  for (r = 0; r < P; ++r) ix.offset[r + 1] = ix.offset[r] + t.sizes[r];
  for (r = 0; r < P; ++r)
    for (i = 0, n = t.sizes[r]; i < n; ++i) {
      op = static_cast<int>(t.actions[r][i].op);
      mb = t.actions[r][i].mb;
      chunk = t.actions[r][i].chunk;
      if (op == 0 || op > kinds || mb < 0 || mb >= M || chunk < 0 || chunk >= V) continue;
      at = ((r * V + chunk) * M + mb) * kinds + op - 1;
      if (ix.first[at] == 0) ix.first[at] = i + 1;
      else ix.repeated[at / kinds] |= static_cast<unsigned char>(1 << (op - 1));
    }
}

// Then, with the positions, whom each message meets:
//   partner[k]         1 + the number of the comm action that action k meets (same micro-batch, the
//                      neighbouring stage, the opposite direction; the first such); 0: none, and for
//                      compute actions (must come zeroed)
//   partner_rank[k]    its rank
//   number[k]          1 + a send's or receive's place among those between the same two ranks in its
//                      direction (NCCL matches the k-th send with the k-th receive); 0 for others (must
//                      come zeroed)
template <class Rows, class Ix>
constexpr void find_messages(const Rows& t, Ix& ix) {
  const int P = t.shape.ranks, V = t.shape.chunks, M = t.shape.micro_batches;
  int r = 0, i = 0, n = 0, k = 0, op = 0, mb = 0, chunk = 0, peer = 0, at = 0, other = 0;
  // Sends to q, then receives from q, rank r's; send_act <-> recv_act and send_grad <-> recv_grad are
  // ops 5 <-> 6 and 7 <-> 8. Activations go to the next stage and gradients come from it; the other
  // two, the previous.
  Scratch<int> counter(2 * P);
  for (r = 0; r < P; ++r) {
    for (k = 0; k < 2 * P; ++k) counter[k] = 0;
    for (i = 0, n = t.sizes[r], k = ix.offset[r]; i < n; ++i, ++k) {
      op = static_cast<int>(t.actions[r][i].op);
      if (op < 5 || op > 8) continue;
      mb = t.actions[r][i].mb;
      chunk = t.actions[r][i].chunk;
      peer = t.actions[r][i].peer;
      if (mb < 0 || mb >= M || chunk < 0 || chunk >= V) continue;
      if (peer >= 0 && peer < P && peer != r) ix.number[k] = ++counter[(op == 5 || op == 7 ? 0 : P) + peer];
      other = op == 5 || op == 8 ? ix.next[r * V + chunk] : ix.prev[r * V + chunk];
      if (other < 0) continue;
      at = ix.first[(other * M + mb) * kinds + (op % 2 == 1 ? op : op - 2)];  // the other kind, 0-based
      ix.partner[k] = at == 0 ? 0 : ix.offset[other / V] + at;
      ix.partner_rank[k] = other / V;
    }
  }
}

// The index of a Table, in arrays of fixed size: two constants of Proven<> (the
// compilers limit the work of each), the positions, then the whole index.
template <class TableType>
struct FixedPositions {
  static constexpr int P = TableType::ranks, stages = P * TableType::chunks,
                       slots = stages * TableType::micro_batches;
  int offset[P + 1]{}, next[stages]{}, prev[stages]{}, first[slots * kinds]{};
  unsigned char repeated[slots]{};

  constexpr explicit FixedPositions(const TableType& t) { find_positions(t, *this); }
};

template <class TableType>
struct FixedIndex : FixedPositions<TableType> {
  static constexpr int actions = TableType::ranks * TableType::capacity;
  int partner[actions]{}, partner_rank[actions]{}, number[actions]{};

  constexpr FixedIndex(const TableType& t, const FixedPositions<TableType>& positions)
      : FixedPositions<TableType>(positions) {
    find_messages(t, *this);
  }
};

// The index of any table, in arrays sized at run time.
struct Index {
  Scratch<int> offset, next, prev, first;
  Scratch<unsigned char> repeated;
  Scratch<int> partner, partner_rank, number;

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
        partner(actions, 0),
        partner_rank(actions, 0),
        number(actions, 0) {
    find_positions(t, *this);
    find_messages(t, *this);
  }
};

}  // namespace fived::pipeline::detail
