#pragma once
// The schedules, as constexpr functions of (P, M[, V]): `*_order` decides the
// order of compute actions on every rank, and the schedule of the same name is
// that order with_messages() (lower.hpp), the sends and receives placed. Bad arguments throw
// std::invalid_argument with the sentence the generator types (schedules.hpp)
// static_assert. Each `*_order(o)` writes into o (its shape says P, M and V): an
// Orders sized at run time, which `*_order(P, M[, V])` returns, or a schedule
// type's TimedOrders of fixed size (lower.hpp), so that no copy is made inside the
// compiler.
//
//   gpipe(P, M)             all forwards, then all backwards, both in micro-batch order
//                           (GPipe as Megatron's and PyTorch's figures draw it)
//   one_f_one_b(P, M)       PipeDream-flush / Megatron: rank r runs P-1-r warm-up forwards, then
//                           one forward and one backward at a time, then the remaining backwards
//   interleaved_1f1b(P,M,V) Megatron's interleaving: chunk c of rank r is virtual stage c·P + r;
//                           the k-th forward is chunk (k / P) % V of micro-batch
//                           (k / (P·V))·P + k % P (rounds of P micro-batches per chunk), the
//                           k-th backward likewise with the chunks reversed; rank r runs
//                           2(P-1-r) + (V-1)·P warm-up forwards, then 1F1B, then the rest
//   zb_h1(P, M)             zero bubble H1 (Qi et al. 2023): 1F1B with B split into I and W, and
//                           W lagging r micro-batches behind I on rank r, so the W's still owed
//                           when the I's run out fill the cool-down bubble. Between F and I a
//                           rank holds P-r micro-batches, as in 1F1B; between F and W, P
//   zb_v(P, M)              ZB-V (Qi et al., section 6; PyTorch's ScheduleZBVZeroBubble order):
//                           two chunks per rank in a V; warm-up 2(P-r)-1 forwards of chunk 0,
//                           then r pairs F1 F0, then P-r of F1 I1 W1; steady F0 I0 W0 F1 I1 W1;
//                           cool-down I's first, W's into the bubble they leave
//
// With F = 1, B = 2, I = W = 1 and free messages (simulate.hpp) the bubbles are
// exactly (P-1)/(M+P-1) for GPipe and 1F1B, (P-1)/(V·M+P-1) for interleaved,
// (P-1)/(3M+P-1) for ZB-H1 and (P-1)/(6M+P-1) for ZB-V (tests/test_schedule.cpp
// checks them for P <= 8, M <= 4P, V <= 4). The last two are the ramp-up alone:
// rank P-1 cannot start before P-1 units, then computes without a gap.

#include <stdexcept>

#include "fived/pipeline/lower.hpp"
#include "fived/pipeline/sentences.hpp"

namespace fived::pipeline {

namespace detail {

constexpr void require(bool ok, const char* sentence) {
  if (!ok) throw std::invalid_argument(sentence);
}

// Megatron's 1F1B over a sequence of n virtual micro-batches on rank r:
// `warmup` forwards, then one forward and one backward, then the remaining backwards.
template <class O, class Forward, class Backward>
constexpr void one_forward_one_backward(O& o, int r, int n, int warmup, Forward fwd, Backward bwd) {
  warmup = warmup < n ? warmup : n;
  for (int k = 0; k < warmup; ++k) o.add(r, fwd(k));
  for (int k = 0; k < n - warmup; ++k) o.add(r, fwd(warmup + k)), o.add(r, bwd(k));
  for (int k = n - warmup; k < n; ++k) o.add(r, bwd(k));
}

}  // namespace detail

// ---- the compute orders ------------------------------------------------------------------

template <class O>
constexpr void gpipe_order(O& o) {
  const int P = o.shape.ranks, M = o.shape.micro_batches;
  detail::require(P >= 1 && M >= 1, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  for (int r = 0; r < P; ++r) {
    for (int m = 0; m < M; ++m) o.add(r, forward(m));
    for (int m = 0; m < M; ++m) o.add(r, backward(m));
  }
}

template <class O>
constexpr void one_f_one_b_order(O& o) {
  const int P = o.shape.ranks, M = o.shape.micro_batches;
  detail::require(P >= 1 && M >= 1, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  detail::require(M >= P, FIVED_PIPELINE_SAYS_1F1B_NEEDS_M_GE_P);
  for (int r = 0; r < P; ++r)
    detail::one_forward_one_backward(
        o, r, M, P - 1 - r, [](int k) { return forward(k); }, [](int k) { return backward(k); });
}

template <class O>
constexpr void interleaved_1f1b_order(O& o) {
  const int P = o.shape.ranks, M = o.shape.micro_batches, V = o.shape.chunks;
  detail::require(P >= 1 && M >= 1, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  detail::require(V >= 2, FIVED_PIPELINE_SAYS_INTERLEAVED_NEEDS_CHUNKS);
  detail::require(M % P == 0, FIVED_PIPELINE_SAYS_INTERLEAVED_NEEDS_ROUNDS);
  auto mb = [=](int k) { return k / (P * V) * P + k % P; };
  auto chunk = [=](int k) { return k % (P * V) / P; };
  for (int r = 0; r < P; ++r)
    detail::one_forward_one_backward(
        o, r, M * V, 2 * (P - 1 - r) + (V - 1) * P, [=](int k) { return forward(mb(k), chunk(k)); },
        [=](int k) { return backward(mb(k), V - 1 - chunk(k)); });
}

template <class O>
constexpr void zb_h1_order(O& o) {
  const int P = o.shape.ranks, M = o.shape.micro_batches;
  detail::require(P >= 1 && M >= 1, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  detail::require(M >= P, FIVED_PIPELINE_SAYS_1F1B_NEEDS_M_GE_P);
  for (int r = 0; r < P; ++r) {
    const int warmup = P - 1 - r;
    int w = 0;  // next micro-batch to run W on
    for (int k = 0; k < warmup; ++k) o.add(r, forward(k));
    for (int i = 0; i < M; ++i) {
      if (warmup + i < M) o.add(r, forward(warmup + i));
      o.add(r, input_grad(i));
      if (i + 1 - w > r) o.add(r, weight_grad(w++));  // W lags r micro-batches behind I
    }
    while (w < M) o.add(r, weight_grad(w++));
  }
}

template <class O>
constexpr void zb_v_order(O& o) {
  const int P = o.shape.ranks, M = o.shape.micro_batches;
  detail::require(P >= 1 && M >= 1, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  detail::require(M >= 2 * P, FIVED_PIPELINE_SAYS_V_NEEDS_M_GE_2P);
  for (int r = 0; r < P; ++r) {
    int f0 = 0, f1 = 0, i0 = 0, i1 = 0;  // next micro-batch of F and I on chunks 0 and 1
    auto F0 = [&] { o.add(r, forward(f0++, 0)); };
    auto F1 = [&] { o.add(r, forward(f1++, 1)); };
    auto IW0 = [&] { o.add(r, input_grad(i0, 0)), o.add(r, weight_grad(i0++, 0)); };
    auto IW1 = [&] { o.add(r, input_grad(i1, 1)), o.add(r, weight_grad(i1++, 1)); };
    // Warm-up: chunk 0 until the first micro-batch comes back up the V, then both chunks.
    for (int k = 0; k < 2 * (P - r) - 1; ++k) F0();
    for (int k = 0; k < r; ++k) F1(), F0();
    for (int k = 0; k < P - r; ++k) F1(), IW1();
    // Steady: F and I+W on chunk 0, then on chunk 1.
    while (f1 < f0 || f0 < M) {
      if (f0 < M) F0();
      IW0();
      F1(), IW1();
    }
    // Cool-down: the I's first, W's into the bubble they leave.
    int w0 = i0, w1 = i1;
    for (int k = 0; k < r; ++k) o.add(r, input_grad(i0++, 0)), o.add(r, input_grad(i1++, 1));
    for (int k = 0; k < P - r; ++k) o.add(r, input_grad(i0++, 0)), o.add(r, weight_grad(w0++, 0));
    while (w1 < M) o.add(r, weight_grad(w1++, 1));
    while (w0 < M) o.add(r, weight_grad(w0++, 0));
  }
}

// DualPipeV: DeepSeek-V3's DualPipe cut in half (deepseek-ai/DualPipe, dualpipev.py), in
// the order that file runs it. Two chunks per rank in a V, as ZB-V; through the steady state
// a forward of one chunk sits next to a backward of the other (F0 B1, F1 B0: the pairs a
// model can overlap, one's communication under the other's compute), and the input and
// weight gradients are split where that fills the bubble: the warm-up's chunk-1 backwards
// and the second half of the cool-down, their W's run oldest first. Needs M >= 2P.
template <class O>
constexpr void dualpipe_v_order(O& o) {
  const int P = o.shape.ranks, M = o.shape.micro_batches;
  detail::require(P >= 1 && M >= 1, FIVED_PIPELINE_SAYS_AT_LEAST_ONE);
  detail::require(M >= 2 * P, FIVED_PIPELINE_SAYS_V_NEEDS_M_GE_2P);
  detail::Scratch<int> weights(2 * M);  // W's of split backwards (micro-batch · 2 + chunk), in the order their I's ran
  for (int r = 0; r < P; ++r) {
    int f[2] = {0, 0}, b[2] = {0, 0};  // next micro-batch of F and of B (or I) on chunks 0 and 1
    int owed = 0, next_weight = 0;
    auto F = [&](int c) { o.add(r, forward(f[c]++, c)); };
    auto B = [&](int c, bool split) {
      if (split) o.add(r, input_grad(b[c], c)), weights[owed++] = b[c] * 2 + c;
      else o.add(r, backward(b[c], c));
      ++b[c];
    };
    auto W = [&] { o.add(r, weight_grad(weights[next_weight] / 2, weights[next_weight] % 2)), ++next_weight; };
    const int down = P - 1 - r;  // ranks below this one
    for (int k = 0; k < 2 * down; ++k) F(0);               // 1: chunk 0 fills the V's left arm
    for (int k = 0; k <= r; ++k) F(0), F(1);               // 2: the bottom turns
    for (int k = 0; k < down; ++k) B(1, true), W(), F(1);  // 3: chunk 1's first backwards, split
    for (int k = 0; k < M - 2 * P + r + 1; ++k) F(0), B(1, false), F(1), B(0, false);  // 4: steady
    for (int k = 0; k < down; ++k) B(1, false), F(1), B(0, false);                      // 5
    bool split = false;  // 6: the backwards drain; split from the middle on
    for (int k = 0; k <= r; ++k) {
      if (k == (r + 1) / 2 && r % 2 == 1) split = true;
      B(1, split);
      if (k == (r + 1) / 2 && r % 2 == 0) split = true;
      B(0, split);
    }
    for (int k = 0; k < down; ++k) W(), B(0, true);  // 7: W's into the bubble
    for (int k = 0; k <= r; ++k) W();                // 8: the rest
  }
}

// The generators by name: the schedule types (schedules.hpp) have a generator write into
// their fixed-size TimedOrders (lower.hpp), the functions below into an Orders.
enum class Generator : unsigned char { gpipe, one_f_one_b, interleaved_1f1b, zb_h1, zb_v, dualpipe_v };

namespace detail {
template <class O>
constexpr void generate(Generator g, O& o) {
  switch (g) {
    case Generator::gpipe: return gpipe_order(o);
    case Generator::one_f_one_b: return one_f_one_b_order(o);
    case Generator::interleaved_1f1b: return interleaved_1f1b_order(o);
    case Generator::zb_h1: return zb_h1_order(o);
    case Generator::zb_v: return zb_v_order(o);
    case Generator::dualpipe_v: return dualpipe_v_order(o);
  }
}

// A generator's orders for shape s, in arrays sized at run time.
constexpr Orders ordered(Generator g, const Shape& s) {
  Orders o(s);
  generate(g, o);
  return o;
}
}  // namespace detail

// The compute orders of (P, M[, V]), sized at run time.
constexpr detail::Orders gpipe_order(int P, int M) {
  return detail::ordered(Generator::gpipe, {P, M, 1, StageOrder::looped});
}
constexpr detail::Orders one_f_one_b_order(int P, int M) {
  return detail::ordered(Generator::one_f_one_b, {P, M, 1, StageOrder::looped});
}
constexpr detail::Orders interleaved_1f1b_order(int P, int M, int V) {
  return detail::ordered(Generator::interleaved_1f1b, {P, M, V, StageOrder::looped});
}
constexpr detail::Orders zb_h1_order(int P, int M) {
  return detail::ordered(Generator::zb_h1, {P, M, 1, StageOrder::looped});
}
constexpr detail::Orders zb_v_order(int P, int M) {
  return detail::ordered(Generator::zb_v, {P, M, 2, StageOrder::vee});
}
constexpr detail::Orders dualpipe_v_order(int P, int M) {
  return detail::ordered(Generator::dualpipe_v, {P, M, 2, StageOrder::vee});
}

// ---- the schedules: the orders with their messages ------------------------------------------

constexpr Schedule gpipe(int P, int M) { return with_messages(gpipe_order(P, M)); }
constexpr Schedule one_f_one_b(int P, int M) { return with_messages(one_f_one_b_order(P, M)); }
constexpr Schedule interleaved_1f1b(int P, int M, int V) { return with_messages(interleaved_1f1b_order(P, M, V)); }
constexpr Schedule zb_h1(int P, int M) { return with_messages(zb_h1_order(P, M)); }
constexpr Schedule zb_v(int P, int M) { return with_messages(zb_v_order(P, M)); }
constexpr Schedule dualpipe_v(int P, int M) { return with_messages(dualpipe_v_order(P, M)); }

}  // namespace fived::pipeline
