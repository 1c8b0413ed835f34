#pragma once
// verify(schedule): the proofs, as one constexpr function.
//
// Checks the properties below in order and reports the first that fails, with
// the place (rank, position in its program, micro-batch, chunk) where it first
// fails; position -1 means an action is missing. Proven<> (proven.hpp) turns
// each property into a static_assert with its own sentence (sentences.hpp).
//
//   well_formed                   micro-batch, chunk and peer in range; groups join comm actions only
//   one_forward_each              every stage (rank, chunk) runs M forwards, one per micro-batch
//   one_backward_each             ... and M backwards: one B, or one I and one W
//   forward_before_backward       F before its B or I, on the same stage
//   input_grad_before_weight_grad I before its W
//   peers_are_neighbours          a message names the rank of the neighbouring virtual stage
//   one_send_each                 activations and input gradients sent once, where the neighbour is on another rank
//   one_receive_each              ... and received once: every send has its receive
//   sends_after_compute           a send comes after the compute that produced what it sends
//   forward_after_input           F after its activations arrived (or after the previous stage's F on the same rank)
//   backward_after_gradient       B or I after its output gradient arrived (or after the next stage's B or I)
//   sends_match_receives          between two ranks, the k-th send is the k-th receive (NCCL matches in order)
//   no_crossed_sends              the dry run (dry_run.hpp) does not stop in two sends that wait for each other
//   progresses                    the dry run reaches the end of every program: no deadlock

#include <string_view>
#include <vector>

#include "fived/pipeline/dry_run.hpp"
#include "fived/pipeline/sentences.hpp"

namespace fived::pipeline {

enum class Property : unsigned char {
  none,  // nothing failed
  shape,
  well_formed,
  one_forward_each,
  one_backward_each,
  forward_before_backward,
  input_grad_before_weight_grad,
  peers_are_neighbours,
  one_send_each,
  one_receive_each,
  sends_after_compute,
  forward_after_input,
  backward_after_gradient,
  sends_match_receives,
  no_crossed_sends,
  progresses,
};

constexpr std::string_view describe(Property p) {
  switch (p) {
    case Property::none: return "fived::pipeline: the schedule is proven";
    case Property::shape: return FIVED_PIPELINE_SAYS_SHAPE;
    case Property::well_formed: return FIVED_PIPELINE_SAYS_WELL_FORMED;
    case Property::one_forward_each: return FIVED_PIPELINE_SAYS_ONE_FORWARD_EACH;
    case Property::one_backward_each: return FIVED_PIPELINE_SAYS_ONE_BACKWARD_EACH;
    case Property::forward_before_backward: return FIVED_PIPELINE_SAYS_FORWARD_BEFORE_BACKWARD;
    case Property::input_grad_before_weight_grad: return FIVED_PIPELINE_SAYS_INPUT_GRAD_BEFORE_WEIGHT_GRAD;
    case Property::peers_are_neighbours: return FIVED_PIPELINE_SAYS_PEERS_ARE_NEIGHBOURS;
    case Property::one_send_each: return FIVED_PIPELINE_SAYS_ONE_SEND_EACH;
    case Property::one_receive_each: return FIVED_PIPELINE_SAYS_ONE_RECEIVE_EACH;
    case Property::sends_after_compute: return FIVED_PIPELINE_SAYS_SENDS_AFTER_COMPUTE;
    case Property::forward_after_input: return FIVED_PIPELINE_SAYS_FORWARD_AFTER_INPUT;
    case Property::backward_after_gradient: return FIVED_PIPELINE_SAYS_BACKWARD_AFTER_GRADIENT;
    case Property::sends_match_receives: return FIVED_PIPELINE_SAYS_SENDS_MATCH_RECEIVES;
    case Property::no_crossed_sends: return FIVED_PIPELINE_SAYS_NO_CROSSED_SENDS;
    case Property::progresses: return FIVED_PIPELINE_SAYS_PROGRESSES;
  }
  return "?";
}

struct Verdict {
  Property failed = Property::none;
  int rank = -1, position = -1, mb = -1, chunk = -1;  // where it first fails
  constexpr bool ok() const { return failed == Property::none; }
};

namespace detail {

// Walks every (rank, chunk, micro-batch) and every action; returns the first failure of one property.
struct Checker {
  const Schedule& s;
  const Positions& pos;

  constexpr Verdict fail(Property p, int rank, int position, int mb, int chunk) const {
    return {p, rank, position, mb, chunk};
  }

  // First slot (in rank, chunk, micro-batch order) where `bad(r, c, m)` returns a
  // position >= -1 (the offending action, or -1 when missing); -2 means fine.
  template <class Bad>
  constexpr Verdict each_slot(Property p, Bad bad) const {
    for (int r = 0; r < s.shape.ranks; ++r)
      for (int c = 0; c < s.shape.chunks; ++c)
        for (int m = 0; m < s.shape.micro_batches; ++m)
          if (const int at = bad(r, c, m); at >= -1) return fail(p, r, at, m, c);
    return {};
  }

  constexpr Verdict well_formed() const {
    for (int r = 0; r < s.ranks(); ++r) {
      const auto prog = s.program(r);
      for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
        const Action& a = prog[i];
        const bool comm = is_comm(a.op);
        const bool ok = a.op != Op::none && in_range(s.shape, a) &&
                        (!comm || (a.peer >= 0 && a.peer < s.ranks() && a.peer != r)) &&
                        (!a.joins_previous || (comm && i > 0 && is_comm(prog[i - 1].op)));
        if (!ok) return fail(Property::well_formed, r, i, a.mb, a.chunk);
      }
    }
    return {};
  }

  // The second one of a repeated action, or -1 when there is none.
  constexpr int repeat_of(Op op, int r, int c, int m) const {
    const auto prog = s.program(r);
    for (int i = pos.at(op, r, c, m) + 1; i < static_cast<int>(prog.size()); ++i)
      if (prog[i].op == op && prog[i].mb == m && prog[i].chunk == c) return i;
    return -1;
  }

  constexpr Verdict counts() const {
    if (auto v = each_slot(Property::one_forward_each, [&](int r, int c, int m) {
          const int n = pos.how_many(Op::forward, r, c, m);
          return n == 1 ? -2 : n == 0 ? -1 : repeat_of(Op::forward, r, c, m);
        });
        !v.ok())
      return v;
    return each_slot(Property::one_backward_each, [&](int r, int c, int m) {
      const int b = pos.how_many(Op::backward, r, c, m), i = pos.how_many(Op::input_grad, r, c, m),
                w = pos.how_many(Op::weight_grad, r, c, m);
      if ((b == 1 && i == 0 && w == 0) || (b == 0 && i == 1 && w == 1)) return -2;
      if (b > 1) return repeat_of(Op::backward, r, c, m);
      if (i > 1) return repeat_of(Op::input_grad, r, c, m);
      if (w > 1) return repeat_of(Op::weight_grad, r, c, m);
      if (b == 1) return i == 1 ? pos.at(Op::input_grad, r, c, m) : pos.at(Op::weight_grad, r, c, m);
      return -1;  // missing: no B, or an I without its W (or the other way round)
    });
  }

  constexpr Verdict compute_order() const {
    if (auto v = each_slot(Property::forward_before_backward, [&](int r, int c, int m) {
          const int b = pos.input_grad_at(r, c, m);
          return b < pos.at(Op::forward, r, c, m) ? b : -2;
        });
        !v.ok())
      return v;
    return each_slot(Property::input_grad_before_weight_grad, [&](int r, int c, int m) {
      const int w = pos.at(Op::weight_grad, r, c, m);
      return w >= 0 && w < pos.at(Op::input_grad, r, c, m) ? w : -2;
    });
  }

  constexpr Verdict peers() const {
    const Shape& sh = s.shape;
    for (int r = 0; r < s.ranks(); ++r) {
      const auto prog = s.program(r);
      for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
        const Action& a = prog[i];
        if (!is_comm(a.op)) continue;
        const bool to_next = a.op == Op::send_act || a.op == Op::recv_grad;
        const bool exists = to_next ? sh.sends_forward(r, a.chunk) : sh.sends_backward(r, a.chunk);
        const int st = sh.stage(r, a.chunk);
        if (!exists || a.peer != sh.rank_of(to_next ? st + 1 : st - 1))
          return fail(Property::peers_are_neighbours, r, i, a.mb, a.chunk);
      }
    }
    return {};
  }

  // Exactly one of `op` where the stage has a neighbour on another rank on that side.
  constexpr int once(Op op, bool needed, int r, int c, int m) const {
    const int n = pos.how_many(op, r, c, m);
    if (n == (needed ? 1 : 0)) return -2;
    return n == 0 ? -1 : repeat_of(op, r, c, m);
  }

  constexpr Verdict messages() const {
    const Shape& sh = s.shape;
    if (auto v = each_slot(Property::one_send_each, [&](int r, int c, int m) {
          const int a = once(Op::send_act, sh.sends_forward(r, c), r, c, m);
          return a >= -1 ? a : once(Op::send_grad, sh.sends_backward(r, c), r, c, m);
        });
        !v.ok())
      return v;
    return each_slot(Property::one_receive_each, [&](int r, int c, int m) {
      const int a = once(Op::recv_act, sh.sends_backward(r, c), r, c, m);
      return a >= -1 ? a : once(Op::recv_grad, sh.sends_forward(r, c), r, c, m);
    });
  }

  constexpr Verdict data_order() const {
    const Shape& sh = s.shape;
    if (auto v = each_slot(Property::sends_after_compute, [&](int r, int c, int m) {
          const int a = pos.at(Op::send_act, r, c, m), g = pos.at(Op::send_grad, r, c, m);
          if (a >= 0 && a < pos.at(Op::forward, r, c, m)) return a;
          if (g >= 0 && g < pos.input_grad_at(r, c, m)) return g;
          return -2;
        });
        !v.ok())
      return v;
    if (auto v = each_slot(Property::forward_after_input, [&](int r, int c, int m) {
          const int f = pos.at(Op::forward, r, c, m), st = sh.stage(r, c);
          if (st == 0) return -2;
          const int before = sh.sends_backward(r, c) ? pos.at(Op::recv_act, r, c, m)
                                                     : pos.at(Op::forward, r, sh.chunk_of(st - 1), m);
          return before < f ? -2 : f;
        });
        !v.ok())
      return v;
    return each_slot(Property::backward_after_gradient, [&](int r, int c, int m) {
      const int b = pos.input_grad_at(r, c, m), st = sh.stage(r, c);
      if (st + 1 == sh.stages()) return -2;
      const int before = sh.sends_forward(r, c) ? pos.at(Op::recv_grad, r, c, m)
                                                : pos.input_grad_at(r, sh.chunk_of(st + 1), m);
      return before < b ? -2 : b;
    });
  }

  // Numbers every send and every receive by its order among those between the
  // same two ranks; a message's two ends must have the same number.
  constexpr Verdict pairing() const {
    const int P = s.ranks();
    std::vector<std::vector<int>> order;  // order[r][i]: k for the k-th send r -> peer or receive peer -> r
    for (int r = 0; r < P; ++r) {
      const auto prog = s.program(r);
      std::vector<int> sent(static_cast<std::size_t>(P), 0), received(static_cast<std::size_t>(P), 0);
      auto& k = order.emplace_back(prog.size(), -1);
      for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
        if (!is_comm(prog[i].op)) continue;
        auto& counter = is_send(prog[i].op) ? sent : received;
        k[static_cast<std::size_t>(i)] = counter[static_cast<std::size_t>(prog[i].peer)]++;
      }
    }
    for (int r = 0; r < P; ++r) {
      const auto prog = s.program(r);
      for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
        if (!is_recv(prog[i].op)) continue;
        const Place from = partner(pos, r, prog[i]);
        if (order[static_cast<std::size_t>(from.rank)][static_cast<std::size_t>(from.index)] !=
            order[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)])
          return fail(Property::sends_match_receives, r, i, prog[i].mb, prog[i].chunk);
      }
    }
    return {};
  }

  constexpr Verdict dry_run() const {
    const Run run = execute(s, pos);
    if (run.finished) return {};
    const Place crossed = crossed_sends(s, run);
    const Property p = crossed.rank >= 0 ? Property::no_crossed_sends : Property::progresses;
    int r = crossed.rank, i = crossed.index;
    for (int q = 0; r < 0 && q < s.ranks(); ++q)
      if (run.stopped_at[static_cast<std::size_t>(q)] < static_cast<int>(s.program(q).size()))
        r = q, i = run.stopped_at[static_cast<std::size_t>(q)];
    const Action& a = s.program(r)[static_cast<std::size_t>(i)];
    return fail(p, r, i, a.mb, a.chunk);
  }
};

}  // namespace detail

constexpr Verdict verify(const Schedule& s) {
  if (!s.shape.valid() || static_cast<int>(s.programs.size()) != s.shape.ranks) return {Property::shape};
  const Positions pos = positions(s);
  const detail::Checker check{s, pos};
  for (auto step : {&detail::Checker::well_formed, &detail::Checker::counts, &detail::Checker::compute_order,
                    &detail::Checker::peers, &detail::Checker::messages, &detail::Checker::data_order,
                    &detail::Checker::pairing, &detail::Checker::dry_run})
    if (const Verdict v = (check.*step)(); !v.ok()) return v;
  return {};
}

}  // namespace fived::pipeline
