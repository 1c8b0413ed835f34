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
// How an executor walks rank r's program: a step is one compute action, or a
// run of comm actions issued as one NCCL group (each after the first has
// joins_previous):
//
//   const auto program = table.program(r);
//   for (int i = 0; i < int(program.size()); i = step_end(program, i))
//     if (is_comm(program[i].op)) issue_as_one_group(program.subspan(i, step_end(program, i) - i));
//     else run(program[i]);

#include <array>
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

  // Plain arrays: the proofs index them inside the compiler, where std::array's
  // operator[] is a function call each time.
  Action actions[P][capacity]{};
  int sizes[P]{};

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

  constexpr std::span<const Action> program(int rank) const {
    return {actions[rank], static_cast<std::size_t>(sizes[rank])};
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
        if (!(a.actions[r][i] == b.actions[r][i])) return false;
    }
    return true;
  }

  constexpr Schedule schedule() const {
    Schedule s(shape);
    for (int r = 0; r < P; ++r) {
      const auto p = program(r);
      s.programs[static_cast<std::size_t>(r)].assign(p.begin(), p.end());
    }
    return s;
  }

 private:
  constexpr void copy_in(int r, const Action* first, std::size_t n) {
    if (n > static_cast<std::size_t>(capacity))
      throw std::invalid_argument("fived::pipeline::Table: a rank's program is longer than any valid one");
    for (std::size_t i = 0; i < n; ++i) actions[r][i] = first[i];
    sizes[r] = static_cast<int>(n);
  }
};

}  // namespace fived::pipeline
