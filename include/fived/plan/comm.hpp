#pragma once
// Communication of one rank in one optimizer step, per group, as the Counting communicator
// (comm/counting.hpp) tallies it: calls per kind of collective, and the bytes of this rank's
// send buffers (a reduce-scatter's whole input, an all-gather's piece, a send_recv's sends).
// Per micro-batch, with x = [N, C] and y = [n, C] in elements of t bytes (plan/activations.hpp):
//
//   TP, no SP   embedding AR x; per block AR x (attention) + AR x (FFN) forward, the same
//               backward; head: loss 3 AR of [N] stats, backward AR x
//   TP, SP      embedding RS x, backward AG y; per block AG y + RS x for each of attention and
//               FFN, forward and backward; head AG y, loss 3 AR [N], backward RS x; one AR of
//               the LayerNorm gradients per unit that has them (block: 2 norms, last: ln_f)
//   MoE (TP)    the FFN's collectives, plus an AR of the gates' gradient [N·k] stats backward
//   recompute   FullRecompute runs each block's forward again in backward, collectives and all
//               (TP, CP, EP); SelectiveRecompute runs the core attention again: under CP the ring
//   CP          per block: forward CP-1 send_recv of the packed k|v [N, 2·KV·hd/TP] (t), backward
//               CP-1 of k|v and CP of its gradient accumulator (stat bytes); with a balancing
//               loss an AR of 2E stats per MoE block forward
//   EP          per MoE block: forward the counts (all_to_all, E int64) and the rows out and
//               back (2 all_to_all_v of N·k rows of C), backward 2 all_to_all_v; balanced
//               routing: a rank receives as many rows as it sends. Experts padded to capacity:
//               no counts, and E·capacity rows each way whatever the routing (exact)
//   PP          read off the schedule's table: one send_recv per comm group of the rank's
//               program, y bytes per send (activations forward, gradients backward); a tied
//               model's first and last stage swap what they own of the tied gradient (one
//               send_recv: plan/plan.hpp's tied_swap_elements)
//   DP x CP     per bucket of the dense buffer (BucketPlan): NoZeRO AR of the bucket once;
//               ZeRO-1 RS (padded) + AG (padded/G) once; ZeRO-2 RS every micro-batch + AG once;
//               ZeRO-3 RS every micro-batch, AG once for the end units (kept for the step)
//               and twice per micro-batch (forward, backward) for the others
//   experts     the same over the expert-data group, for the expert buffer
//
// The counts of the TP layers are the ones architecture.md gives and tests/test_tp_gpt.cpp
// checks with Counting; tests/test_plan.cpp checks whole trainer steps of small meshes the
// same way. The step's host values (step_scalars) count too: every chunk's gradient norm
// summed over TP and, under ZeRO, over its group (the experts': over TP, EP and theirs), the
// mean loss over DP x CP, and over PP the norm and the loss: an all-reduce of 8 bytes each, as
// the trainer issues them; and the experts' loads of each MoE block (E stats over DP x CP).

#include <cstdint>
#include <span>

#include "fived/comm/counting.hpp"
#include "fived/pipeline/action.hpp"
#include "fived/pipeline/table.hpp"
#include "fived/plan/activations.hpp"
#include "fived/plan/model.hpp"
#include "fived/train/bucket_plan.hpp"

namespace fived::plan {

namespace detail {
constexpr int tally_kinds = 8;
template <class Counts>  // CommCounts, const or not: its k-th tally
constexpr auto kind(Counts& c, int k) -> decltype((c.all_reduce)) {
  switch (k) {
    case 0: return c.all_reduce;
    case 1: return c.reduce_scatter;
    case 2: return c.all_gather;
    case 3: return c.all_to_all;
    case 4: return c.all_to_all_v;
    case 5: return c.send_recv;
    case 6: return c.broadcast;
    default: return c.barrier;
  }
}
}  // namespace detail

// a += b, tally by tally.
constexpr void add(CommCounts& a, const CommCounts& b) {
  for (int k = 0; k < detail::tally_kinds; ++k) {
    detail::kind(a, k).calls += detail::kind(b, k).calls;
    detail::kind(a, k).bytes += detail::kind(b, k).bytes;
  }
}
// The larger calls and bytes of a and b, tally by tally.
constexpr void keep_max(CommCounts& a, const CommCounts& b) {
  for (int k = 0; k < detail::tally_kinds; ++k) {
    Tally& x = detail::kind(a, k);
    const Tally& y = detail::kind(b, k);
    x.calls = y.calls > x.calls ? y.calls : x.calls;
    x.bytes = y.bytes > x.bytes ? y.bytes : x.bytes;
  }
}

// What one rank issues on each of its groups in one step.
struct Traffic {
  CommCounts tp, cp, ep, pp, grad, expert_data;  // grad: DP x CP; expert_data: DP·CP/EP
  constexpr Traffic& operator+=(const Traffic& o) {
    add(tp, o.tp), add(cp, o.cp), add(ep, o.ep), add(pp, o.pp), add(grad, o.grad), add(expert_data, o.expert_data);
    return *this;
  }
  // Each tally the larger of the two: over pipeline ranks, the busiest rank's, kind by kind.
  constexpr void keep_max(const Traffic& o) {
    plan::keep_max(tp, o.tp), plan::keep_max(cp, o.cp), plan::keep_max(ep, o.ep), plan::keep_max(pp, o.pp);
    plan::keep_max(grad, o.grad), plan::keep_max(expert_data, o.expert_data);
  }
};

namespace detail {
constexpr void tally(Tally& t, std::int64_t calls, std::int64_t bytes_each) {
  t.calls += calls;
  t.bytes += calls * bytes_each;
}
}  // namespace detail

// TP, CP and EP traffic of one part for M micro-batches.
constexpr Traffic layer_traffic(const Transformer& m, const Blocks& part, const Rows& a, int M) {
  using detail::tally;
  Traffic r;
  const std::int64_t C = m.d_model, x = a.N * C * a.t, y = a.n * C * a.t, Nk = a.N * m.top_k;
  const bool full = a.recompute == Recompute::full;
  if (a.tp > 1) {
    CommCounts& c = r.tp;
    // reduce_rows (a Partial sum to the stream) and gather_rows (the stream to every row)
    auto reduce = [&](std::int64_t k) { a.sp ? tally(c.reduce_scatter, k, x) : tally(c.all_reduce, k, x); };
    auto gather = [&](std::int64_t k) {
      if (a.sp) tally(c.all_gather, k, y);
    };
    if (part.embedding) reduce(M), gather(M);  // forward, backward
    for (int l = part.first; l < part.first + part.count; ++l) {
      const int forwards = full ? 2 : 1;
      gather(2 * forwards * M), reduce(2 * forwards * M);  // attention and FFN (or MoE), forward
      gather(2 * M), reduce(2 * M);                        // backward
      if (m.is_moe(l)) tally(c.all_reduce, M, Nk * a.st);  // d(gate)
      if (a.sp) tally(c.all_reduce, M, m.block_norms() * m.norm_elements() * a.t);  // the unit's LayerNorm gradients
      if (m.kv_heads < a.tp)  // key/value heads on several ranks: their projections' gradient slots
        tally(c.all_reduce, M, 2 * std::int64_t{m.kv_heads} * m.head_dim() * C * a.t);
    }
    if (part.head) {
      gather(M), tally(c.all_reduce, 3 * M, a.N * a.st), reduce(M);
      if (a.sp) tally(c.all_reduce, M, m.norm_elements() * a.t);  // ln_f's gradients
    }
  }
  if (a.cp > 1) {
    const std::int64_t kv = a.N * (m.local_qkv_width(a.tp) - m.attention_width() / a.tp);  // the local [k | v]
    const int rings = a.recompute == Recompute::none ? 1 : 2;  // forward, and its recomputation
    for (int l = part.first; l < part.first + part.count; ++l) {
      if (m.allgather_context) {
        tally(r.cp.all_gather, (rings + 1) * std::int64_t{M}, kv * a.t);  // forward(s) and backward: k|v
        tally(r.cp.reduce_scatter, M, a.cp * kv * a.st);                   // d[k|v] of every gathered row
      } else {
        tally(r.cp.send_recv, rings * (a.cp - 1) * std::int64_t{M}, kv * a.t);
        tally(r.cp.send_recv, (a.cp - 1) * std::int64_t{M}, kv * a.t);  // backward: k|v again
        tally(r.cp.send_recv, a.cp * std::int64_t{M}, kv * a.st);       // and d[k|v]
      }
      if (m.is_moe(l) && m.balancing_loss) tally(r.cp.all_reduce, (full ? 2 : 1) * M, 2 * m.experts * a.st);
    }
  }
  if (a.ep > 1)
    for (int l = part.first; l < part.first + part.count; ++l)
      if (m.is_moe(l)) {  // padded experts exchange no counts, and exactly E·capacity rows each way
        const int forwards = full ? 2 : 1;
        if (!m.pad_to_capacity) tally(r.ep.all_to_all, forwards * M, m.experts * 8);
        tally(r.ep.all_to_all_v, (2 * forwards + 2) * std::int64_t{M}, m.dispatch_rows(a.N) * C * a.t);
      }
  return r;
}

// The scalars one chunk's optimizer step reduces (an all-reduce each): its gradient norm's sum
// (an 8-byte double) over TP (DataParallel::grad_sum_of_squares, Decoder::sum_over_tp) and,
// under ZeRO, over DP x CP; with experts the same for the expert buffer (over TP, EP and the
// expert-data group), and the loads of its MoE blocks over DP x CP, a statistic per expert of
// each (Decoder::balance_experts).
constexpr Traffic chunk_scalars(const Transformer& m, const Blocks& part, const Rows& a, int grad, int edp, int zero,
                                int expert_zero) {
  using detail::tally;
  Traffic r;
  if (a.tp > 1) tally(r.tp.all_reduce, 1, 8);
  if (zero >= 1 && grad > 1) tally(r.grad.all_reduce, 1, 8);
  int moe = 0;
  for (int l = part.first; l < part.first + part.count; ++l) moe += m.is_moe(l) ? 1 : 0;
  if (moe > 0) {
    if (a.tp > 1) tally(r.tp.all_reduce, 1, 8);
    if (a.ep > 1) tally(r.ep.all_reduce, 1, 8);
    if (expert_zero >= 1 && edp > 1) tally(r.expert_data.all_reduce, 1, 8);
    if (grad > 1) tally(r.grad.all_reduce, 1, std::int64_t{moe} * m.experts * a.st);
  }
  return r;
}

// The host values of the whole step on a pipeline rank of P (pipeline/executor.hpp): the mean
// loss over DP x CP, and over PP the norm's sum and the loss.
constexpr Traffic step_scalars(int grad, int P) {
  Traffic r;
  if (grad > 1) detail::tally(r.grad.all_reduce, 1, 8);
  if (P > 1) detail::tally(r.pp.all_reduce, 2, 8);
  return r;
}

// One pipeline rank's point-to-point traffic in a step: its program's comm groups (one
// send_recv each) and sends, `boundary` bytes each.
constexpr CommCounts pipeline_traffic(std::span<const pipeline::Action> program, std::int64_t boundary) {
  CommCounts c;
  for (int i = 0; i < static_cast<int>(program.size()); i = pipeline::step_end(program, i)) {
    if (!pipeline::is_comm(program[static_cast<std::size_t>(i)].op)) continue;
    c.send_recv.calls += 1;
    for (int j = i; j < pipeline::step_end(program, i); ++j)
      if (pipeline::is_send(program[static_cast<std::size_t>(j)].op)) c.send_recv.bytes += boundary;
  }
  return c;
}

// DataParallel's gradient reductions and parameter gathers of one buffer in a step, over
// BucketPlan BP's group (nothing when it has one rank).
template <class BP>
constexpr CommCounts data_parallel_traffic(int zero, int M, int t) {
  using detail::tally;
  CommCounts c;
  if (BP::dp == 1) return c;
  for (std::size_t i = 0; i < BP::count; ++i) {
    const Bucket& b = BP::bucket(i);
    const std::int64_t padded = static_cast<std::int64_t>(b.padded) * t, piece = padded / BP::dp;
    const bool end_unit = b.unit == 0 || b.unit == BP::units - 1;
    if (zero == 0) tally(c.all_reduce, 1, static_cast<std::int64_t>(b.range.size()) * t);
    else tally(c.reduce_scatter, zero == 1 ? 1 : M, padded);
    if (zero == 1 || zero == 2) tally(c.all_gather, 1, piece);
    if (zero == 3) tally(c.all_gather, end_unit ? 1 : 2 * M, piece);
  }
  return c;
}

}  // namespace fived::plan
