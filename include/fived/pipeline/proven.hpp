#pragma once
// Proven<S>: the proofs of verify() as static_asserts, one sentence per
// property, and the schedule's numbers as constants.
//
//   using namespace fived::pipeline::notation;
//   struct Mine {
//     static constexpr fived::pipeline::Table<2, 1> table{
//         {F(0), send_act(0, 1), recv_grad(0, 1), B(0)},
//         {recv_act(0, 0), F(0), B(0), send_grad(0, 0)}};
//   };
//   static_assert(fived::pipeline::proven<Mine>);   // or name Proven<Mine> anywhere
//   Proven<Mine>::figures.bubble                    // 0.5: (P-1)/(M+P-1) with P = 2, M = 1
//
// S is any type with a `static constexpr Table<...> table`. Every generated
// schedule type (schedules.hpp) derives from Proven of its table, so using
// one proves it. A failing property stops compilation with its sentence
// (sentences.hpp), and FirstFailure<rank, position, micro_batch, chunk> in
// the same diagnostic says where: the rank, the index in its program (-1 when
// an action is missing), and the stage's micro-batch and chunk.

#include <array>
#include <type_traits>

#include "fived/pipeline/sentences.hpp"
#include "fived/pipeline/simulate.hpp"
#include "fived/pipeline/verify.hpp"

namespace fived::pipeline {

template <int Rank, int Position, int MicroBatch, int Chunk>
struct FirstFailure {
  static_assert(Rank < 0, FIVED_PIPELINE_SAYS_WHERE);
  static constexpr bool value = true;
};

// measure() in fixed-size form, for `static constexpr` use.
template <int P>
struct StaticFigures {
  int makespan = 0, blocking_makespan = 0;  // messages free (eager sends) / blocking sends
  long long idle = 0, rank_time = 0;        // idle and total rank time (P × makespan)
  double bubble = 0, blocking_bubble = 0;   // idle / rank_time, and the same with blocking sends
  std::array<int, P> busy{}, peak_activations{}, peak_pending{}, peak_deferred{};
};

namespace detail {

// The dry run's part of the proof, and the makespans it times.
struct RunProof {
  Verdict verdict;
  int eager_makespan = 0, blocking_makespan = 0;
};

// The dry run under blocking sends, in a state of fixed size.
template <class TableType>
constexpr RunProof prove_run(const TableType& t, const FixedIndex<TableType>& index) {
  FixedRun<TableType> run;
  dry_run(t, index, Cost{}, Sends::blocking, run);
  return {check_run(t, index, run), run.makespan[static_cast<int>(Sends::eager)],
          run.makespan[static_cast<int>(Sends::blocking)]};
}

template <int P, class TableType>
constexpr StaticFigures<P> static_figures(const FixedIndex<TableType>& index, const RunProof& run) {
  if (!run.verdict.ok()) return {};
  Figures f;
  fill_figures(index, P, run.eager_makespan, run.blocking_makespan, Cost{}, f);
  StaticFigures<P> s{f.makespan, f.blocking_makespan, f.idle(), f.rank_time(), f.bubble(), f.blocking_bubble(), {}, {},
                     {},         {}};
  for (std::size_t r = 0; r < P; ++r)
    s.busy[r] = f.busy[r], s.peak_activations[r] = f.peak_activations[r], s.peak_pending[r] = f.peak_pending[r],
    s.peak_deferred[r] = f.peak_deferred[r];
  return s;
}

}  // namespace detail

namespace detail {
// A generator type whose own constraints fail (M < P for 1F1B, ...) has said so
// in its static_assert; its table is then empty and not proven again.
template <class S>
constexpr bool admissible() {
  if constexpr (requires { S::admissible; }) return S::admissible;
  else return true;
}
}  // namespace detail

template <class S>
struct Proven {
  using table_type = std::remove_cvref_t<decltype(S::table)>;
  static constexpr const table_type& table = S::table;
  static constexpr Shape shape = table_type::shape;
  static constexpr int ranks = table_type::ranks, micro_batches = table_type::micro_batches, chunks = table_type::chunks;

  // Three constants, each one constant expression (the compilers limit the work
  // of each): the index, one walk over the actions (where each is, each message's
  // number on its channel, the actions' form and peers: table_index.hpp); the
  // counts, orders and pairing of the slots; then, when those hold, the dry run.
  static constexpr detail::FixedIndex<table_type> index{S::table};
  static constexpr Verdict table_verdict =
      detail::admissible<S>() ? (detail::shape_is_valid(S::table) ? detail::check_table(S::table, index)
                                                                     : Verdict{Property::shape})
                              : Verdict{};
  static constexpr detail::RunProof run =
      detail::admissible<S>() && table_verdict.ok() ? detail::prove_run(S::table, index) : detail::RunProof{};
  static constexpr Verdict verdict = table_verdict.ok() ? run.verdict : table_verdict;

  static_assert(verdict.failed != Property::shape, FIVED_PIPELINE_SAYS_SHAPE);
  static_assert(verdict.failed != Property::well_formed, FIVED_PIPELINE_SAYS_WELL_FORMED);
  static_assert(verdict.failed != Property::one_forward_each, FIVED_PIPELINE_SAYS_ONE_FORWARD_EACH);
  static_assert(verdict.failed != Property::one_backward_each, FIVED_PIPELINE_SAYS_ONE_BACKWARD_EACH);
  static_assert(verdict.failed != Property::forward_before_backward, FIVED_PIPELINE_SAYS_FORWARD_BEFORE_BACKWARD);
  static_assert(verdict.failed != Property::input_grad_before_weight_grad,
                FIVED_PIPELINE_SAYS_INPUT_GRAD_BEFORE_WEIGHT_GRAD);
  static_assert(verdict.failed != Property::peers_are_neighbours, FIVED_PIPELINE_SAYS_PEERS_ARE_NEIGHBOURS);
  static_assert(verdict.failed != Property::one_send_each, FIVED_PIPELINE_SAYS_ONE_SEND_EACH);
  static_assert(verdict.failed != Property::one_receive_each, FIVED_PIPELINE_SAYS_ONE_RECEIVE_EACH);
  static_assert(verdict.failed != Property::sends_after_compute, FIVED_PIPELINE_SAYS_SENDS_AFTER_COMPUTE);
  static_assert(verdict.failed != Property::forward_after_input, FIVED_PIPELINE_SAYS_FORWARD_AFTER_INPUT);
  static_assert(verdict.failed != Property::backward_after_gradient, FIVED_PIPELINE_SAYS_BACKWARD_AFTER_GRADIENT);
  static_assert(verdict.failed != Property::sends_match_receives, FIVED_PIPELINE_SAYS_SENDS_MATCH_RECEIVES);
  static_assert(verdict.failed != Property::no_crossed_sends, FIVED_PIPELINE_SAYS_NO_CROSSED_SENDS);
  static_assert(verdict.failed != Property::progresses, FIVED_PIPELINE_SAYS_PROGRESSES);
  static_assert(FirstFailure<verdict.rank, verdict.position, verdict.mb, verdict.chunk>::value);

  static constexpr bool value = verdict.ok() && detail::admissible<S>();

  // Bubble, makespan and peaks (simulate.hpp), timed by the proof's dry run; computed when first used.
  static constexpr StaticFigures<table_type::ranks> figures = detail::static_figures<table_type::ranks>(index, run);
};

template <class S>
inline constexpr bool proven = Proven<S>::value;

}  // namespace fived::pipeline
