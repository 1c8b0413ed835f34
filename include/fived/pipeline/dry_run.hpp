#pragma once
// Running all ranks' programs together, in a constant expression.
//
// The model is NCCL's blocking point-to-point. A rank runs its program in
// order; a compute action always completes. A comm step (one action, or a
// group: the actions joined by joins_previous) is posted when the rank reaches
// it, and completes when every one of its operations has met its partner — the
// matching receive or send — posted by the peer; the rank waits there until it
// does. Operations of one group progress together, so a group that both sends
// and receives completes even when the peer's matching group is ordered the
// other way round. The partner of a message is found by what it carries (kind,
// micro-batch, stage), and verify() has checked that NCCL's in-order matching
// pairs the same operations.
//
// With durations (Cost) the same run is the timed simulation: a compute action
// takes its cost, a message none. With Sends::eager a send completes as soon as
// it is posted (messages free, the papers' model); with Sends::blocking, when
// its receive is posted too. Without a deadlock the run ends with every rank
// past its last action.

#include <cstddef>
#include <vector>

#include "fived/pipeline/table_index.hpp"

namespace fived::pipeline {

// Durations of the compute actions, in the same unit; messages are free.
// Per chunk: with V chunks a chunk's forward is F (not F / V), so bubble
// fractions compare across V.
struct Cost {
  int forward = 1, backward = 2, input_grad = 1, weight_grad = 1;

  constexpr int of(Op op) const {
    switch (op) {
      case Op::forward: return forward;
      case Op::backward: return backward;
      case Op::input_grad: return input_grad;
      case Op::weight_grad: return weight_grad;
      default: return 0;
    }
  }
};

// How a send completes. blocking: when the receiver has posted its receive
// (NCCL's point-to-point, what the proofs assume). eager: at once, as if
// buffered; the receive still waits for the send. The eager run of a schedule
// is its "messages are free" timing; the blocking run adds the time a sender
// waits for a receiver still busy computing.
enum class Sends : unsigned char { blocking, eager };

struct Run {
  bool finished = false;
  std::vector<int> stopped_at;               // per rank: where it waits (its program's size when it finished)
  std::vector<std::vector<int>> start, end;  // per action; for comm: when posted and when matched; -1: never
  int makespan = 0;                          // end of the last compute action
};

namespace detail {

// One dry run, timed both ways at once. The ranks advance as the `drive` sends
// allow; every action also gets its time with eager sends, and with blocking
// sends when those drive (an action reached under blocking sends has had all
// it waits for under eager sends happen before it too, so one pass serves
// both). Its state: FixedRun<Table> (arrays of fixed size, for Proven<>) or
// DryRun (sized at run time), with the same members:
//   finished                            every rank reached the end of its program
//   at[r]                               the action rank r runs next, or waits in (its program's size: finished)
//   reached[r]                          every action before this one has started (compute) or is posted (comm)
//   posted_blocking[k], posted_eager[k] when action k started or was posted (numbered as the index numbers them);
//                                       for compute actions only where times_computes (execute() reports them;
//                                       the proofs and the figures read only the messages' times)
//   makespan[Sends]                     the end of the last compute action
//   clock_*[r], awaits[r], awaited_rank[r]  each rank's clocks, and the partner it waits for (-1: none)
template <class TableType>
struct FixedRun {
  static constexpr int P = TableType::ranks, actions = P * TableType::capacity;
  static constexpr bool times_computes = false;
  bool finished = true;
  int at[P]{}, reached[P]{}, clock_blocking[P]{}, clock_eager[P]{}, awaits[P]{}, awaited_rank[P]{};
  int posted_blocking[actions]{}, posted_eager[actions]{};
  int makespan[2]{};
};

struct DryRun {
  bool times_computes = false;
  bool finished = true;
  Scratch<int> at, reached, clock_blocking, clock_eager, awaits, awaited_rank, posted_blocking, posted_eager;
  int makespan[2]{};

  constexpr DryRun(int ranks, int actions)
      : at(ranks, 0),
        reached(ranks, 0),
        clock_blocking(ranks, 0),
        clock_eager(ranks, 0),
        awaits(ranks),
        awaited_rank(ranks, 0),
        posted_blocking(actions),
        posted_eager(actions) {}
};

// Table t, its index ix (table_index.hpp), the state to run in.
template <class Rows, class Ix, class State>
constexpr void dry_run(const Rows& t, const Ix& ix, Cost cost, Sends drive, State& run) {
  static_assert(static_cast<int>(Sends::blocking) == 0 && static_cast<int>(Sends::eager) == 1);
  const int P = t.shape.ranks, rank_keys = kinds * t.shape.chunks * t.shape.micro_batches;
  const bool sends_wait = drive == Sends::blocking, times_computes = run.times_computes;
  int cost_of[9] = {};
  int r = 0, step = 0, i = 0, first = 0, n = 0, base = 0, end = 0, j = 0, k = 0, q = 0, took = 0, now_b = 0,
      now_e = 0, met_b = 0, met_e = 0, op = 0, key = 0;
  bool progressed = true, down = true, send = false, waits = false, posting = false;
  for (k = 0; k < 9; ++k) cost_of[k] = cost.of(static_cast<Op>(k));
  for (r = 0; r < P; ++r) run.awaits[r] = -1;
  // Sweeps down the ranks and back up, in turn: a chain of waits that runs either
  // way along the ranks then resolves in one sweep, so the sweeps are as many as the
  // chains' turns, not as their length times P.
  // A rank that waits skips the sweep until the partner it waits for is posted.
  // (Clang limits the statements a constant runs, not the operations: the loops
  // below run one statement per action, and a rank's turn a few.)
  for (; progressed; down = !down) {
    progressed = false;
    for (step = 0; step < P; ++step) {
      r = down ? step : P - 1 - step;
      if (run.awaits[r] >= 0 && run.awaits[r] - ix.offset[run.awaited_rank[r]] >= run.reached[run.awaited_rank[r]])
        continue;
      base = ix.offset[r], n = t.sizes[r], now_b = run.clock_blocking[r], now_e = run.clock_eager[r], i = run.at[r];
      while (i < n) {
        // A run of compute actions, each starting as the one before it ends.
        for (first = i; i < n && (op = t.actions[r][i] % 9) < 5; ++i)
          (void)(times_computes && (run.posted_blocking[base + i] = now_b, run.posted_eager[base + i] = now_e, true)),
          took = cost_of[op], now_b += took, now_e += took;
        (void)(i > first && (run.reached[r] = i, progressed = true,
                             run.makespan[0] = now_b > run.makespan[0] ? now_b : run.makespan[0],
                             run.makespan[1] = now_e > run.makespan[1] ? now_e : run.makespan[1], true));
        if (i == n) break;
        // A comm group: this action and those joined to it, all posted when the rank first reaches it.
        // On a later turn it is posted, and the rank has reached its end: nothing is read again.
        for (end = run.reached[r] > i ? run.reached[r] : i, posting = end == i;
             posting && end < n &&
             (end == i || t.actions[r][end] % 18 >= 14);  // joined (+ 9) and comm (op 5 to 8)
             ++end)
          run.posted_blocking[base + end] = now_b, run.posted_eager[base + end] = now_e;
        (void)(posting && (run.reached[r] = end, progressed = true));
        // Complete when every partner has posted (with eager sends: every receive's partner);
        // a partner that does not exist is never posted. The partner (k, on rank q; -1: none) is
        // found as partner() finds it, written out: a call would cost Clang several statements
        // per message, and the dry run of a 57,000-action table would pass its limit.
        for (j = i, met_b = now_b, met_e = now_e;
             j < end && (key = ix.meets[base + j], q = key < 0 ? r : key / rank_keys,
                        k = key < 0 ? -1 : ix.first[key] - 1, k = k < 0 ? -1 : ix.offset[q] + k,
                        send = (op = t.actions[r][j] % 9) == 5 || op == 7, waits = !send || sends_wait,
                        !waits || (k >= 0 && k - ix.offset[q] < run.reached[q]));
             ++j)
          met_b = waits && run.posted_blocking[k] > met_b ? run.posted_blocking[k] : met_b,
          met_e = waits && !send && run.posted_eager[k] > met_e ? run.posted_eager[k] : met_e;
        if (j < end) {
          run.awaits[r] = k >= 0 ? k : 1 << 30, run.awaited_rank[r] = k >= 0 ? q : r;
          break;
        }
        now_b = met_b, now_e = met_e, i = end, run.awaits[r] = -1;
      }
      run.clock_blocking[r] = now_b, run.clock_eager[r] = now_e, run.at[r] = i;
    }
  }
  for (r = 0; r < P; ++r) run.finished = run.finished && run.at[r] == t.sizes[r];
}

// Whether the partner of comm action i of rank r has been posted in the run.
template <class Rows, class Ix, class State>
constexpr bool partner_posted(const Rows& t, const Ix& ix, const State& run, int r, int i) {
  int q = 0;
  const int k = partner(t.shape, ix, ix.offset[r] + i, &q);
  return k != 0 && k - 1 - ix.offset[q] < run.reached[q];
}

// When comm action i of rank r completes in the run: when its partner met it
// (blocking), or when it was posted (a send, eager) or its send was (a receive,
// eager); -1: never.
template <class Rows, class Ix, class State>
constexpr int completed(const Rows& t, const Ix& ix, const State& run, Sends sends, int r, int i) {
  const int k = ix.offset[r] + i;
  if (i >= run.reached[r]) return -1;
  const auto& posted = sends == Sends::blocking ? run.posted_blocking : run.posted_eager;
  if (sends == Sends::eager && is_send(t.action(r, i).op)) return posted[k];
  if (!partner_posted(t, ix, run, r, i)) return -1;
  int q = 0;
  const int theirs = posted[partner(t.shape, ix, ix.offset[r] + i, &q) - 1];
  return theirs > posted[k] ? theirs : posted[k];
}

}  // namespace detail

// The dry run of all ranks with durations: when each action starts and ends.
template <class S>
constexpr Run execute(const S& s, Cost cost = {}, Sends sends = Sends::blocking) {
  const auto& t = detail::rows_of(s);
  const detail::Index ix(t);
  detail::DryRun run(t.shape.ranks, ix.offset[t.shape.ranks]);
  run.times_computes = true;
  detail::dry_run(t, ix, cost, sends, run);
  const auto& posted = sends == Sends::blocking ? run.posted_blocking : run.posted_eager;
  Run out{run.finished, {}, {}, {}, run.makespan[static_cast<int>(sends)]};
  for (int r = 0; r < t.shape.ranks; ++r) {
    out.stopped_at.push_back(run.at[r]);
    auto& start = out.start.emplace_back(static_cast<std::size_t>(t.sizes[r]), -1);
    auto& end = out.end.emplace_back(static_cast<std::size_t>(t.sizes[r]), -1);
    for (int i = 0; i < run.reached[r]; ++i) {
      const Op op = t.action(r, i).op;
      start[static_cast<std::size_t>(i)] = posted[ix.offset[r] + i];
      end[static_cast<std::size_t>(i)] = is_comm(op) ? detail::completed(t, ix, run, sends, r, i)
                                                     : start[static_cast<std::size_t>(i)] + cost.of(op);
    }
  }
  return out;
}

struct Place {
  int rank = -1, index = -1;
};

namespace detail {

// After a deadlocked run: a rank that waits in a send to a peer which itself
// waits in a send back to it, neither receive posted (the crossed-sends
// deadlock of blocking point-to-point). Its place, or {-1, -1}.
template <class Rows, class Ix, class State>
constexpr Place crossed_sends(const Rows& t, const Ix& ix, const State& run) {
  auto waiting_send_to = [&](int r, int q) {
    const int i = run.at[r], n = t.sizes[r];
    if (i >= n || !is_comm(t.action(r, i).op)) return -1;
    for (int j = i; j < n && (j == i || (t.action(r, j).joins_previous && is_comm(t.action(r, j).op))); ++j)
      if (is_send(t.action(r, j).op) && t.action(r, j).peer == q && !partner_posted(t, ix, run, r, j)) return j;
    return -1;
  };
  for (int r = 0; r < t.shape.ranks; ++r)
    for (int q = 0; q < t.shape.ranks; ++q)
      if (q != r && waiting_send_to(r, q) >= 0 && waiting_send_to(q, r) >= 0) return {r, waiting_send_to(r, q)};
  return {};
}

}  // namespace detail

}  // namespace fived::pipeline
