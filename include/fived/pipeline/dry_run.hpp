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
// once. A view of arrays that detail::Index below fills (from actions whose
// micro-batch and chunk are in range).
struct Positions {
  static constexpr int kinds = static_cast<int>(Op::recv_grad);  // the ops after Op::none
  Shape shape;
  const int* first;               // [slot · kinds + op - 1]: 1 + index of the first such action; 0: none
  const unsigned char* repeated;  // [slot]: bit op - 1 set when that op comes again

  constexpr int slot(int rank, int chunk, int mb) const {
    return (rank * shape.chunks + chunk) * shape.micro_batches + mb;
  }
  // Index of the first such action, or -1.
  constexpr int at(Op op, int rank, int chunk, int mb) const {
    return first[slot(rank, chunk, mb) * kinds + static_cast<int>(op) - 1] - 1;
  }
};

namespace detail {

// For every comm action (numbered as Programs numbers them), the comm action it
// meets on the other rank: same micro-batch, the neighbouring stage, the
// opposite direction (the first such; -1 where there is none, and for compute
// actions). A view of arrays that Index fills.
struct Partners {
  const int* action;  // [action]: the partner's number
  const int* rank;    // [action]: the partner's rank
};

// What the checks and the dry run look up, found in two passes over the table.
// (These loops, and the others that visit every action, run inside the
// compiler for each schedule type a program names: they call nothing and look
// neighbours up in arrays, since a call there costs as much as many operators.)
//
// `first` and `repeated` must come zeroed; `partner` and `partner_rank` are written whole.
constexpr void find_positions(const Programs& programs, int* first, unsigned char* repeated) {
  const Shape& sh = programs.shape;
  const int V = sh.chunks, M = sh.micro_batches;
  for (int r = 0; r < sh.ranks; ++r) {
    const Action* prog = programs.begin[r];
    const int n = programs.offset[r + 1] - programs.offset[r];
    for (int i = 0; i < n; ++i) {
      const Action& a = prog[i];
      if (a.op == Op::none || a.mb < 0 || a.mb >= M || a.chunk < 0 || a.chunk >= V) continue;
      const int slot = (r * V + a.chunk) * M + a.mb, kind = static_cast<int>(a.op) - 1;
      int& at = first[slot * Positions::kinds + kind];
      if (at == 0) at = i + 1;
      else repeated[slot] |= static_cast<unsigned char>(1 << kind);
    }
  }
}

constexpr void find_partners(const Programs& programs, const int* first, int* partner, int* partner_rank) {
  const Shape& sh = programs.shape;
  const int V = sh.chunks, M = sh.micro_batches;
  const StageMap map(sh);
  for (int r = 0; r < sh.ranks; ++r) {
    const Action* prog = programs.begin[r];
    const int base = programs.offset[r], n = programs.offset[r + 1] - base;
    for (int i = 0; i < n; ++i) {
      const Action& a = prog[i];
      // The other end: the next stage for send_act and recv_grad, the previous for the other two;
      // send_act <-> recv_act and send_grad <-> recv_grad are kinds 4 <-> 5 and 6 <-> 7.
      const bool comm = a.op >= Op::send_act && a.op <= Op::recv_grad && a.mb >= 0 && a.mb < M && a.chunk >= 0 &&
                        a.chunk < V;
      const int other = !comm ? -1
                        : a.op == Op::send_act || a.op == Op::recv_grad ? map.next[r * V + a.chunk]
                                                                        : map.prev[r * V + a.chunk],
                kind = static_cast<int>(a.op) - 1, other_kind = kind % 2 == 0 ? kind + 1 : kind - 1,
                at = other < 0 ? -1 : first[(other * M + a.mb) * Positions::kinds + other_kind] - 1;
      partner[base + i] = at < 0 ? -1 : programs.offset[other / V] + at, partner_rank[base + i] = other / V;
    }
  }
}

// Positions and Partners of a table, in arrays sized at run time (Scratch)...
class Index {
 public:
  constexpr explicit Index(const Programs& programs)
      : shape_(programs.shape),
        first_(slots(programs.shape) * Positions::kinds, 0),
        repeated_(slots(programs.shape), 0),
        partner_(programs.total()),
        partner_rank_(programs.total()) {
    find_positions(programs, first_.data(), repeated_.data());
    find_partners(programs, first_.data(), partner_.data(), partner_rank_.data());
  }
  constexpr Positions positions() const { return {shape_, first_.data(), repeated_.data()}; }
  constexpr Partners partners() const { return {partner_.data(), partner_rank_.data()}; }
  static constexpr int slots(const Shape& sh) { return sh.ranks * sh.chunks * sh.micro_batches; }

 private:
  Shape shape_;
  Scratch<int> first_;
  Scratch<unsigned char> repeated_;
  Scratch<int> partner_, partner_rank_;
};

// ... and in arrays of fixed size, a constant of its own for a Table.
template <class TableType>
struct StaticIndex {
  static constexpr int slots = TableType::ranks * TableType::chunks * TableType::micro_batches,
                       actions = TableType::ranks * TableType::capacity;
  int first[slots * Positions::kinds]{};
  unsigned char repeated[slots]{};
  int partner[actions]{}, partner_rank[actions]{};

  constexpr explicit StaticIndex(const TableType& t) {
    const Programs programs(t);
    find_positions(programs, first, repeated);
    find_partners(programs, first, partner, partner_rank);
  }
  constexpr Positions positions() const { return {TableType::shape, first, repeated}; }
  constexpr Partners partners() const { return {partner, partner_rank}; }
};

}  // namespace detail

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
  Scratch<int> at;       // [rank]: the action it runs next, or waits in (the program's size: finished)
  Scratch<int> reached;  // [rank]: every action before this one has started (compute) or is posted (comm)
  Scratch<int> posted_blocking, posted_eager;  // [action]: when it started or was posted
  int makespan[2] = {0, 0};                    // [Sends]: end of the last compute action

  constexpr DryRun(int ranks, int actions)
      : at(ranks, 0), reached(ranks, 0), posted_blocking(actions), posted_eager(actions) {}
  constexpr const int* posted(Sends s) const { return (s == Sends::blocking ? posted_blocking : posted_eager).data(); }
  // Whether the partner of action number k has been posted.
  constexpr bool partner_posted(const Programs& programs, const Partners& partners, int k) const {
    const int other = partners.action[k];
    return other >= 0 && other - programs.offset[partners.rank[k]] < reached[partners.rank[k]];
  }
};

constexpr DryRun dry_run(const Programs& programs, const Partners& partners, Cost cost, Sends drive) {
  static_assert(static_cast<int>(Sends::blocking) == 0 && static_cast<int>(Sends::eager) == 1);
  const int P = programs.ranks();
  const bool sends_wait = drive == Sends::blocking;
  DryRun run(P, programs.total());
  Scratch<int> clock_b(P, 0), clock_e(P, 0);
  int cost_of[9] = {};
  for (int op = 0; op < 9; ++op) cost_of[op] = cost.of(static_cast<Op>(op));
  int* posted_b = run.posted_blocking.data();
  int* posted_e = run.posted_eager.data();
  int* at = run.at.data();
  int* reached = run.reached.data();
  const int* offset = programs.offset.data();
  const int* partner = partners.action;
  const int* partner_rank = partners.rank;
  // Sweeps down the ranks and back up, in turn: a chain of waits that runs either
  // way along the ranks then resolves in one sweep, so the sweeps are as many as the
  // chains' turns, not as their length times P.
  // A rank that waits skips the sweep until the partner it waits for is posted.
  Scratch<int> awaiting(P, -1), awaiting_rank(P, 0);
  int *awaits = awaiting.data(), *awaited_rank = awaiting_rank.data(), *now_blocking = clock_b.data(),
      *now_eager = clock_e.data();
  int& makespan_b = run.makespan[0];
  int& makespan_e = run.makespan[1];
  for (bool progressed = true, down = true; progressed; down = !down) {
    progressed = false;
    for (int step = 0; step < P; ++step) {
      const int r = down ? step : P - 1 - step;
      if (awaits[r] >= 0 && awaits[r] - offset[awaited_rank[r]] >= reached[awaited_rank[r]]) continue;
      const Action* prog = programs.begin[r];
      const int base = offset[r], n = offset[r + 1] - base;
      int now_b = now_blocking[r], now_e = now_eager[r], i = at[r];
      while (i < n) {
        // A run of compute actions, each starting as the one before it ends.
        for (; i < n && prog[i].op < Op::send_act; ++i)
          posted_b[base + i] = now_b, posted_e[base + i] = now_e, now_b += cost_of[static_cast<int>(prog[i].op)],
                       now_e += cost_of[static_cast<int>(prog[i].op)],
                       makespan_b = now_b > makespan_b ? now_b : makespan_b,
                       makespan_e = now_e > makespan_e ? now_e : makespan_e, reached[r] = i + 1, progressed = true;
        if (i == n) break;
        // A comm group: this action and those joined to it, all posted when the rank reaches it.
        int end = i + 1;
        while (end < n && prog[end].joins_previous && prog[end].op >= Op::send_act) ++end;
        for (int j = base + (reached[r] < end ? i : end); j < base + end; ++j)
          posted_b[j] = now_b, posted_e[j] = now_e, reached[r] = end, progressed = true;
        // Complete when every partner has posted (with eager sends: every receive's partner);
        // a partner that does not exist is never posted.
        int j = base + i, met_b = now_b, met_e = now_e;
        for (; j < base + end; ++j) {
          const int k = partner[j], q = partner_rank[j],
                    send = prog[j - base].op == Op::send_act || prog[j - base].op == Op::send_grad,
                    waits = !send || sends_wait;
          if (waits && (k < 0 || k - offset[q] >= reached[q])) break;
          met_b = waits && posted_b[k] > met_b ? posted_b[k] : met_b,
          met_e = waits && !send && posted_e[k] > met_e ? posted_e[k] : met_e;
        }
        if (j < base + end) {
          awaits[r] = partner[j] >= 0 ? partner[j] : 1 << 30, awaited_rank[r] = partner[j] >= 0 ? partner_rank[j] : r;
          break;
        }
        now_b = met_b, now_e = met_e, i = end, awaits[r] = -1;
      }
      now_blocking[r] = now_b, now_eager[r] = now_e, at[r] = i;
    }
  }
  for (int r = 0; r < P; ++r) run.finished = run.finished && at[r] == offset[r + 1] - offset[r];
  return run;
}

// When comm action i of rank r completes in the run: when its partner met it
// (blocking), or when it was posted (a send, eager) or its send was (a receive,
// eager); -1: never.
constexpr int completed(const Programs& programs, const Partners& partners, const DryRun& run, Sends sends, int r,
                        int i) {
  const int k = programs.offset[r] + i;
  if (i >= run.reached[r]) return -1;
  const int* posted = run.posted(sends);
  if (sends == Sends::eager && is_send(programs.begin[r][i].op)) return posted[k];
  if (!run.partner_posted(programs, partners, k)) return -1;
  const int theirs = posted[partners.action[k]];
  return theirs > posted[k] ? theirs : posted[k];
}

}  // namespace detail

// The dry run of all ranks with durations: when each action starts and ends.
template <class S>
constexpr Run execute(const S& s, Cost cost = {}, Sends sends = Sends::blocking) {
  const detail::Programs programs(s);
  const detail::Index index(programs);
  const detail::Partners partners = index.partners();
  const detail::DryRun run = detail::dry_run(programs, partners, cost, sends);
  const int* posted = run.posted(sends);
  Run out{run.finished, {}, {}, {}, run.makespan[static_cast<int>(sends)]};
  for (int r = 0; r < programs.ranks(); ++r) {
    out.stopped_at.push_back(run.at[r]);
    auto& start = out.start.emplace_back(static_cast<std::size_t>(programs.size(r)), -1);
    auto& end = out.end.emplace_back(static_cast<std::size_t>(programs.size(r)), -1);
    for (int i = 0; i < run.reached[r]; ++i) {
      const Action& a = programs.begin[r][i];
      start[static_cast<std::size_t>(i)] = posted[programs.offset[r] + i];
      end[static_cast<std::size_t>(i)] = is_comm(a.op) ? detail::completed(programs, partners, run, sends, r, i)
                                                       : start[static_cast<std::size_t>(i)] + cost.of(a.op);
    }
  }
  return out;
}

struct Place {
  int rank = -1, index = -1;
};

// After a deadlocked run: a rank that waits in a send to a peer which itself
// waits in a send back to it, neither receive posted (the crossed-sends
// deadlock of blocking point-to-point). Its place, or {-1, -1}.
constexpr Place crossed_sends(const detail::Programs& programs, const detail::Partners& partners,
                              const detail::DryRun& run) {
  auto waiting_send_to = [&](int r, int q) {
    const int i = run.at[r], n = programs.size(r);
    const Action* prog = programs.begin[r];
    if (i >= n || !is_comm(prog[i].op)) return -1;
    for (int j = i; j < n && (j == i || (prog[j].joins_previous && is_comm(prog[j].op))); ++j)
      if (is_send(prog[j].op) && prog[j].peer == q && !run.partner_posted(programs, partners, programs.offset[r] + j))
        return j;
    return -1;
  };
  for (int r = 0; r < programs.ranks(); ++r)
    for (int q = 0; q < programs.ranks(); ++q)
      if (q != r && waiting_send_to(r, q) >= 0 && waiting_send_to(q, r) >= 0) return {r, waiting_send_to(r, q)};
  return {};
}

}  // namespace fived::pipeline
