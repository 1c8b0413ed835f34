#pragma once
// with_messages(shape, compute): from each rank's order of compute actions to
// a full schedule, the sends and receives placed where an executor issues them.
//
// The compute orders are first run as a dataflow (each action as early as its
// rank and its inputs allow, under Cost, messages free): the ideal timeline.
// Then each message that crosses ranks is posted on both ranks at the earliest
// moment after it exists at which both sit between two computes (before its
// consumer starts), so a blocking exchange delays neither; where there is no
// such moment, the send goes right after its producer and the receive just
// before the first compute that starts after the message exists (a blocking
// executor then waits there; see simulate.hpp).
//
// Everything a rank posts between two of its computes is one NCCL group, in
// the order the messages came to exist. So a send that crosses a receive from
// the same peer is issued with it (Megatron's send_forward_recv_backward, found
// rather than spelled out), and the receives from one rank come in the order
// that rank sent them, which NCCL's in-order matching needs. verify() proves
// the result; generators only propose.

#include <stdexcept>
#include <utility>
#include <vector>

#include "fived/pipeline/dry_run.hpp"

namespace fived::pipeline {

namespace detail {

// Start and end times of each rank's compute actions, run as a dataflow.
struct Timeline {
  std::vector<std::vector<int>> start, end;
};

constexpr Timeline ideal_timeline(const Shape& sh, const std::vector<std::vector<Action>>& compute, Cost cost) {
  const int P = sh.ranks;
  const auto slots = static_cast<std::size_t>(sh.ranks * sh.chunks * sh.micro_batches);
  auto slot = [&](int r, int c, int m) { return static_cast<std::size_t>((r * sh.chunks + c) * sh.micro_batches + m); };
  std::vector<int> forward_end(slots, -1), input_grad_end(slots, -1), weight_input_end(slots, -1);
  Timeline t;
  std::vector<int> pc(static_cast<std::size_t>(P), 0), clock(static_cast<std::size_t>(P), 0);
  for (int r = 0; r < P; ++r) {
    t.start.emplace_back(compute[static_cast<std::size_t>(r)].size(), -1);
    t.end.emplace_back(compute[static_cast<std::size_t>(r)].size(), -1);
  }
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < P; ++r) {
      const auto& order = compute[static_cast<std::size_t>(r)];
      auto& i = pc[static_cast<std::size_t>(r)];
      auto& now = clock[static_cast<std::size_t>(r)];
      while (i < static_cast<int>(order.size())) {
        const Action& a = order[static_cast<std::size_t>(i)];
        const int st = sh.stage(r, a.chunk);
        int ready = now;
        auto after = [&](int at) {
          if (at < 0) return false;
          ready = at > ready ? at : ready;
          return true;
        };
        bool inputs = true;
        if (a.op == Op::forward) {
          if (st > 0) inputs = after(forward_end[slot(sh.rank_of(st - 1), sh.chunk_of(st - 1), a.mb)]);
        } else if (a.op == Op::weight_grad) {
          inputs = after(weight_input_end[slot(r, a.chunk, a.mb)]);
        } else {
          inputs = after(forward_end[slot(r, a.chunk, a.mb)]);
          if (st + 1 < sh.stages())
            inputs = inputs && after(input_grad_end[slot(sh.rank_of(st + 1), sh.chunk_of(st + 1), a.mb)]);
        }
        if (!inputs) break;
        t.start[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)] = ready;
        now = ready + cost.of(a.op);
        t.end[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)] = now;
        const auto k = slot(r, a.chunk, a.mb);
        if (a.op == Op::forward) forward_end[k] = now;
        if (makes_input_grad(a.op)) input_grad_end[k] = now;
        if (a.op == Op::input_grad) weight_input_end[k] = now;
        ++i, progressed = true;
      }
    }
  }
  for (int r = 0; r < P; ++r)
    if (pc[static_cast<std::size_t>(r)] < static_cast<int>(compute[static_cast<std::size_t>(r)].size()))
      throw std::logic_error("fived::pipeline: a generator's compute order waits for itself");
  return t;
}

// A message placed between two computes on both of its ranks.
struct Placed {
  int rank = 0, gap = 0;   // posted by `rank` just before its compute action number `gap`
  int sent = 0, peer = 0;  // when the message exists (the producer's end), and the rank on the other end
  Action action;

  // Per rank and gap, in the order the messages came to exist; one sender's messages thus stay in its order.
  friend constexpr bool operator<(const Placed& a, const Placed& b) {
    if (a.rank != b.rank) return a.rank < b.rank;
    if (a.gap != b.gap) return a.gap < b.gap;
    if (a.sent != b.sent) return a.sent < b.sent;
    return a.peer < b.peer;
  }
};

// Gap k of a rank is the time between its compute k-1 and compute k: the
// window [end of k-1, start of k] in which it can post a comm group without
// delaying either (gap 0 opens at 0, the last gap never closes).
struct Gaps {
  const std::vector<int>& start;
  const std::vector<int>& end;
  constexpr int count() const { return static_cast<int>(start.size()) + 1; }
  constexpr int open(int k) const { return k == 0 ? 0 : end[static_cast<std::size_t>(k - 1)]; }
  constexpr int close(int k) const {
    return k == static_cast<int>(start.size()) ? 1 << 30 : start[static_cast<std::size_t>(k)];
  }
};

// The gaps (k on the sender, l on the receiver) where a message sent at
// `sent` by the sender's compute j and consumed by the receiver's compute c
// is posted: the earliest moment both ranks are between computes, so the
// blocking exchange delays neither; if there is none before the consumer
// starts, right after the producer and just before the first compute that
// starts after the message exists.
constexpr std::pair<int, int> meeting(const Gaps& sender, int j, const Gaps& receiver, int c, int sent) {
  // The receiver's first gap that closes at or after `sent` (gaps close in time order).
  int l = 0;
  for (int hi = c; l < hi;) {
    const int mid = l + (hi - l) / 2;
    if (receiver.close(mid) < sent) l = mid + 1;
    else hi = mid;
  }
  const int first_l = l;
  int k = j + 1;
  while (k < sender.count() && l <= c) {
    const int lo = sender.open(k) > receiver.open(l) ? sender.open(k) : receiver.open(l);
    const int hi = sender.close(k) < receiver.close(l) ? sender.close(k) : receiver.close(l);
    if (lo <= hi) return {k, l};
    if (sender.close(k) < receiver.close(l)) ++k;
    else ++l;
  }
  return {j + 1, first_l};
}

}  // namespace detail

constexpr Schedule with_messages(const Shape& sh, const std::vector<std::vector<Action>>& compute, Cost cost = {}) {
  const int P = sh.ranks;
  const detail::Timeline t = detail::ideal_timeline(sh, compute, cost);
  auto gaps = [&](int r) {
    return detail::Gaps{t.start[static_cast<std::size_t>(r)], t.end[static_cast<std::size_t>(r)]};
  };
  // Index of each (rank, chunk, micro-batch)'s F and B-or-I in its rank's compute order.
  const auto slots = static_cast<std::size_t>(sh.ranks * sh.chunks * sh.micro_batches);
  auto slot = [&](int r, int c, int m) { return static_cast<std::size_t>((r * sh.chunks + c) * sh.micro_batches + m); };
  std::vector<int> forward_at(slots, -1), input_grad_at(slots, -1);
  for (int r = 0; r < P; ++r)
    for (std::size_t j = 0; j < compute[static_cast<std::size_t>(r)].size(); ++j) {
      const Action& a = compute[static_cast<std::size_t>(r)][j];
      if (a.op == Op::forward) forward_at[slot(r, a.chunk, a.mb)] = static_cast<int>(j);
      if (makes_input_grad(a.op)) input_grad_at[slot(r, a.chunk, a.mb)] = static_cast<int>(j);
    }

  // Both ends of every message.
  std::vector<detail::Placed> ends;
  ends.reserve(static_cast<std::size_t>(4 * sh.stages() * sh.micro_batches));
  for (int r = 0; r < P; ++r) {
    const auto& order = compute[static_cast<std::size_t>(r)];
    for (std::size_t j = 0; j < order.size(); ++j) {
      const Action& a = order[j];
      const int st = sh.stage(r, a.chunk), sent = t.end[static_cast<std::size_t>(r)][j];
      const bool forward_message = a.op == Op::forward && sh.sends_forward(r, a.chunk);
      const bool backward_message = makes_input_grad(a.op) && sh.sends_backward(r, a.chunk);
      if (!forward_message && !backward_message) continue;
      const int to = forward_message ? st + 1 : st - 1, q = sh.rank_of(to), qc = sh.chunk_of(to);
      const int consumer = (forward_message ? forward_at : input_grad_at)[slot(q, qc, a.mb)];
      const auto [k, l] = detail::meeting(gaps(r), static_cast<int>(j), gaps(q), consumer, sent);
      ends.push_back({r, k, sent, q, forward_message ? send_act(a.mb, q, a.chunk) : send_grad(a.mb, q, a.chunk)});
      ends.push_back({q, l, sent, r, forward_message ? recv_act(a.mb, r, qc) : recv_grad(a.mb, r, qc)});
    }
  }

  // Sorted by (rank, gap, time, peer): a counting sort into one bucket per gap
  // (gap k of rank r is bucket first_gap[r] + k), then each small bucket by time.
  std::vector<int> first_gap(static_cast<std::size_t>(P) + 1, 0);
  for (int r = 0; r < P; ++r)
    first_gap[static_cast<std::size_t>(r) + 1] =
        first_gap[static_cast<std::size_t>(r)] + static_cast<int>(compute[static_cast<std::size_t>(r)].size()) + 1;
  auto bucket_of = [&](const detail::Placed& e) {
    return static_cast<std::size_t>(first_gap[static_cast<std::size_t>(e.rank)] + e.gap);
  };
  std::vector<std::size_t> bucket_start(static_cast<std::size_t>(first_gap.back()) + 1, 0);
  for (const auto& e : ends) ++bucket_start[bucket_of(e) + 1];
  for (std::size_t i = 1; i < bucket_start.size(); ++i) bucket_start[i] += bucket_start[i - 1];
  std::vector<detail::Placed> comm(ends.size());
  std::vector<std::size_t> fill(bucket_start.begin(), bucket_start.end() - 1);
  for (const auto& e : ends) comm[fill[bucket_of(e)]++] = e;
  for (std::size_t b = 0; b + 1 < bucket_start.size(); ++b)
    for (std::size_t i = bucket_start[b] + 1; i < bucket_start[b + 1]; ++i)
      for (std::size_t j = i; j > bucket_start[b] && comm[j] < comm[j - 1]; --j) {
        const detail::Placed tmp = comm[j];
        comm[j] = comm[j - 1];
        comm[j - 1] = tmp;
      }

  // Each rank's program: its compute actions, the comm actions of each gap as
  // one group before the compute action that closes the gap.
  Schedule s(sh);
  std::size_t next = 0;
  for (int r = 0; r < P; ++r) {
    const auto& order = compute[static_cast<std::size_t>(r)];
    auto& prog = s.programs[static_cast<std::size_t>(r)];
    prog.reserve(order.size() + bucket_start[static_cast<std::size_t>(first_gap[static_cast<std::size_t>(r) + 1])] -
                 bucket_start[static_cast<std::size_t>(first_gap[static_cast<std::size_t>(r)])]);
    for (int k = 0; k <= static_cast<int>(order.size()); ++k) {
      for (bool first = true; next < comm.size() && comm[next].rank == r && comm[next].gap == k; ++next, first = false) {
        prog.push_back(comm[next].action);
        prog.back().joins_previous = !first;
      }
      if (k < static_cast<int>(order.size())) prog.push_back(order[static_cast<std::size_t>(k)]);
    }
  }
  return s;
}

}  // namespace fived::pipeline
