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

// Start and end times of each compute action, the compute orders run as a
// dataflow under `cost`. `orders`: Orders, or TimedOrders below; `start` and
// `end` hold one value per compute action, numbered as `orders` numbers them.
//
// (This loop and the others below that visit every action run inside the
// compiler for each schedule type a program names. There a function call, or
// a statement, costs as much as many operators: Clang counts statements
// against its limit. So they look neighbours up in arrays, join declarations,
// and call nothing.)
template <class O>
constexpr void ideal_timeline(const O& orders, Cost cost, int* start, int* end) {
  const Shape& sh = orders.shape();
  const int P = sh.ranks, V = sh.chunks, M = sh.micro_batches, slots = P * V * M;
  const StageMap map(sh);
  const int *next = map.next.data(), *prev = map.prev.data();
  int cost_of[9] = {};
  for (int op = 0; op < 9; ++op) cost_of[op] = cost.of(static_cast<Op>(op));
  // Per (rank, chunk, micro-batch) slot: when its F, its B or I, and its I (for W) ended; -1: not yet.
  Scratch<int> forward_ends(slots, -1), input_grad_ends(slots, -1), weight_input_ends(slots, -1);
  int *forward_end = forward_ends.data(), *input_grad_end = input_grad_ends.data(),
      *weight_input_end = weight_input_ends.data();
  Scratch<int> pc(P, 0), clock(P, 0);
  for (bool progressed = true, down = true; progressed; down = !down) {  // sweeps as in dry_run.hpp
    progressed = false;
    for (int step = 0; step < P; ++step) {
      const int r = down ? step : P - 1 - step;
      const Action* order = orders.begin(r);
      const int n = orders.size(r), base = orders.first(r);
      int i = pc[r], now = clock[r];
      for (; i < n; ++i) {
        const Action& a = order[i];
        // What `a` waits for: F for the previous stage's F, W for its I, B or I for its F and
        // the next stage's B or I; the latest of their ends, or -1 while one has not run.
        const int rc = r * V + a.chunk, k = rc * M + a.mb,
                  before = a.op == Op::forward ? (prev[rc] < 0 ? 0 : forward_end[prev[rc] * M + a.mb])
                           : a.op == Op::weight_grad ? weight_input_end[k]
                                                     : forward_end[k],
                  grad = a.op == Op::forward || a.op == Op::weight_grad || next[rc] < 0
                             ? 0
                             : input_grad_end[next[rc] * M + a.mb];
        if (before < 0 || grad < 0) break;
        const int begin = now > before ? (now > grad ? now : grad) : (before > grad ? before : grad);
        start[base + i] = begin, now = end[base + i] = begin + cost_of[static_cast<int>(a.op)], progressed = true;
        if (a.op == Op::forward) forward_end[k] = now;
        else if (a.op == Op::backward) input_grad_end[k] = now;
        else if (a.op == Op::input_grad) input_grad_end[k] = weight_input_end[k] = now;
      }
      pc[r] = i, clock[r] = now;
    }
  }
  for (int r = 0; r < P; ++r)
    if (pc[r] < orders.size(r)) throw std::logic_error("fived::pipeline: a generator's compute order waits for itself");
}

// The gaps (k on the sender, l on the receiver) where a message is posted: the
// earliest moment after it exists (`sent`, by the sender's compute j) at which
// both ranks sit between computes, before its consumer (the receiver's compute
// c) starts, so the blocking exchange delays neither; if there is none, right
// after the producer and just before the first compute that starts after the
// message exists. Gap k of a rank is the time between its compute k-1 and
// compute k: open from the end of k-1 (gap 0 from 0), closed at the start of k
// (the last gap never closes). `first_l` is the receiver's first gap that
// closes at or after `sent` (gaps close in time order).
struct Meeting {
  int sender_gap, receiver_gap;
};

constexpr Meeting meeting(const int* sender_start, const int* sender_end, int sender_computes, int j,
                          const int* receiver_start, const int* receiver_end, int receiver_computes, int c,
                          int first_l) {
  constexpr int never = 1 << 30;
  for (int k = j + 1, l = first_l; k <= sender_computes && l <= c;) {
    const int sender_open = k == 0 ? 0 : sender_end[k - 1], receiver_open = l == 0 ? 0 : receiver_end[l - 1],
              sender_close = k == sender_computes ? never : sender_start[k],
              receiver_close = l == receiver_computes ? never : receiver_start[l];
    if ((sender_open > receiver_open ? sender_open : receiver_open) <=
        (sender_close < receiver_close ? sender_close : receiver_close))
      return {k, l};
    if (sender_close < receiver_close) ++k;
    else ++l;
  }
  return {j + 1, first_l};
}

// Both ends of every message, each a comm action posted by `rank` just before
// its compute action number `gap`.
struct Ends {
  int count = 0;
  Scratch<int> rank, gap, sent, peer;  // [end]; sent: when the message exists
  Scratch<int> op, mb, chunk;          // [end]: the comm action's (ints: an Action array costs its member defaults)

  constexpr explicit Ends(int capacity)
      : rank(capacity), gap(capacity), sent(capacity), peer(capacity), op(capacity), mb(capacity), chunk(capacity) {}
};

}  // namespace detail

// The compute orders lowered into `out` (a Table, or a Schedule through
// ScheduleBuilder): each rank's compute actions, with the comm actions of each
// gap as one group before the compute action that closes the gap.
// `start` and `end`: the orders' ideal timeline (detail::ideal_timeline).
template <class O, class Out>
constexpr void with_messages(const O& orders, const int* start, const int* end, Out& out) {
  const Shape& sh = orders.shape();
  const int P = sh.ranks, V = sh.chunks, M = sh.micro_batches, slots = P * V * M;
  const detail::StageMap map(sh);
  const int *next = map.next.data(), *prev = map.prev.data();
  // Index of each (rank, chunk, micro-batch)'s F and B-or-I in its rank's compute order.
  detail::Scratch<int> forward_index(slots, -1), input_grad_index(slots, -1);
  int *forward_at = forward_index.data(), *input_grad_at = input_grad_index.data();
  int computes = 0;
  for (int r = 0; r < P; ++r) {
    const Action* order = orders.begin(r);
    const int n = orders.size(r);
    computes += n;
    for (int j = 0; j < n; ++j) {
      const Action& a = order[j];
      if (a.op == Op::forward) forward_at[(r * V + a.chunk) * M + a.mb] = j;
      else if (a.op == Op::backward || a.op == Op::input_grad) input_grad_at[(r * V + a.chunk) * M + a.mb] = j;
    }
  }

  // Both ends of every message. The receiver's first gap that closes after a message
  // exists only moves on as the sender's messages to it do (they come to exist in
  // order), so it is found by a cursor per (sender, receiver), not a search.
  detail::Ends ends(2 * computes);
  int *end_rank = ends.rank.data(), *end_gap = ends.gap.data(), *end_sent = ends.sent.data(),
      *end_peer = ends.peer.data(), *end_op = ends.op.data(), *end_mb = ends.mb.data(), *end_chunk = ends.chunk.data();
  detail::Scratch<int> cursors(P * P, 0), firsts(P), sizes(P);
  int *cursor = cursors.data(), *first = firsts.data(), *size = sizes.data();
  for (int r = 0; r < P; ++r) first[r] = orders.first(r), size[r] = orders.size(r);
  int e = 0;
  for (int r = 0; r < P; ++r) {
    const Action* order = orders.begin(r);
    const int n = size[r], base = first[r];
    for (int j = 0; j < n; ++j) {
      const Action& a = order[j];
      const int rc = r * V + a.chunk;
      const bool forward_message = a.op == Op::forward && next[rc] >= 0 && next[rc] / V != r,
                 backward_message = (a.op == Op::backward || a.op == Op::input_grad) && prev[rc] >= 0 && prev[rc] / V != r;
      if (!forward_message && !backward_message) continue;
      const int to = forward_message ? next[rc] : prev[rc], q = to / V, sent = end[base + j],
                consumer = (forward_message ? forward_at : input_grad_at)[to * M + a.mb], qbase = first[q];
      int& l = cursor[r * P + q];
      while (l < consumer && l < size[q] && start[qbase + l] < sent) ++l;
      const detail::Meeting at = detail::meeting(start + base, end + base, n, j, start + qbase, end + qbase, size[q],
                                                 consumer, l < consumer ? l : consumer);
      end_rank[e] = r, end_gap[e] = at.sender_gap, end_sent[e] = sent, end_peer[e] = q,
      end_op[e] = static_cast<int>(forward_message ? Op::send_act : Op::send_grad), end_mb[e] = a.mb,
      end_chunk[e] = a.chunk, ++e;
      end_rank[e] = q, end_gap[e] = at.receiver_gap, end_sent[e] = sent, end_peer[e] = r,
      end_op[e] = static_cast<int>(forward_message ? Op::recv_act : Op::recv_grad), end_mb[e] = a.mb,
      end_chunk[e] = to % V, ++e;
    }
  }
  ends.count = e;

  // The ends sorted by (rank, gap, time, peer): a counting sort into one bucket
  // per gap (gap k of rank r is bucket first_gap[r] + k), then each small bucket by
  // time (in the order the messages came to exist; one sender's messages thus stay
  // in its order) and peer.
  detail::Scratch<int> first_gap(P + 1);
  first_gap[0] = 0;
  for (int r = 0; r < P; ++r) first_gap[r + 1] = first_gap[r] + orders.size(r) + 1;
  const int buckets = first_gap[P];
  detail::Scratch<int> bucket_starts(buckets + 1, 0), sorted_ends(ends.count), fills(buckets);
  int *bucket_start = bucket_starts.data(), *sorted = sorted_ends.data(), *fill = fills.data();
  for (int e = 0; e < ends.count; ++e) ++bucket_start[first_gap[end_rank[e]] + end_gap[e] + 1];
  for (int b = 0; b < buckets; ++b) fill[b] = bucket_start[b], bucket_start[b + 1] += bucket_start[b];
  for (int e = 0; e < ends.count; ++e) sorted[fill[first_gap[end_rank[e]] + end_gap[e]]++] = e;
  for (int b = 0; b < buckets; ++b)
    for (int i = bucket_start[b] + 1; i < bucket_start[b + 1]; ++i)
      for (int j = i, x = sorted[i];
           j > bucket_start[b] && (end_sent[x] < end_sent[sorted[j - 1]] ||
                                   (end_sent[x] == end_sent[sorted[j - 1]] && end_peer[x] < end_peer[sorted[j - 1]]));
           --j)
        sorted[j] = sorted[j - 1], sorted[j - 1] = x;

  for (int r = 0; r < P; ++r) {
    const Action* order = orders.begin(r);
    const int n = orders.size(r), first = first_gap[r];
    Action* program = out.program_of_size(r, n + bucket_start[first_gap[r + 1]] - bucket_start[first]);
    for (int k = 0, w = 0; k <= n; ++k) {
      for (int i = bucket_start[first + k]; i < bucket_start[first + k + 1]; ++i)
        program[w++] = {static_cast<Op>(end_op[sorted[i]]), i > bucket_start[first + k], end_mb[sorted[i]],
                        end_chunk[sorted[i]], end_peer[sorted[i]]};
      if (k < n) program[w++] = order[k];
    }
  }
}

namespace detail {
// A Schedule as with_messages' output.
struct ScheduleBuilder {
  Schedule schedule;
  constexpr Action* program_of_size(int r, int n) {
    auto& p = schedule.programs[static_cast<std::size_t>(r)];
    p.resize(static_cast<std::size_t>(n));
    return p.data();
  }
};
}  // namespace detail

constexpr Schedule with_messages(const detail::Orders& orders, Cost cost = {}) {
  detail::Scratch<int> start(orders.numbers()), end(orders.numbers());
  detail::ideal_timeline(orders, cost, start.data(), end.data());
  detail::ScheduleBuilder out{Schedule(orders.shape())};
  with_messages(orders, start.data(), end.data(), out);
  return std::move(out.schedule);
}

namespace detail {

// A generator's compute orders with their ideal timeline, in arrays of fixed
// size: the first of the two constants a schedule type's table is made in (the
// compilers limit each constant expression's work, so each half gets a budget).
template <class TableType>
struct TimedOrders {
  static constexpr int P = TableType::ranks, capacity = 3 * TableType::micro_batches * TableType::chunks;

  Action actions[P][capacity]{};
  int sizes[P]{};
  int start[P * capacity]{}, end[P * capacity]{};

  constexpr TimedOrders() = default;
  constexpr explicit TimedOrders(const Orders& orders, Cost cost = {}) {
    for (int r = 0; r < P; ++r) {
      const Action* from = orders.begin(r);
      const int n = orders.size(r);
      for (int i = 0; i < n; ++i) actions[r][i] = from[i];
      sizes[r] = n;
    }
    ideal_timeline(*this, cost, start, end);
  }

  constexpr const Shape& shape() const { return TableType::shape; }
  constexpr const Action* begin(int r) const { return actions[r]; }
  constexpr int size(int r) const { return sizes[r]; }
  constexpr int first(int r) const { return r * capacity; }
  constexpr int numbers() const { return P * capacity; }
};

// The second constant: the table, the messages placed.
template <class TableType>
constexpr TableType lowered(const TimedOrders<TableType>& timed) {
  TableType t;
  with_messages(timed, timed.start, timed.end, t);
  return t;
}

}  // namespace detail

}  // namespace fived::pipeline
