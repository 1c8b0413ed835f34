#pragma once
// Plan<Model, Layout>: before the first step, what a run costs each GPU, at compile time.
//
//   using P = fived::plan::Plan<fived::plan::llama3_405b, llama_run>;   // plan/layout.hpp
//   P::memory.total()          // bytes on the fullest GPU (the pipeline rank that needs most)
//   P::memory.parameters ...   // its parts (plan/memory.hpp)
//   P::traffic.tp.all_gather   // {calls, bytes} per step, busiest pipeline rank (plan/comm.hpp)
//   P::bubble                  // the schedule's idle share (pipeline/simulate.hpp)
//   static_assert(fived::plan::fits<P>(80ull << 30));                   // plan/fits.hpp
//
// A pipeline rank holds V parts of the model (its chunks: pipeline/stages.hpp); each part is
// laid out as one decoder part is (a dense buffer and an expert buffer, cut into buckets by
// BucketPlan), trained by a DataParallel of its own, and keeps one activation slot per
// micro-batch in flight. Everything is computed for every pipeline rank (by_rank,
// traffic_by_rank); `memory` is the rank that needs most, `traffic` the largest tally of any
// rank, kind by kind. The peak of activations is the schedule's own count of (micro-batch,
// chunk) pairs held at once on that rank (measure()'s peak_pending: from F to the end of the
// backward, or of W when it is split) times the largest chunk's slot: exact for one chunk per
// rank or equal chunks, an upper bound otherwise; a split backward adds one tape of snapshots
// per pair awaiting W (peak_deferred, nn/weight_grads.hpp). (The executor,
// pipeline/executor.hpp, sizes slots per chunk and keeps one until its d(input) has been
// sent, which can hold a slot a little longer than the schedule's count.)

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "fived/plan/activations.hpp"
#include "fived/plan/comm.hpp"
#include "fived/plan/layout.hpp"
#include "fived/plan/memory.hpp"
#include "fived/plan/model.hpp"

namespace fived::plan {

template <Transformer Model, class Layout>
struct Plan : Setup<Model, Layout> {
  using setup = Setup<Model, Layout>;
  using typename setup::schedule;
  static constexpr Transformer model = Model;
  static constexpr int tp = setup::tp, ep = setup::ep, grad = setup::grad, edp = setup::edp, t = setup::t;
  static constexpr int zero = setup::zero, P = setup::P, M = setup::M, V = setup::V, parts = setup::parts;
  static constexpr std::size_t bucket_bytes = setup::bucket_bytes;
  static constexpr Rows rows = setup::rows;
  static constexpr pipeline::Shape shape = setup::shape;

  // The buffers of part p as DataParallel sees them: dense over DP x CP, experts over the
  // expert-data group (without ZeRO where it has one rank, as DataParallel does).
  template <int p>
  using dense_layout = UnitLayout<Model, tp, ep, setup::part(p), false>;
  template <int p>
  using expert_layout = UnitLayout<Model, tp, ep, setup::part(p), true>;
  static constexpr int expert_zero = edp > 1 ? zero : 0;
  template <int p>
  using dense_buckets = BucketPlan<dense_layout<p>, grad, static_cast<std::size_t>(t), bucket_bytes>;
  template <int p>
  using expert_buckets = BucketPlan<expert_layout<p>, edp, static_cast<std::size_t>(t), bucket_bytes>;

 private:
  template <int p>
  static constexpr State state_of() {
    State s = buffer_state<dense_layout<p>, grad, t, bucket_bytes>(zero);
    if constexpr (setup::has_experts(p)) s += buffer_state<expert_layout<p>, edp, t, bucket_bytes>(expert_zero);
    return s;
  }
  template <int p>
  static constexpr Traffic traffic_of() {
    Traffic r = layer_traffic(Model, setup::part(p), rows, M);
    r.grad = data_parallel_traffic<dense_buckets<p>>(zero, M, t);
    if constexpr (setup::has_experts(p)) r.expert_data = data_parallel_traffic<expert_buckets<p>>(expert_zero, M, t);
    return r;
  }

 public:
  // Per part: the training state and the TP/CP/EP/DP traffic of its buffers.
  static constexpr std::array<State, parts> part_state = []<int... p>(std::integer_sequence<int, p...>) {
    return std::array<State, parts>{state_of<p>()...};
  }(std::make_integer_sequence<int, parts>{});
  static constexpr std::array<Traffic, parts> part_traffic = []<int... p>(std::integer_sequence<int, p...>) {
    return std::array<Traffic, parts>{traffic_of<p>()...};
  }(std::make_integer_sequence<int, parts>{});

  // Elements of the tied tensor's gradient a pipeline rank swaps with the other stage that holds
  // it (pipeline/tied_grads.hpp): what the first rank of the group owns of it (all of it
  // without ZeRO) on the first and on the last stage, when they are different ranks; 0 elsewhere.
  static constexpr std::int64_t tied_swap_elements(int rank) {
    using BP = dense_buckets<0>;
    const int first = shape.rank_of(0), last = shape.rank_of(shape.stages() - 1);
    if (BP::tied.empty() || first == last || (rank != first && rank != last)) return 0;
    std::int64_t n = 0;
    for (std::size_t i = 0; i < BP::count; ++i)
      if (BP::tied.contains(BP::bucket(i).range))
        n += static_cast<std::int64_t>(zero == 0 ? BP::bucket(i).range.size() : BP::owned(i, 0).size());
    return n;
  }

  // The bytes a pipeline rank needs.
  static constexpr Memory memory_of(int rank) {
    Memory m;
    for (int c = 0; c < V; ++c) {
      const int p = shape.stage(rank, c);
      const Blocks part = setup::part(p);
      const State& s = part_state[static_cast<std::size_t>(p)];
      m.parameters += s.parameters, m.gradients += s.gradients, m.optimizer += s.optimizer, m.staging += s.staging;
      m.transient += s.transient;
      m.activations = std::max(m.activations, slot_bytes(Model, part, rows));
      m.deferred = std::max(m.deferred, deferred_bytes(Model, part, rows));
      m.recompute += recompute_bytes(Model, part, rows);
      m.work += work_bytes(Model, part, rows);
    }
    m.in_flight = schedule::figures.peak_pending[static_cast<std::size_t>(rank)];
    m.peak_activations = m.activations * static_cast<Bytes>(m.in_flight);
    m.awaiting_w = schedule::figures.peak_deferred[static_cast<std::size_t>(rank)];
    m.peak_deferred = m.deferred * static_cast<Bytes>(m.awaiting_w);
    if (P > 1)  // the executor's received gradient and kept d(input) per slot, [n, C] each
      m.work += 2 * static_cast<Bytes>(m.in_flight) * static_cast<Bytes>(rows.n * Model.d_model * t);
    m.work += static_cast<Bytes>(tied_swap_elements(rank)) * t;  // the other stage's pieces, received
    return m;
  }
  // What a pipeline rank issues in one step.
  static constexpr Traffic traffic_of_rank(int rank) {
    Traffic r;
    for (int c = 0; c < V; ++c) {
      const int p = shape.stage(rank, c);
      r += part_traffic[static_cast<std::size_t>(p)];
      r += chunk_scalars(Model, setup::part(p), rows, grad, edp, zero, expert_zero);
    }
    r.pp = pipeline_traffic(schedule::table.program(rank), rows.n * Model.d_model * t);
    if (const std::int64_t n = tied_swap_elements(rank); n > 0) detail::tally(r.pp.send_recv, 1, n * t);
    r += step_scalars(grad, P);
    return r;
  }

  static constexpr std::array<Memory, P> by_rank = [] {
    std::array<Memory, P> a{};
    for (int r = 0; r < P; ++r) a[static_cast<std::size_t>(r)] = memory_of(r);
    return a;
  }();
  static constexpr std::array<Traffic, P> traffic_by_rank = [] {
    std::array<Traffic, P> a{};
    for (int r = 0; r < P; ++r) a[static_cast<std::size_t>(r)] = traffic_of_rank(r);
    return a;
  }();

  // The pipeline rank that needs the most memory, and its figures.
  static constexpr int fullest_rank = [] {
    int w = 0;
    for (int r = 1; r < P; ++r)
      if (by_rank[static_cast<std::size_t>(r)].total() > by_rank[static_cast<std::size_t>(w)].total()) w = r;
    return w;
  }();
  static constexpr Memory memory = by_rank[static_cast<std::size_t>(fullest_rank)];
  // The largest calls and bytes of any pipeline rank, per group and kind.
  static constexpr Traffic traffic = [] {
    Traffic m;
    for (const Traffic& r : traffic_by_rank) m.keep_max(r);
    return m;
  }();
  // The schedule's idle share under F = 1, B = 2 (pipeline/simulate.hpp): (P-1)/(M+P-1) for 1F1B.
  static constexpr double bubble = schedule::figures.bubble;
};

}  // namespace fived::plan
