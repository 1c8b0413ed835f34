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

// Where each (rank, chunk, micro-batch)'s actions sit in its rank's program.
// Only reads actions whose micro-batch and chunk are in range.
struct Positions {
  static constexpr int kinds = static_cast<int>(Op::recv_grad) + 1;
  Shape shape;
  std::vector<int> first;  // [op][slot]: index of the first such action, or -1
  std::vector<int> count;  // [op][slot]: how many

  constexpr int slot(int rank, int chunk, int mb) const {
    return (rank * shape.chunks + chunk) * shape.micro_batches + mb;
  }
  constexpr std::size_t key(Op op, int rank, int chunk, int mb) const {
    return static_cast<std::size_t>(static_cast<int>(op) * shape.ranks * shape.chunks * shape.micro_batches +
                                    slot(rank, chunk, mb));
  }
  constexpr int at(Op op, int rank, int chunk, int mb) const { return first[key(op, rank, chunk, mb)]; }
  constexpr int how_many(Op op, int rank, int chunk, int mb) const { return count[key(op, rank, chunk, mb)]; }
  // Index of the action that produces the input gradient (B or I), or -1.
  constexpr int input_grad_at(int rank, int chunk, int mb) const {
    const int b = at(Op::backward, rank, chunk, mb);
    return b >= 0 ? b : at(Op::input_grad, rank, chunk, mb);
  }
};

constexpr bool in_range(const Shape& shape, const Action& a) {
  return a.mb >= 0 && a.mb < shape.micro_batches && a.chunk >= 0 && a.chunk < shape.chunks;
}

constexpr Positions positions(const Schedule& s) {
  const auto n = static_cast<std::size_t>(Positions::kinds * s.shape.ranks * s.shape.chunks * s.shape.micro_batches);
  Positions p{s.shape, std::vector<int>(n, -1), std::vector<int>(n, 0)};
  for (int r = 0; r < s.ranks(); ++r) {
    const auto prog = s.program(r);
    for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
      const Action& a = prog[i];
      if (a.op == Op::none || !in_range(s.shape, a)) continue;
      const auto k = p.key(a.op, r, a.chunk, a.mb);
      if (p.count[k]++ == 0) p.first[k] = i;
    }
  }
  return p;
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

constexpr Run execute(const Schedule& s, const Positions& pos, Cost cost = {}, Sends sends = Sends::blocking) {
  const int P = s.ranks();
  Run run;
  run.stopped_at.assign(static_cast<std::size_t>(P), 0);
  std::vector<int> clock(static_cast<std::size_t>(P), 0);
  for (int r = 0; r < P; ++r) {
    run.start.emplace_back(s.program(r).size(), -1);
    run.end.emplace_back(s.program(r).size(), -1);
  }
  auto& pc = run.stopped_at;
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < P; ++r) {
      const auto prog = s.program(r);
      auto& start = run.start[static_cast<std::size_t>(r)];
      auto& end = run.end[static_cast<std::size_t>(r)];
      auto& now = clock[static_cast<std::size_t>(r)];
      int& i = pc[static_cast<std::size_t>(r)];
      while (i < static_cast<int>(prog.size())) {
        const auto ui = static_cast<std::size_t>(i);
        if (!is_comm(prog[i].op)) {
          start[ui] = now;
          end[ui] = now += cost.of(prog[i].op);
          run.makespan = now > run.makespan ? now : run.makespan;
          ++i, progressed = true;
          continue;
        }
        const int group_end = step_end(prog, i);
        bool complete = true;
        for (int j = i; j < group_end; ++j) {
          const auto uj = static_cast<std::size_t>(j);
          if (start[uj] < 0) start[uj] = now, progressed = true;  // posted
          if (end[uj] >= 0) continue;
          if (sends == Sends::eager && is_send(prog[j].op)) {
            end[uj] = start[uj], progressed = true;
            continue;
          }
          const Place other = partner(pos, r, prog[j]);
          const int posted = other.index < 0 ? -1
                                             : run.start[static_cast<std::size_t>(other.rank)]
                                                        [static_cast<std::size_t>(other.index)];
          if (posted < 0) {
            complete = false;
            continue;
          }
          const int met = posted > start[uj] ? posted : start[uj];
          end[uj] = met;
          if (sends == Sends::blocking)
            run.end[static_cast<std::size_t>(other.rank)][static_cast<std::size_t>(other.index)] = met;
          progressed = true;
        }
        if (!complete) break;
        for (int j = i; j < group_end; ++j) {
          const int met = end[static_cast<std::size_t>(j)];
          now = met > now ? met : now;
        }
        i = group_end;
      }
    }
  }
  run.finished = true;
  for (int r = 0; r < P; ++r)
    run.finished = run.finished && pc[static_cast<std::size_t>(r)] == static_cast<int>(s.program(r).size());
  return run;
}

// After a deadlocked run: a rank that waits in a send to a peer which itself
// waits in a send back to it, neither receive posted (the crossed-sends
// deadlock of blocking point-to-point). Its place, or {-1, -1}.
constexpr Place crossed_sends(const Schedule& s, const Run& run) {
  auto waiting_send_to = [&](int r, int q) {
    const auto prog = s.program(r);
    const int i = run.stopped_at[static_cast<std::size_t>(r)];
    if (i >= static_cast<int>(prog.size()) || !is_comm(prog[i].op)) return -1;
    for (int j = i; j < step_end(prog, i); ++j)
      if (is_send(prog[j].op) && prog[j].peer == q && run.end[static_cast<std::size_t>(r)][static_cast<std::size_t>(j)] < 0)
        return j;
    return -1;
  };
  for (int r = 0; r < s.ranks(); ++r)
    for (int q = 0; q < s.ranks(); ++q)
      if (q != r && waiting_send_to(r, q) >= 0 && waiting_send_to(q, r) >= 0) return {r, waiting_send_to(r, q)};
  return {};
}

}  // namespace fived::pipeline
