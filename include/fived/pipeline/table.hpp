#pragma once
// A pipeline schedule as data: for each rank, the ordered actions it runs.
//
// Two forms of the same thing:
//   Schedule             sizes chosen at run time (std::vector); what the generators
//                        return and what verify() and simulate() read. Usable in
//                        constant expressions, so the checks run inside the compiler.
//   Table<P, M, V, O>    the compile-time form, a literal type that can live in a
//                        `static constexpr` member; built from a Schedule or written
//                        by hand, one braced list per rank:
//
//     using namespace fived::pipeline::notation;
//     struct Mine {
//       static constexpr fived::pipeline::Table<2, 1> table{
//           {F(0), send_act(0, 1), recv_grad(0, 1), B(0)},   // rank 0
//           {recv_act(0, 0), F(0), B(0), send_grad(0, 0)}};  // rank 1
//     };
//     static_assert(fived::pipeline::proven<Mine>);           // proven.hpp
//
// A Table keeps each action packed in one int (Packing below); program(r) gives
// them back as Actions. How an executor walks rank r's program: a step is one
// compute action, or a run of comm actions issued as one NCCL group (each after
// the first has joins_previous):
//
//   const std::vector<Action> program = table.program(r);
//   for (int i = 0; i < int(program.size()); i = step_end(program, i))
//     if (is_comm(program[i].op)) issue_as_one_group(std::span(program).subspan(i, step_end(program, i) - i));
//     else run(program[i]);

#include <array>
#include <climits>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <vector>

#include "fived/pipeline/action.hpp"
#include "fived/pipeline/scratch.hpp"
#include "fived/pipeline/stages.hpp"

namespace fived::pipeline {

// The end of the step that starts at i: i + 1 for a compute action, past the
// last action of the group for a comm action.
constexpr int step_end(std::span<const Action> program, int i) {
  int j = i + 1;
  if (is_comm(program[i].op))
    while (j < static_cast<int>(program.size()) && program[j].joins_previous && is_comm(program[j].op)) ++j;
  return j;
}

// At most 7 actions per micro-batch and chunk: F, I, W (or F, B), and the four
// messages of a stage in the middle of the pipeline.
constexpr int max_actions_per_rank(int micro_batches, int chunks) { return 7 * micro_batches * chunks; }

// An action in one int, as tables and the proofs keep it. The proofs run inside
// the compiler, where a struct read or written is a new object each time and an
// int is one value: a table of 48,000 actions costs Clang 14 times less to write
// this way, GCC 3 times. For ranks P, micro-batches M and chunks V:
//
//   packed = ((stage_mb · (P + 1) + peer + 1) · 2 + joins_previous) · 9 + op,   stage_mb = chunk · M + micro-batch
//
// so op = packed % 9, joins_previous = packed / 9 % 2, peer = packed / 18 % (P + 1) - 1,
// and rank r's slot of the action, (r · V + chunk) · M + micro-batch, is
// r · V · M + packed / 18 / (P + 1); the proofs' loops read the fields so, written
// out. A compute action keeps no peer. An action outside the shape (micro-batch,
// chunk or peer out of range, an op not in Op) has no packed form: it is kept as
// an empty slot (Op::none, 0), which no proof passes, and the table keeps the first
// such action as it was given (Unpacked) for the proof's report.
struct Packing {
  int ranks = 1, micro_batches = 1, chunks = 1;

  constexpr explicit Packing(const Shape& s) : ranks(s.ranks), micro_batches(s.micro_batches), chunks(s.chunks) {}

  // Whether every action of the shape packs into an int.
  constexpr bool fits() const {
    return static_cast<long long>(micro_batches) * chunks * (ranks + 1) * 18 <= static_cast<long long>(INT_MAX);
  }
  constexpr bool holds(const Action& a) const { return pack(a) != 0 || a == Action{}; }
  // 0 (an empty slot) for an action outside the shape. One expression, no calls: the generators
  // pack every compute action inside the compiler, where a call costs more than the arithmetic.
  constexpr int pack(const Action& a) const {
    const int op = static_cast<int>(a.op), comm = op >= 5;
    return op <= 8 && a.mb >= 0 && a.mb < micro_batches && a.chunk >= 0 && a.chunk < chunks &&
                   (!comm || (a.peer >= -1 && a.peer < ranks))
               ? (((a.chunk * micro_batches + a.mb) * (ranks + 1) + (comm ? a.peer + 1 : 0)) * 2 + a.joins_previous) *
                         9 +
                     op
               : 0;
  }
  constexpr Action unpack(int p) const {
    const int stage_mb = p / 18 / (ranks + 1);
    return {static_cast<Op>(p % 9), p / 9 % 2 == 1, stage_mb % micro_batches, stage_mb / micro_batches,
            p / 18 % (ranks + 1) - 1};
  }
};

// The first action of a table that has no packed form, and where it was given: what a
// table (and ScheduleRows, a Schedule read by the proofs) packs its actions through.
struct Unpacked {
  int rank = -1, index = -1;  // -1: every action packed
  Action action{};

  // Action a, given at rank r's place i, packed; kept as given if it is the first without a packed form.
  constexpr int pack(const Packing& packing, int r, int i, const Action& a) {
    const int p = packing.pack(a);
    if (p == 0 && rank < 0 && !packing.holds(a)) rank = r, index = i, action = a;
    return p;
  }
  // The action at rank r's place i, packed as p.
  constexpr Action unpack(const Packing& packing, int r, int i, int p) const {
    return r == rank && i == index ? action : packing.unpack(p);
  }
};

struct Schedule {
  Shape shape;
  std::vector<std::vector<Action>> programs;  // one per rank

  constexpr Schedule() = default;
  constexpr explicit Schedule(Shape s) : shape(s), programs(static_cast<std::size_t>(s.ranks)) {}

  constexpr int ranks() const { return shape.ranks; }
  friend constexpr bool operator==(const Schedule&, const Schedule&) = default;
  constexpr std::span<const Action> program(int rank) const { return programs[static_cast<std::size_t>(rank)]; }
};

template <int P, int M, int V = 1, StageOrder Order = StageOrder::looped>
struct Table {
  static_assert(P >= 1 && M >= 1 && V >= 1,
                "fived::pipeline::Table: a schedule needs at least one rank, one micro-batch and one chunk per rank");
  static_assert(Order == StageOrder::looped || V == 2,
                "fived::pipeline::Table: a V-shaped (vee) table has exactly two chunks per rank, down the ranks and back");

  static constexpr Shape shape{P, M, V, Order};
  static constexpr int ranks = P, micro_batches = M, chunks = V;
  static constexpr StageOrder order = Order;
  static constexpr int capacity = max_actions_per_rank(M, V);
  static constexpr Packing packing{shape};
  static_assert(packing.fits(),
                "fived::pipeline::Table: 18 x M x V x (P + 1) must fit in an int (a table packs each action in one)");

  // Plain arrays: the proofs index them inside the compiler, where std::array's
  // operator[] is a function call each time. actions[r][i]: rank r's action i, packed.
  int actions[P][capacity]{};
  int sizes[P]{};
  Unpacked unpacked;

  constexpr Table() = default;

  // By hand: one braced list of actions per rank, rank 0 first.
  template <std::size_t... N>
  constexpr Table(const Action (&... program)[N]) {  // implicit: `Table<2, 1> t{{...}, {...}}` reads as data
    static_assert(sizeof...(N) == P, "fived::pipeline::Table: give one braced list of actions per rank (P of them)");
    static_assert(((N <= static_cast<std::size_t>(capacity)) && ...),
                  "fived::pipeline::Table: a rank's program is longer than any valid one "
                  "(at most 7 actions per micro-batch and chunk)");
    int r = 0;
    (copy_in(r++, program, N), ...);
  }

  // The compile-time form of a schedule made at run time.
  constexpr explicit Table(const Schedule& s) {
    if (!(s.shape == shape) || static_cast<int>(s.programs.size()) != P)
      throw std::invalid_argument("fived::pipeline::Table: the schedule's shape is not the table's");
    for (int r = 0; r < P; ++r) {
      const auto& p = s.programs[static_cast<std::size_t>(r)];
      copy_in(r, p.data(), p.size());
    }
  }

  // Rank r's action i, and its whole program.
  constexpr Action action(int r, int i) const { return unpacked.unpack(packing, r, i, actions[r][i]); }
  constexpr std::vector<Action> program(int rank) const {
    std::vector<Action> p(static_cast<std::size_t>(sizes[rank]));
    for (int i = 0; i < sizes[rank]; ++i) p[static_cast<std::size_t>(i)] = action(rank, i);
    return p;
  }

  // Rank r's program to be n actions long, before they are written (what the lowering writes into).
  constexpr void resize_program(int r, int n) {
    if (n > capacity) throw std::invalid_argument("fived::pipeline::Table: a rank's program is longer than any valid one");
    sizes[r] = n;
  }

  friend constexpr bool operator==(const Table& a, const Table& b) {
    for (int r = 0; r < P; ++r) {
      if (a.sizes[r] != b.sizes[r]) return false;
      for (int i = 0; i < a.sizes[r]; ++i)
        if (!(a.action(r, i) == b.action(r, i))) return false;
    }
    return true;
  }

  constexpr Schedule schedule() const {
    Schedule s(shape);
    for (int r = 0; r < P; ++r) s.programs[static_cast<std::size_t>(r)] = program(r);
    return s;
  }

 private:
  constexpr void copy_in(int r, const Action* first, std::size_t n) {
    if (n > static_cast<std::size_t>(capacity))
      throw std::invalid_argument("fived::pipeline::Table: a rank's program is longer than any valid one");
    for (std::size_t i = 0; i < n; ++i) actions[r][i] = unpacked.pack(packing, r, static_cast<int>(i), first[i]);
    sizes[r] = static_cast<int>(n);
  }
};

}  // namespace fived::pipeline
