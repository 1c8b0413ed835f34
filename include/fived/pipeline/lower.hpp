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
// every schedule type a program names): arrays sized once, each gap's messages a
// list kept in order as they are placed (a gap holds a few), and the rules of
// table_index.hpp (arrays indexed as arrays, declarations before the loops).

#include <stdexcept>
#include <vector>

#include "fived/pipeline/dry_run.hpp"
#include "fived/pipeline/stages.hpp"

namespace fived::pipeline {

namespace detail {

// Each rank's order of compute actions: what a generator decides, in one block
// of `capacity` = 3·M·V actions per rank (F, I and W of every micro-batch and
// chunk at most): rank r's k-th is actions[r · capacity + k], packed as a table
// packs it (table.hpp; `add` takes an Action). Once timed
// (ideal_timeline below), start[] and end[] hold when each starts and ends. A
// generator's result, sized at run time; TimedOrders below has the same members
// in arrays of fixed size.
inline constexpr char order_too_long[] = "fived::pipeline: a generator's compute order is too long";

struct Orders {
  Shape shape;
  Packing packing;
  int capacity;
  Scratch<int> actions, sizes, start, end;

  constexpr explicit Orders(Shape s)
      : shape(s),
        packing(s),
        capacity(3 * s.micro_batches * s.chunks),
        actions(s.ranks * capacity),
        sizes(s.ranks, 0),
        start(s.ranks * capacity),
        end(s.ranks * capacity) {}

  constexpr void add(int r, const Action& a) {
    if (sizes[r] == capacity) throw std::logic_error(order_too_long);
    actions[r * capacity + sizes[r]++] = packing.pack(a);
  }
};

// A generator's compute orders with their ideal timeline, in arrays of fixed
// size: the first of the two constants a schedule type's table is made in (the
// compilers limit each constant expression's work, so each half gets a budget).
// The generator writes into it (`add`, as into Orders), not into an Orders copied
// here: inside the compiler the copy and the run-time sized arrays cost more
// than the generator.
template <class TableType>
struct TimedOrders {
  static constexpr Shape shape = TableType::shape;
  static constexpr Packing packing = TableType::packing;
  static constexpr int P = TableType::ranks, capacity = 3 * TableType::micro_batches * TableType::chunks;

  int actions[P * capacity]{};
  int sizes[P]{};
  int start[P * capacity]{}, end[P * capacity]{};

  constexpr TimedOrders() = default;
  // The orders `generate(*this)` writes (a generator, generators.hpp), timed under `cost`.
  template <class Generate>
  constexpr TimedOrders(Generate generate, Cost cost);

  constexpr void add(int r, const Action& a) {
    sizes[r] == capacity ? throw std::logic_error(order_too_long)
                         : (void)(actions[r * capacity + sizes[r]++] = packing.pack(a));
  }
};

// The lowering's working arrays (W below), one value per (rank, chunk,
// micro-batch) slot, per rank, per message end or per gap: of fixed size for a
// table type (FixedLowering, a local of the constant that uses it), or sized
// at run time (Lowering).
template <class TableType>
struct FixedLowering {
  static constexpr int P = TableType::ranks, stages = P * TableType::chunks,
                       slots = stages * TableType::micro_batches, capacity = TimedOrders<TableType>::capacity,
                       ends = 2 * P * capacity, gaps = P * (capacity + 1);
  int next[stages]{}, prev[stages]{};
  int forward_end[slots]{}, input_grad_end[slots]{}, weight_input_end[slots]{}, forward_at[slots]{},
      input_grad_at[slots]{};
  int pc[P]{}, clock[P]{}, cursor[P * P]{}, first_gap[P + 1]{}, ends_on[P]{};
  int end_sent[ends]{}, end_action[ends]{}, link[ends]{};
  int head[gaps]{};
};

struct Lowering {
  Scratch<int> next, prev, forward_end, input_grad_end, weight_input_end, forward_at, input_grad_at, pc, clock, cursor,
      first_gap, ends_on, end_sent, end_action, link, head;

  constexpr explicit Lowering(const Shape& s)
      : Lowering(s.stages(), s.stages() * s.micro_batches, s.ranks, 2 * s.ranks * 3 * s.micro_batches * s.chunks,
                 s.ranks * (3 * s.micro_batches * s.chunks + 1)) {}

 private:
  constexpr Lowering(int stages, int slots, int P, int ends, int gaps)
      : next(stages), prev(stages), forward_end(slots), input_grad_end(slots), weight_input_end(slots),
        forward_at(slots), input_grad_at(slots), pc(P), clock(P), cursor(P * P), first_gap(P + 1), ends_on(P),
        end_sent(ends), end_action(ends), link(ends), head(gaps) {}
};

// Start and end times of each compute action of o (Orders or TimedOrders), its
// orders run as a dataflow under `cost`, into o.start and o.end.
template <class O, class W>
constexpr void ideal_timeline(O& o, Cost cost, W& w) {
  const Shape& sh = o.shape;
  const int P = sh.ranks, V = sh.chunks, M = sh.micro_batches, C = o.capacity, peers = P + 1;
  int cost_of[9] = {};
  int r = 0, step = 0, i = 0, n = 0, base = 0, now = 0, p = 0, op = 0, mb = 0, rc = 0, k = 0, before = 0, grad = 0;
  bool progressed = true, down = true;
  for (op = 0; op < 9; ++op) cost_of[op] = cost.of(static_cast<Op>(op));
  stage_neighbours(sh, w);
  // Per slot: when its F, its B or I, and its I (for W) ended; -1: not yet.
  for (k = 0; k < P * V * M; ++k) w.forward_end[k] = w.input_grad_end[k] = w.weight_input_end[k] = -1;
  for (r = 0; r < P; ++r) w.pc[r] = w.clock[r] = 0;
  for (; progressed; down = !down) {  // sweeps as in dry_run.hpp
    progressed = false;
    for (step = 0; step < P; ++step) {
      r = down ? step : P - 1 - step, base = r * C, n = o.sizes[r], i = w.pc[r], now = w.clock[r];
      for (; i < n; ++i) {
        // What action i waits for: F for the previous stage's F, W for its I, B or I for its F and
        // the next stage's B or I; the latest of their ends, or -1 while one has not run.
        p = o.actions[base + i], op = p % 9, k = r * V * M + p / 18 / peers, rc = k / M, mb = k % M,
        before = op == 1 ? (w.prev[rc] < 0 ? 0 : w.forward_end[w.prev[rc] * M + mb])
                 : op == 4 ? w.weight_input_end[k]
                           : w.forward_end[k],
        grad = op == 1 || op == 4 || w.next[rc] < 0 ? 0 : w.input_grad_end[w.next[rc] * M + mb];
        if (before < 0 || grad < 0) break;
        now = now > before ? (now > grad ? now : grad) : (before > grad ? before : grad), o.start[base + i] = now,
        now += cost_of[op], o.end[base + i] = now, progressed = true;
        if (op == 1) w.forward_end[k] = now;
        else if (op == 2) w.input_grad_end[k] = now;
        else if (op == 3) w.input_grad_end[k] = w.weight_input_end[k] = now;
      }
      w.pc[r] = i, w.clock[r] = now;
    }
  }
  for (r = 0; r < P; ++r)
    if (w.pc[r] < o.sizes[r]) throw std::logic_error("fived::pipeline: a generator's compute order waits for itself");
}

template <class TableType>
template <class Generate>
constexpr TimedOrders<TableType>::TimedOrders(Generate generate, Cost cost) {
  generate(*this);
  FixedLowering<TableType> w;
  ideal_timeline(*this, cost, w);
}

// A Schedule as with_messages' output (a Table is one as it is): `actions` (packed),
// and resize_program(r, n) before rank r's n actions are written.
struct ScheduleBuilder {
  Shape shape;
  std::vector<std::vector<int>> actions;

  constexpr explicit ScheduleBuilder(const Shape& s) : shape(s), actions(static_cast<std::size_t>(s.ranks)) {}
  constexpr void resize_program(int r, int n) { actions[static_cast<std::size_t>(r)].resize(static_cast<std::size_t>(n)); }
  constexpr Schedule schedule() const {
    Schedule s(shape);
    const Packing packing(shape);
    for (std::size_t r = 0; r < actions.size(); ++r)
      for (const int p : actions[r]) s.programs[r].push_back(packing.unpack(p));
    return s;
  }
};

// The timed orders o lowered into `out` (a Table, or a ScheduleBuilder): each
// rank's compute actions, with the comm actions of each gap as one group before
// the compute action that closes the gap.
//
// The gaps (k on the sender, l on the receiver) where a message is posted: the
// earliest moment after it exists (`sent`, by the sender's compute j) at which
// both ranks sit between computes, before its consumer (the receiver's compute
// c) starts, so the blocking exchange delays neither; if there is none, right
// after the producer and just before the first compute that starts after the
// message exists. Gap k of a rank is the time between its compute k-1 and
// compute k: open from the end of k-1 (gap 0 from 0), closed at the start of k
// (the last gap never closes).
template <class O, class W, class Out>
constexpr void with_messages(const O& o, W& w, Out& out) {
  constexpr int never = 1 << 30;
  const Shape& sh = o.shape;
  const int P = sh.ranks, V = sh.chunks, M = sh.micro_batches, C = o.capacity, peers = P + 1;
  int r = 0, q = 0, j = 0, n = 0, nq = 0, base = 0, qbase = 0, p = 0, op = 0, mb = 0, slot = 0, rc = 0, to = 0,
      sent = 0, consumer = 0, l = 0, k = 0, x = 0, e = 0, b = 0, gap = 0, first = 0, sender_open = 0, receiver_open = 0,
      sender_close = 0, receiver_close = 0, sender_gap = 0, receiver_gap = 0, side = 0, end_rank = 0, bucket = 0,
      before = 0, peer = 0, joins = 0;
  bool forward_message = false, found = false;
  stage_neighbours(sh, w);
  // Index of each slot's F and B-or-I in its rank's compute order.
  for (r = 0; r < P; ++r)
    for (j = 0, n = o.sizes[r], base = r * C; j < n; ++j)
      if (p = o.actions[base + j], op = p % 9, op <= 3)
        (op == 1 ? w.forward_at : w.input_grad_at)[r * V * M + p / 18 / peers] = j;
  // Both ends of every message, each a comm action posted by a rank just before its compute
  // number `gap`. The receiver's first gap that closes after a message exists only moves on as the
  // sender's messages to it do (they come to exist in order), so it is found by a cursor per
  // (sender, receiver), not a search; the gaps where both ranks sit, by walking both ranks' gaps.
  // Each gap's ends, as a list (head, link) in the order they are posted: sorted by time (in the
  // order the messages came to exist; one sender's messages thus stay in its order), then peer.
  // Gap k of rank r is gap first_gap[r] + k of all.
  for (k = 0; k < P * P; ++k) w.cursor[k] = 0;
  w.first_gap[0] = 0;
  for (r = 0; r < P; ++r) w.first_gap[r + 1] = w.first_gap[r] + o.sizes[r] + 1, w.ends_on[r] = 0;
  for (b = 0; b < w.first_gap[P]; ++b) w.head[b] = -1;
  for (r = 0; r < P; ++r)
    for (j = 0, n = o.sizes[r], base = r * C; j < n; ++j)
      // Skipped where there is no message: the last (first) stage, W, or a neighbour on this rank.
      if (p = o.actions[base + j], op = p % 9, slot = r * V * M + p / 18 / peers, rc = slot / M, mb = slot % M,
          to = op == 1 ? w.next[rc] : op == 2 || op == 3 ? w.prev[rc] : -1, q = to / V, to >= 0 && q != r) {
        forward_message = op == 1, qbase = q * C, nq = o.sizes[q],
        sent = o.end[base + j], consumer = forward_message ? w.forward_at[to * M + mb] : w.input_grad_at[to * M + mb];
        for (l = w.cursor[r * P + q]; l < consumer && l < nq && o.start[qbase + l] < sent;) ++l;
        // Gaps k (sender) and x (receiver) from there on, the one that closes first moved on, until
        // both are open at once (the loop's condition fails there: Clang counts statements, not
        // expressions, so the test is in the condition and the body is one statement).
        for (w.cursor[r * P + q] = l, receiver_gap = l < consumer ? l : consumer, k = j + 1, x = receiver_gap;
             k <= n && x <= consumer &&
             (sender_open = k == 0 ? 0 : o.end[base + k - 1], receiver_open = x == 0 ? 0 : o.end[qbase + x - 1],
              sender_close = k == n ? never : o.start[base + k], receiver_close = x == nq ? never : o.start[qbase + x],
              (sender_open > receiver_open ? sender_open : receiver_open) >
                  (sender_close < receiver_close ? sender_close : receiver_close));)
          sender_close < receiver_close ? ++k : ++x;
        found = k <= n && x <= consumer, sender_gap = found ? k : j + 1, receiver_gap = found ? x : receiver_gap;
        // The sender's end (side 0), then the receiver's, each into its gap's list after the ends
        // with an earlier or equal (time, peer).
        for (side = 0; side < 2; ++side, ++e) {
          end_rank = side == 0 ? r : q, bucket = w.first_gap[end_rank] + (side == 0 ? sender_gap : receiver_gap),
          // The comm action packed as the table keeps it (table.hpp), not yet joined to the one before.
          peer = side == 0 ? q : r, w.end_sent[e] = sent,
          w.end_action[e] = (((side == 0 ? rc % V : to % V) * M + mb) * peers + peer + 1) * 18 +
                            static_cast<int>(forward_message ? (side == 0 ? Op::send_act : Op::recv_act)
                                                             : (side == 0 ? Op::send_grad : Op::recv_grad)),
          ++w.ends_on[end_rank];
          for (before = -1, l = w.head[bucket];
               l >= 0 && (w.end_sent[l] < sent || (w.end_sent[l] == sent && w.end_action[l] / 18 % peers <= peer + 1));)
            before = l, l = w.link[l];
          w.link[e] = l, (before < 0 ? w.head[bucket] : w.link[before]) = e;
        }
      }

  for (r = 0; r < P; ++r) {
    n = o.sizes[r], first = w.first_gap[r], base = r * C;
    out.resize_program(r, n + w.ends_on[r]);
    // Each gap's comm actions, each after the first joined to the one before (+ 9: the joins
    // bit), then (in the loop's increment: one statement per action) the compute action that
    // closes the gap.
    for (gap = 0, k = 0; gap <= n; (void)(gap < n && (out.actions[r][k++] = o.actions[base + gap], true)), ++gap)
      for (x = w.head[first + gap], joins = 0; x >= 0; x = w.link[x], joins = 9)
        out.actions[r][k++] = w.end_action[x] + joins;
  }
}

// The second constant: the table, the messages placed.
template <class TableType>
constexpr TableType lowered(const TimedOrders<TableType>& timed) {
  TableType t;
  FixedLowering<TableType> w;
  with_messages(timed, w, t);
  return t;
}

}  // namespace detail

// The compute orders with their messages placed, as a Schedule: the orders run
// as a dataflow (the ideal timeline) under `cost`, then each message posted
// where both of its ranks sit between computes.
constexpr Schedule with_messages(detail::Orders orders, Cost cost = {}) {
  detail::Lowering w(orders.shape);
  detail::ideal_timeline(orders, cost, w);
  detail::ScheduleBuilder out(orders.shape);
  detail::with_messages(orders, w, out);
  return out.schedule();
}

}  // namespace fived::pipeline
