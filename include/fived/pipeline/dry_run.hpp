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

#include "fived/pipeline/table.hpp"

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

// Where each (rank, chunk, micro-batch)'s actions sit in its rank's program:
// the index of the first action of each kind, and which kinds come more than
// once. Only reads actions whose micro-batch and chunk are in range.
struct Positions {
  static constexpr int kinds = static_cast<int>(Op::recv_grad);  // the ops after Op::none
  Shape shape;
  detail::Scratch<int> first;               // [slot · kinds + op - 1]: index of the first such action, or -1
  detail::Scratch<unsigned char> repeated;  // [slot]: bit op - 1 set when that op comes again

  constexpr int slot(int rank, int chunk, int mb) const {
    return (rank * shape.chunks + chunk) * shape.micro_batches + mb;
  }
  constexpr int at(Op op, int rank, int chunk, int mb) const {
    return first[slot(rank, chunk, mb) * kinds + static_cast<int>(op) - 1];
  }
  // 0, 1, or 2 for "more than once".
  constexpr int how_many(Op op, int rank, int chunk, int mb) const {
    if (at(op, rank, chunk, mb) < 0) return 0;
    return (repeated[slot(rank, chunk, mb)] >> (static_cast<int>(op) - 1) & 1) ? 2 : 1;
  }
  // Index of the action that produces the input gradient (B or I), or -1.
  constexpr int input_grad_at(int rank, int chunk, int mb) const {
    const int b = at(Op::backward, rank, chunk, mb);
    return b >= 0 ? b : at(Op::input_grad, rank, chunk, mb);
  }
};

constexpr bool in_range(const Shape& shape, const Action& a) {
  return a.mb >= 0 && a.mb < shape.micro_batches && a.chunk >= 0 && a.chunk < shape.chunks;
}

constexpr Positions positions(const detail::Programs& programs) {
  const Shape& sh = programs.shape;
  const int slots = sh.ranks * sh.chunks * sh.micro_batches;
  Positions p{sh, detail::Scratch<int>(slots * Positions::kinds, -1), detail::Scratch<unsigned char>(slots, 0)};
  int* first = p.first.data();
  unsigned char* repeated = p.repeated.data();
  for (int r = 0; r < sh.ranks; ++r) {
    const Action* prog = programs.begin[r];
    const int n = programs.size(r);
    for (int i = 0; i < n; ++i) {
      const Action& a = prog[i];
      if (a.op == Op::none || !in_range(sh, a)) continue;
      const int slot = (r * sh.chunks + a.chunk) * sh.micro_batches + a.mb, kind = static_cast<int>(a.op) - 1;
      int& at = first[slot * Positions::kinds + kind];
      if (at < 0) at = i;
      else repeated[slot] |= static_cast<unsigned char>(1 << kind);
    }
  }
  return p;
}

template <class S>
constexpr Positions positions(const S& s) {
  return positions(detail::Programs(s));
}

struct Place {
  int rank = -1, index = -1;
};

// The operation a comm action meets on the other rank: same micro-batch, the
// neighbouring stage, the opposite direction. {-1, -1} when it is missing.
constexpr Place partner(const Positions& p, int rank, const Action& a) {
  const Shape& sh = p.shape;
  const int s = sh.stage(rank, a.chunk);
  const bool next = a.op == Op::send_act || a.op == Op::recv_grad;  // the other end is stage s + 1
  const int t = next ? s + 1 : s - 1;
  if (t < 0 || t >= sh.stages()) return {};
  const Op other = a.op == Op::send_act    ? Op::recv_act
                     : a.op == Op::recv_act  ? Op::send_act
                     : a.op == Op::send_grad ? Op::recv_grad
                                                 : Op::send_grad;
  const int q = sh.rank_of(t);
  return {q, p.at(other, q, sh.chunk_of(t), a.mb)};
}

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
// both). Arrays hold one value per action, numbered as Programs numbers them.
struct DryRun {
  bool finished = true;
  Scratch<int> at;          // [rank]: the action it runs next, or waits in (the program's size: finished)
  Scratch<int> reached;     // [rank]: every action before this one has started (compute) or is posted (comm)
  Scratch<int> posted_blocking, posted_eager;  // [action]: when it started or was posted
  int makespan[2] = {0, 0};                   // [Sends]: end of the last compute action

  constexpr DryRun(int ranks, int actions)
      : at(ranks, 0), reached(ranks, 0), posted_blocking(actions), posted_eager(actions) {}
  constexpr const int* posted(Sends s) const {
    return (s == Sends::blocking ? posted_blocking : posted_eager).data();
  }

  constexpr bool is_posted(Place p) const { return p.index >= 0 && p.index < reached[p.rank]; }
};

constexpr DryRun dry_run(const Programs& programs, const Positions& pos, Cost cost, Sends drive) {
  const int P = programs.ranks(), total = programs.total();
  constexpr int B = static_cast<int>(Sends::blocking), E = static_cast<int>(Sends::eager);
  const bool sends_wait = drive == Sends::blocking;
  DryRun run(P, total);
  Scratch<int> clocks(2 * P, 0);  // [Sends · P + rank]
  int* posted_b = run.posted_blocking.data();
  int* posted_e = run.posted_eager.data();
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < P; ++r) {
      const Action* prog = programs.begin[r];
      const int n = programs.size(r), base = programs.offset[r];
      int& now_b = clocks[B * P + r];
      int& now_e = clocks[E * P + r];
      int& i = run.at[r];
      int& reached = run.reached[r];
      while (i < n) {
        if (!is_comm(prog[i].op)) {
          posted_b[base + i] = now_b, posted_e[base + i] = now_e;
          const int c = cost.of(prog[i].op);
          now_b += c, now_e += c;
          if (now_b > run.makespan[B]) run.makespan[B] = now_b;
          if (now_e > run.makespan[E]) run.makespan[E] = now_e;
          reached = ++i, progressed = true;
          continue;
        }
        int end = i + 1;
        while (end < n && prog[end].joins_previous && is_comm(prog[end].op)) ++end;
        if (reached < end) {  // the rank reaches the group: all of it is posted
          for (int j = i; j < end; ++j) posted_b[base + j] = now_b, posted_e[base + j] = now_e;
          reached = end, progressed = true;
        }
        // Complete when every partner has posted (with eager sends: every receive's partner).
        bool complete = true;
        int met_b = now_b, met_e = now_e;
        for (int j = i; j < end; ++j) {
          const bool send = is_send(prog[j].op);
          if (send && !sends_wait) continue;
          const Place other = partner(pos, r, prog[j]);
          if (!run.is_posted(other)) {
            complete = false;
            break;
          }
          const int k = programs.offset[other.rank] + other.index;
          if (posted_b[k] > met_b) met_b = posted_b[k];
          if (!send && posted_e[k] > met_e) met_e = posted_e[k];
        }
        if (!complete) break;
        now_b = met_b, now_e = met_e, i = end, progressed = true;
      }
    }
  }
  for (int r = 0; r < P; ++r) run.finished = run.finished && run.at[r] == programs.size(r);
  return run;
}

// When a comm action completes in the run: when its partner met it (blocking),
// or when it was posted (a send, eager) or its send was (a receive, eager); -1: never.
constexpr int completed(const Programs& programs, const Positions& pos, const DryRun& run, Sends sends, int r,
                        int i) {
  const Action& a = programs.begin[r][i];
  const int* posted = run.posted(sends);
  const int mine = posted[programs.offset[r] + i];
  if (i >= run.reached[r]) return -1;
  if (sends == Sends::eager && is_send(a.op)) return mine;
  const Place other = partner(pos, r, a);
  if (!run.is_posted(other)) return -1;
  const int theirs = posted[programs.offset[other.rank] + other.index];
  return theirs > mine ? theirs : mine;
}

}  // namespace detail

// The dry run of all ranks with durations: when each action starts and ends.
template <class S>
constexpr Run execute(const S& s, Cost cost = {}, Sends sends = Sends::blocking) {
  const detail::Programs programs(s);
  const Positions pos = positions(programs);
  const detail::DryRun run = detail::dry_run(programs, pos, cost, sends);
  const int* posted = run.posted(sends);
  Run out{run.finished, {}, {}, {}, run.makespan[static_cast<int>(sends)]};
  for (int r = 0; r < programs.ranks(); ++r) {
    out.stopped_at.push_back(run.at[r]);
    auto& start = out.start.emplace_back(static_cast<std::size_t>(programs.size(r)), -1);
    auto& end = out.end.emplace_back(static_cast<std::size_t>(programs.size(r)), -1);
    for (int i = 0; i < run.reached[r]; ++i) {
      const Action& a = programs.begin[r][i];
      start[static_cast<std::size_t>(i)] = posted[programs.offset[r] + i];
      end[static_cast<std::size_t>(i)] = is_comm(a.op) ? detail::completed(programs, pos, run, sends, r, i)
                                                       : start[static_cast<std::size_t>(i)] + cost.of(a.op);
    }
  }
  return out;
}

// After a deadlocked run: a rank that waits in a send to a peer which itself
// waits in a send back to it, neither receive posted (the crossed-sends
// deadlock of blocking point-to-point). Its place, or {-1, -1}.
constexpr Place crossed_sends(const detail::Programs& programs, const Positions& pos, const detail::DryRun& run) {
  auto waiting_send_to = [&](int r, int q) {
    const int i = run.at[r], n = programs.size(r);
    const Action* prog = programs.begin[r];
    if (i >= n || !is_comm(prog[i].op)) return -1;
    for (int j = i; j < n && (j == i || (prog[j].joins_previous && is_comm(prog[j].op))); ++j)
      if (is_send(prog[j].op) && prog[j].peer == q && !run.is_posted(partner(pos, r, prog[j]))) return j;
    return -1;
  };
  for (int r = 0; r < programs.ranks(); ++r)
    for (int q = 0; q < programs.ranks(); ++q)
      if (q != r && waiting_send_to(r, q) >= 0 && waiting_send_to(q, r) >= 0) return {r, waiting_send_to(r, q)};
  return {};
}

}  // namespace fived::pipeline
