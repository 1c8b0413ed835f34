#pragma once
// with_messages(orders[, out]): from each rank's order of compute actions to a
// full schedule, the sends and receives placed where an executor issues them.
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
//
// Linear in the table, with small constants (it runs inside the compiler for
// every schedule type a program names): arrays sized once, a counting sort.

#include <stdexcept>
#include <utility>
#include <vector>

#include "fived/pipeline/dry_run.hpp"

namespace fived::pipeline {

namespace detail {

// Each rank's order of compute actions: what a generator decides, in one block
// of 3·M·V actions per rank (F, I and W of every micro-batch and chunk at most).
class Orders {
 public:
  constexpr explicit Orders(Shape s)
      : shape_(s), capacity_(3 * s.micro_batches * s.chunks), actions_(s.ranks * capacity_), sizes_(s.ranks, 0) {}

  constexpr void add(int r, const Action& a) {
    if (sizes_[r] == capacity_) throw std::logic_error("fived::pipeline: a generator's compute order is too long");
    actions_[r * capacity_ + sizes_[r]++] = a;
  }
  constexpr const Shape& shape() const { return shape_; }
  constexpr const Action* begin(int r) const { return actions_.data() + r * capacity_; }
  constexpr int size(int r) const { return sizes_[r]; }
  // One number per compute action of the whole table: rank r's k-th is first(r) + k.
  constexpr int first(int r) const { return r * capacity_; }
  constexpr int numbers() const { return shape_.ranks * capacity_; }

 private:
  Shape shape_;
  int capacity_;
  Scratch<Action> actions_;
  Scratch<int> sizes_;
};

// Start and end times of each compute action (numbered as Orders numbers them),
// the compute orders run as a dataflow under `cost`.
struct Timeline {
  Scratch<int> start, end;
};

constexpr Timeline ideal_timeline(const Orders& orders, Cost cost) {
  const Shape& sh = orders.shape();
  const int P = sh.ranks, slots = sh.ranks * sh.chunks * sh.micro_batches;
  // Per (rank, chunk, micro-batch): when its F, its B or I, and its I (for W) ended; -1: not yet.
  Scratch<int> forward_end(slots, -1), input_grad_end(slots, -1), weight_input_end(slots, -1);
  Timeline t{Scratch<int>(orders.numbers()), Scratch<int>(orders.numbers())};
  Scratch<int> pc(P, 0), clock(P, 0);
  auto slot = [&](int r, int c, int m) { return (r * sh.chunks + c) * sh.micro_batches + m; };
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < P; ++r) {
      const Action* order = orders.begin(r);
      const int n = orders.size(r), base = orders.first(r);
      int& i = pc[r];
      int& now = clock[r];
      for (; i < n; ++i) {
        const Action& a = order[i];
        const int st = sh.stage(r, a.chunk);
        int ready = now;
        // The end of what `a` waits for, or -1 while that has not run.
        int needs = now;
        if (a.op == Op::forward) {
          if (st > 0) needs = forward_end[slot(sh.rank_of(st - 1), sh.chunk_of(st - 1), a.mb)];
        } else if (a.op == Op::weight_grad) {
          needs = weight_input_end[slot(r, a.chunk, a.mb)];
        } else {
          needs = forward_end[slot(r, a.chunk, a.mb)];
          if (needs >= 0 && st + 1 < sh.stages()) {
            const int grad = input_grad_end[slot(sh.rank_of(st + 1), sh.chunk_of(st + 1), a.mb)];
            needs = grad < 0 ? -1 : grad > needs ? grad : needs;
          }
        }
        if (needs < 0) break;
        if (needs > ready) ready = needs;
        t.start[base + i] = ready;
        now = ready + cost.of(a.op);
        t.end[base + i] = now;
        const int k = slot(r, a.chunk, a.mb);
        if (a.op == Op::forward) forward_end[k] = now;
        if (makes_input_grad(a.op)) input_grad_end[k] = now;
        if (a.op == Op::input_grad) weight_input_end[k] = now;
        progressed = true;
      }
    }
  }
  for (int r = 0; r < P; ++r)
    if (pc[r] < orders.size(r)) throw std::logic_error("fived::pipeline: a generator's compute order waits for itself");
  return t;
}

// Gap k of a rank is the time between its compute k-1 and compute k: the
// window [end of k-1, start of k] in which it can post a comm group without
// delaying either (gap 0 opens at 0, the last gap never closes).
struct Gaps {
  const int* start;
  const int* end;
  int computes;
  constexpr int count() const { return computes + 1; }
  constexpr int open(int k) const { return k == 0 ? 0 : end[k - 1]; }
  constexpr int close(int k) const { return k == computes ? 1 << 30 : start[k]; }
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

// Both ends of every message, each a comm action posted by `rank` just before
// its compute action number `gap`.
struct Ends {
  int count = 0;
  Scratch<int> rank, gap, sent, peer;  // [end]; sent: when the message exists
  Scratch<Action> action;

  constexpr explicit Ends(int capacity)
      : rank(capacity), gap(capacity), sent(capacity), peer(capacity), action(capacity) {}
  constexpr void add(int r, int g, int s, int q, const Action& a) {
    rank[count] = r, gap[count] = g, sent[count] = s, peer[count] = q, action[count] = a;
    ++count;
  }
  // Per rank and gap, in the order the messages came to exist; one sender's messages thus stay in its order.
  constexpr bool before(int a, int b) const {
    if (sent[a] != sent[b]) return sent[a] < sent[b];
    return peer[a] < peer[b];
  }
};

}  // namespace detail

// The compute orders lowered into `out` (a Table, or a Schedule through
// ScheduleBuilder): each rank's compute actions, with the comm actions of each
// gap as one group before the compute action that closes the gap.
template <class Out>
constexpr void with_messages(const detail::Orders& orders, Out& out, Cost cost = {}) {
  const Shape& sh = orders.shape();
  const int P = sh.ranks, slots = sh.ranks * sh.chunks * sh.micro_batches;
  const detail::Timeline t = detail::ideal_timeline(orders, cost);
  auto gaps = [&](int r) {
    return detail::Gaps{t.start.data() + orders.first(r), t.end.data() + orders.first(r), orders.size(r)};
  };
  auto slot = [&](int r, int c, int m) { return (r * sh.chunks + c) * sh.micro_batches + m; };
  // Index of each (rank, chunk, micro-batch)'s F and B-or-I in its rank's compute order.
  detail::Scratch<int> forward_at(slots, -1), input_grad_at(slots, -1);
  int computes = 0;
  for (int r = 0; r < P; ++r) {
    const Action* order = orders.begin(r);
    computes += orders.size(r);
    for (int j = 0; j < orders.size(r); ++j) {
      const Action& a = order[j];
      if (a.op == Op::forward) forward_at[slot(r, a.chunk, a.mb)] = j;
      if (makes_input_grad(a.op)) input_grad_at[slot(r, a.chunk, a.mb)] = j;
    }
  }

  // Both ends of every message.
  detail::Ends ends(2 * computes);
  for (int r = 0; r < P; ++r) {
    const Action* order = orders.begin(r);
    for (int j = 0; j < orders.size(r); ++j) {
      const Action& a = order[j];
      const bool forward_message = a.op == Op::forward && sh.sends_forward(r, a.chunk);
      const bool backward_message = makes_input_grad(a.op) && sh.sends_backward(r, a.chunk);
      if (!forward_message && !backward_message) continue;
      const int st = sh.stage(r, a.chunk), sent = t.end[orders.first(r) + j];
      const int to = forward_message ? st + 1 : st - 1, q = sh.rank_of(to), qc = sh.chunk_of(to);
      const int consumer = (forward_message ? forward_at : input_grad_at)[slot(q, qc, a.mb)];
      const auto [k, l] = detail::meeting(gaps(r), j, gaps(q), consumer, sent);
      ends.add(r, k, sent, q, forward_message ? send_act(a.mb, q, a.chunk) : send_grad(a.mb, q, a.chunk));
      ends.add(q, l, sent, r, forward_message ? recv_act(a.mb, r, qc) : recv_grad(a.mb, r, qc));
    }
  }

  // The ends sorted by (rank, gap, time, peer): a counting sort into one bucket
  // per gap (gap k of rank r is bucket first_gap[r] + k), then each small bucket by time.
  detail::Scratch<int> first_gap(P + 1);
  first_gap[0] = 0;
  for (int r = 0; r < P; ++r) first_gap[r + 1] = first_gap[r] + orders.size(r) + 1;
  const int buckets = first_gap[P];
  detail::Scratch<int> bucket_start(buckets + 1, 0);
  for (int e = 0; e < ends.count; ++e) ++bucket_start[first_gap[ends.rank[e]] + ends.gap[e] + 1];
  for (int b = 0; b < buckets; ++b) bucket_start[b + 1] += bucket_start[b];
  detail::Scratch<int> sorted(ends.count), fill(buckets);
  for (int b = 0; b < buckets; ++b) fill[b] = bucket_start[b];
  for (int e = 0; e < ends.count; ++e) sorted[fill[first_gap[ends.rank[e]] + ends.gap[e]]++] = e;
  for (int b = 0; b < buckets; ++b)
    for (int i = bucket_start[b] + 1; i < bucket_start[b + 1]; ++i)
      for (int j = i; j > bucket_start[b] && ends.before(sorted[j], sorted[j - 1]); --j) {
        const int tmp = sorted[j];
        sorted[j] = sorted[j - 1];
        sorted[j - 1] = tmp;
      }

  for (int r = 0; r < P; ++r) {
    const Action* order = orders.begin(r);
    for (int k = 0; k <= orders.size(r); ++k) {
      const int b = first_gap[r] + k;
      for (int i = bucket_start[b]; i < bucket_start[b + 1]; ++i) {
        Action a = ends.action[sorted[i]];
        a.joins_previous = i > bucket_start[b];
        out.append(r, a);
      }
      if (k < orders.size(r)) out.append(r, order[k]);
    }
  }
}

namespace detail {
// A Schedule as with_messages' output.
struct ScheduleBuilder {
  Schedule schedule;
  constexpr void append(int r, const Action& a) { schedule.programs[static_cast<std::size_t>(r)].push_back(a); }
};
}  // namespace detail

constexpr Schedule with_messages(const detail::Orders& orders, Cost cost = {}) {
  detail::ScheduleBuilder out{Schedule(orders.shape())};
  with_messages(orders, out, cost);
  return std::move(out.schedule);
}

}  // namespace fived::pipeline
