#pragma once
// The numbers a planner and a visualizer read off a schedule.
//
//   simulate(s, cost, sends)   the timed dry run (dry_run.hpp): when every action runs
//   measure(s, cost)           makespan, busy time, bubble, peak activations per rank
//
// The bubble is the idle share of P ranks × makespan under Cost (F = 1, B = 2,
// I = W = 1 by default, per chunk) with free messages: a receive completes when
// its send is posted, a send at once (Sends::eager). `blocking_bubble` runs the
// same table with blocking sends, as an executor that waits for every comm
// group to complete does: a sender then also waits for its receiver to post.
//
// Peak activations count (micro-batch, chunk) pairs a rank holds: from the
// start of the pair's F until the end of its B or, for split backwards, its I.
// After I only what W needs stays (the inputs and output gradients of the
// chunk's matrix products, a part of its activations); `peak_pending` counts
// until the end of W instead, and `peak_deferred` the pairs between the end of
// their I and the end of their W (a model keeps one tape of snapshots for each:
// nn/weight_grads.hpp). A chunk holds 1/V of the rank's layers: divide by
// V to compare with a one-chunk schedule in micro-batches of a whole stage.
// Both depend on the order alone, not on the cost model.
//
// What the generators give (rank 0's peaks; tests/test_schedule.cpp checks the
// closed forms for every P <= 8, M in P..4P, V <= 4):
//
//   schedule     P   M V   bubble   blocking  peak  to W   closed form of the bubble
//   GPipe        4   8 1    27.3%    27.3%     8     8     (P-1)/(M+P-1)
//   1F1B         4   8 1    27.3%    27.3%     4     4     (P-1)/(M+P-1)
//   interleaved  4   8 2    15.8%    15.8%    11    11     (P-1)/(V·M+P-1)
//   interleaved  4   8 4     8.6%     8.6%    19    19
//   ZB-H1        4   8 1    11.1%    11.1%     4     4     (P-1)/(3M+P-1)
//   ZB-V         4   8 2     5.9%     5.9%     8     8     (P-1)/(6M+P-1)
//   1F1B         8  32 1    17.9%    17.9%     8     8
//   interleaved  8  32 2     9.9%    23.8%    23    23
//   interleaved  8  32 4     5.2%    22.0%    39    39
//   ZB-H1        8  32 1     6.8%     6.8%     8     8
//   ZB-V         8  32 2     3.5%     3.5%    16    16
//
// ZB-H1's and ZB-V's bubbles are the ramp-up alone: rank P-1 cannot start
// before P-1 units and then never waits; ZB-H1 keeps 1F1B's peak, ZB-V holds
// 2P chunk pairs = P whole stages, 1F1B's rank-0 peak, on every rank. Blocking
// sends cost nothing except for interleaving, where some P (2, 5, 8 up to 8)
// leave a sender in a send while its receiver is in a B: an executor that
// wants Megatron's interleaved bubble lets sends complete in the background.

#include <vector>

#include "fived/pipeline/dry_run.hpp"

namespace fived::pipeline {

template <class S>
constexpr Run simulate(const S& s, Cost cost = {}, Sends sends = Sends::eager) {
  return execute(s, cost, sends);
}

struct Figures {
  int ranks = 0;
  int makespan = 0;                   // when the last compute action ends, messages free (eager sends)
  int blocking_makespan = 0;          // the same with blocking sends
  std::vector<int> busy;              // per rank: time spent computing
  std::vector<int> peak_activations;  // per rank: most pairs between F and the end of B or I
  std::vector<int> peak_pending;      // per rank: most pairs between F and the end of B or W
  std::vector<int> peak_deferred;     // per rank: most pairs between the end of I and the end of W

  constexpr long long rank_time() const { return static_cast<long long>(ranks) * makespan; }
  constexpr long long idle() const {
    long long sum = 0;
    for (int b : busy) sum += b;
    return rank_time() - sum;
  }
  constexpr double bubble() const {
    return rank_time() == 0 ? 0.0 : static_cast<double>(idle()) / static_cast<double>(rank_time());
  }
  constexpr double blocking_bubble() const {
    const long long t = static_cast<long long>(ranks) * blocking_makespan;
    return t == 0 ? 0.0 : static_cast<double>(t - (rank_time() - idle())) / static_cast<double>(t);
  }
  constexpr int max_peak_activations() const {
    int m = 0;
    for (int p : peak_activations) m = p > m ? p : m;
    return m;
  }
};

namespace detail {

// The figures of a table from its index (the per-rank counts and peaks of its one
// walk, table_index.hpp) and the makespans of its dry run.
template <class Ix>
constexpr void fill_figures(const Ix& ix, int ranks, int eager_makespan, int blocking_makespan, Cost cost,
                            Figures& out) {
  out.ranks = ranks, out.makespan = eager_makespan, out.blocking_makespan = blocking_makespan;
  for (int r = 0; r < ranks; ++r) {
    out.busy.push_back(ix.computes[r * 4] * cost.forward + ix.computes[r * 4 + 1] * cost.backward +
                       ix.computes[r * 4 + 2] * cost.input_grad + ix.computes[r * 4 + 3] * cost.weight_grad);
    out.peak_activations.push_back(ix.peak_activations[r]), out.peak_pending.push_back(ix.peak_pending[r]);
    out.peak_deferred.push_back(ix.peak_deferred[r]);
  }
}

}  // namespace detail

// For a verified schedule (the timing of one that deadlocks stops where it does).
template <class S>
constexpr Figures measure(const S& s, Cost cost = {}) {
  const auto& t = detail::rows_of(s);
  const detail::Index ix(t);
  detail::DryRun run(t.shape.ranks, ix.offset[t.shape.ranks]);
  detail::dry_run(t, ix, cost, Sends::blocking, run);
  Figures f;
  detail::fill_figures(ix, t.shape.ranks, run.makespan[static_cast<int>(Sends::eager)],
                       run.makespan[static_cast<int>(Sends::blocking)], cost, f);
  return f;
}

}  // namespace fived::pipeline
