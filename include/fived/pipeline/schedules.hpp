#pragma once
// The schedules as types: a proven compile-time table per (P, M[, V]).
//
//   using sched = fived::pipeline::OneFOneB</*P=*/4, /*M=*/8>;
//   sched::table.program(rank)      // what rank `rank` runs, in order (table.hpp)
//   sched::figures.bubble           // 3/11 (simulate.hpp, proven.hpp)
//
// Each type checks its generator's constraints with a sentence, then derives
// from Proven<> of its table, so naming it runs every proof at compile time.

#include "fived/pipeline/generators.hpp"
#include "fived/pipeline/proven.hpp"
#include "fived/pipeline/sentences.hpp"

namespace fived::pipeline {

namespace detail {

// Each table is made in two constants (lower.hpp): the generator's compute
// orders with their timeline, then the table with its messages.
template <class TableType, Generator G, Cost C = Cost{}>
constexpr TimedOrders<TableType> timed_orders() {
  return TimedOrders<TableType>([](auto& o) { generate(G, o); }, C);
}

template <int P, int M>
struct GPipeTable {
  static constexpr bool admissible = P >= 1 && M >= 1;
  static_assert(admissible, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  using table_type = Table<(P >= 1 ? P : 1), (M >= 1 ? M : 1)>;
  static constexpr TimedOrders<table_type> timed =
      admissible ? timed_orders<table_type, Generator::gpipe>() : TimedOrders<table_type>{};
  static constexpr table_type table = lowered(timed);
};

// The one-chunk schedules that warm up with P-1-r forwards on rank r (1F1B, ZB-H1), one
// table type over their generator; the messages placed for costs C (lower.hpp).
template <int P, int M, Generator G, Cost C = Cost{}>
struct WarmUpTable {
  static constexpr bool admissible = P >= 1 && M >= P;
  static_assert(P >= 1, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  static_assert(M >= P, FIVED_PIPELINE_SAYS_1F1B_NEEDS_M_GE_P);
  using table_type = Table<(P >= 1 ? P : 1), (M >= 1 ? M : 1)>;
  static constexpr TimedOrders<table_type> timed =
      admissible ? timed_orders<table_type, G, C>() : TimedOrders<table_type>{};
  static constexpr table_type table = lowered(timed);
};

template <int P, int M, int V>
struct Interleaved1F1BTable {
  static constexpr bool admissible = P >= 1 && M >= 1 && V >= 2 && M % P == 0;
  static_assert(P >= 1 && M >= 1, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  static_assert(V >= 2, FIVED_PIPELINE_SAYS_INTERLEAVED_NEEDS_CHUNKS);
  static_assert(P < 1 || M % P == 0, FIVED_PIPELINE_SAYS_INTERLEAVED_NEEDS_ROUNDS);
  using table_type = Table<(P >= 1 ? P : 1), (M >= 1 ? M : 1), (V >= 1 ? V : 1)>;
  static constexpr TimedOrders<table_type> timed =
      admissible ? timed_orders<table_type, Generator::interleaved_1f1b>() : TimedOrders<table_type>{};
  static constexpr table_type table = lowered(timed);
};

// The V-shaped schedules (two chunks per rank, the stages down the ranks and back up),
// one table type over their generator; the messages placed for costs C.
template <int P, int M, Generator G, Cost C = Cost{}>
struct VeeTable {
  static constexpr bool admissible = P >= 1 && M >= 2 * P;
  static_assert(P >= 1, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  static_assert(M >= 2 * P, FIVED_PIPELINE_SAYS_V_NEEDS_M_GE_2P);
  using table_type = Table<(P >= 1 ? P : 1), (M >= 1 ? M : 1), 2, StageOrder::vee>;
  static constexpr TimedOrders<table_type> timed =
      admissible ? timed_orders<table_type, G, C>() : TimedOrders<table_type>{};
  static constexpr table_type table = lowered(timed);
};

}  // namespace detail

// All forwards, then all backwards.
template <int P, int M>
struct GPipe : Proven<detail::GPipeTable<P, M>> {};

// PipeDream-flush / Megatron 1F1B; needs M >= P.
template <int P, int M>
struct OneFOneB : Proven<detail::WarmUpTable<P, M, Generator::one_f_one_b>> {};

// Megatron's interleaved 1F1B with V chunks per rank; needs V >= 2 and M a multiple of P.
template <int P, int M, int V>
struct Interleaved1F1B : Proven<detail::Interleaved1F1BTable<P, M, V>> {};

// The zero-bubble schedules take the costs of F, B, I and W (C, per chunk, any unit) their
// messages are placed for: each receive goes where the order, run at those costs, waits for
// it (lower.hpp). The default is the tables' unit costs, I = W = F. A model whose input half
// costs more than its weight half (attention's backward is all I) waits at receives placed
// for unit costs, before W's it could have run, and loses the gain (bench/pipeline: on GPT-2
// stages ZB-H1 idles 15% at PP 2, M 8, with unit-cost messages, 7% with its own, 1F1B 11%):
//   using sched = ZBH1<4, 8, Cost{.forward = 29, .backward = 57, .input_grad = 40, .weight_grad = 17}>;

// Zero bubble H1: 1F1B's memory, W's moved into the cool-down; needs M >= P.
template <int P, int M, Cost C = Cost{}>
struct ZBH1 : Proven<detail::WarmUpTable<P, M, Generator::zb_h1, C>> {};

// ZB-V: two chunks per rank in a V; needs M >= 2P.
template <int P, int M, Cost C = Cost{}>
struct ZBV : Proven<detail::VeeTable<P, M, Generator::zb_v, C>> {};

// DualPipeV (DeepSeek-V3): two chunks per rank in a V, forwards and backwards of the two
// chunks paired through the steady state, W's split off at the ends; needs M >= 2P.
template <int P, int M, Cost C = Cost{}>
struct DualPipeV : Proven<detail::VeeTable<P, M, Generator::dualpipe_v, C>> {};

}  // namespace fived::pipeline
