// Pipeline schedules: the generated tables against what the papers give, the
// proofs against broken tables, and the exported numbers against their closed
// forms. Small tables are proven inside the compiler (static_assert through
// Proven<>); the sweep over many (P, M, V) runs the same constexpr functions at
// run time, which keeps the build fast.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "fived/pipeline/schedule.hpp"

using namespace fived::pipeline;
using namespace fived::pipeline::notation;

namespace {

// ---- the generated types are proven at compile time, with their numbers ----------------

static_assert(proven<GPipe<1, 1>> && proven<GPipe<2, 2>> && proven<GPipe<4, 8>>);
static_assert(proven<OneFOneB<1, 3>> && proven<OneFOneB<2, 2>> && proven<OneFOneB<4, 8>> && proven<OneFOneB<8, 16>>);
static_assert(proven<Interleaved1F1B<2, 2, 2>> && proven<Interleaved1F1B<4, 8, 2>> && proven<Interleaved1F1B<3, 6, 3>>);
static_assert(proven<ZBH1<2, 2>> && proven<ZBH1<4, 8>> && proven<ZBH1<5, 7>>);
static_assert(proven<ZBV<1, 2>> && proven<ZBV<2, 4>> && proven<ZBV<4, 8>>);
static_assert(proven<DualPipeV<1, 2>> && proven<DualPipeV<2, 4>> && proven<DualPipeV<4, 8>> && proven<DualPipeV<3, 7>>);

// idle / (P × makespan) == num / den, exactly.
template <class S>
constexpr bool bubble_is(long long num, long long den) {
  return S::figures.idle * den == S::figures.rank_time * num;
}
static_assert(bubble_is<OneFOneB<4, 8>>(3, 11));            // (P-1)/(M+P-1)
static_assert(bubble_is<GPipe<4, 8>>(3, 11));               // the same bubble, at M activations
static_assert(bubble_is<Interleaved1F1B<4, 8, 2>>(3, 19));  // (P-1)/(V·M+P-1)
static_assert(bubble_is<ZBH1<4, 8>>(3, 27));                // (P-1)/(3M+P-1)
static_assert(bubble_is<ZBV<4, 8>>(3, 51));                 // (P-1)/(6M+P-1)
// DualPipeV: ZB-V's bubble and makespan at unit costs (its gain, F and B of two micro-batches
// overlapped, is not in the cost model), one more chunk of activations held per rank.
static_assert(bubble_is<DualPipeV<4, 8>>(3, 51) && DualPipeV<4, 8>::figures.makespan == ZBV<4, 8>::figures.makespan);
static_assert(DualPipeV<4, 8>::figures.peak_activations == std::array{9, 9, 9, 9});
static_assert(OneFOneB<4, 8>::figures.makespan == 33 && OneFOneB<4, 8>::figures.blocking_makespan == 33);
// A production size, proven inside the compiler at its default limits like the small ones
// (bench/schedule_compile_cost.sh measures what that costs, up to P = 32, M = 256).
static_assert(bubble_is<OneFOneB<16, 128>>(15, 143) && OneFOneB<16, 128>::figures.peak_activations[0] == 16);
static_assert(OneFOneB<4, 8>::figures.peak_activations == std::array{4, 3, 2, 1});
static_assert(GPipe<4, 8>::figures.peak_activations == std::array{8, 8, 8, 8});
static_assert(ZBH1<4, 8>::figures.peak_activations == std::array{4, 3, 2, 1});
static_assert(ZBH1<4, 8>::figures.peak_pending == std::array{4, 4, 4, 4});
// Micro-batches between their I and their W (one tape of snapshots each, nn/weight_grads.hpp):
// ZB-H1 delays W more on later ranks; ZB-V and DualPipeV too, per chunk pair.
static_assert(ZBH1<4, 8>::figures.peak_deferred == std::array{1, 2, 3, 4});
static_assert(ZBV<4, 8>::figures.peak_deferred == std::array{1, 3, 5, 7});
static_assert(DualPipeV<4, 8>::figures.peak_deferred == std::array{1, 2, 3, 4});
static_assert(OneFOneB<4, 8>::figures.peak_deferred == std::array{0, 0, 0, 0});

// A zero-bubble table with its messages placed for the costs it will run at (here I = 1.4 F,
// W = 0.6 F, B = I + W, as GPT-2 stages measure on the host): at those costs it idles less
// than the same order with unit-cost messages, and less than 1F1B; at unit costs its order
// is the same, so its unit figures are too.
constexpr Cost measured{.forward = 29, .backward = 57, .input_grad = 40, .weight_grad = 17};
template <class S>
constexpr double bubble_at(Cost c) {
  return measure(S::table, c).bubble();
}
static_assert(proven<ZBH1<4, 8, measured>> && proven<ZBV<4, 8, measured>> && proven<DualPipeV<4, 8, measured>>);
static_assert(bubble_at<ZBH1<4, 8, measured>>(measured) < bubble_at<ZBH1<4, 8>>(measured));
static_assert(bubble_at<ZBH1<4, 8, measured>>(measured) < bubble_at<OneFOneB<4, 8>>(measured));
static_assert(bubble_at<ZBH1<2, 8, measured>>(measured) < bubble_at<OneFOneB<2, 8>>(measured));
static_assert(bubble_at<ZBH1<2, 8>>(measured) > bubble_at<OneFOneB<2, 8>>(measured));  // the unit-cost messages' loss
static_assert(bubble_at<ZBV<4, 8, measured>>(measured) < bubble_at<ZBV<4, 8>>(measured));
static_assert(bubble_at<ZBV<4, 8, measured>>(measured) < bubble_at<ZBH1<4, 8, measured>>(measured));
static_assert(ZBH1<4, 8, measured>::figures.bubble == ZBH1<4, 8>::figures.bubble);
static_assert(ZBV<4, 8>::figures.peak_activations == std::array{8, 8, 8, 8});  // chunk units: 4 whole stages
static_assert(Interleaved1F1B<4, 8, 2>::figures.peak_activations == std::array{11, 9, 7, 5});

// ---- tables by hand, P = 2, M = 2, as the papers draw them --------------------------------
// Compute order: GPipe (all F, then all B), PipeDream-flush / Megatron 1F1B (rank r: P-1-r
// warm-up forwards), ZB-H1 (rank r: W lags r micro-batches behind I), Megatron's interleaving
// (rank 0 warms up with all four chunk-forwards). Messages: each send right after what it
// sends; each receive as soon as the message exists, in one group with whatever the rank
// posts at that moment. Rank 0's `send_act(1, 1), recv_grad(0, 1)` is Megatron's
// send_forward_recv_backward; rank 1 receives activations one step ahead of Megatron, whose
// send_backward_recv_forward posts it after B.

struct GPipeByHand {
  static constexpr Table<2, 2> table{
      {F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1).with_previous(), B(0), recv_grad(1, 1), B(1)},
      {recv_act(0, 0), F(0), recv_act(1, 0), F(1), B(0), send_grad(0, 0), B(1), send_grad(1, 0)}};
};
struct OneFOneBByHand {
  static constexpr Table<2, 2> table{
      {F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1).with_previous(), B(0), recv_grad(1, 1), B(1)},
      {recv_act(0, 0), F(0), recv_act(1, 0), B(0), send_grad(0, 0), F(1), B(1), send_grad(1, 0)}};
};
struct ZBH1ByHand {
  static constexpr Table<2, 2> table{
      {F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1).with_previous(), I(0), W(0), recv_grad(1, 1), I(1),
       W(1)},
      {recv_act(0, 0), F(0), recv_act(1, 0), I(0), send_grad(0, 0), F(1), I(1), send_grad(1, 0), W(0), W(1)}};
};
// F(m, c): micro-batch m on chunk c; send_act(m, to, c). Chunk c of rank r is virtual stage 2c + r.
struct InterleavedByHand {
  static constexpr Table<2, 2, 2> table{
      {F(0), send_act(0, 1), F(1), send_act(1, 1), recv_act(0, 1, 1).with_previous(), F(0, 1), send_act(0, 1, 1),
       recv_act(1, 1, 1).with_previous(), F(1, 1), send_act(1, 1, 1), recv_grad(0, 1, 1).with_previous(), B(0, 1),
       send_grad(0, 1, 1), recv_grad(1, 1, 1).with_previous(), B(1, 1), send_grad(1, 1, 1),
       recv_grad(0, 1).with_previous(), B(0), recv_grad(1, 1), B(1)},
      {recv_act(0, 0), F(0), recv_act(1, 0), send_act(0, 0).with_previous(), F(1), recv_act(0, 0, 1),
       send_act(1, 0).with_previous(), F(0, 1), recv_act(1, 0, 1), B(0, 1), send_grad(0, 0, 1), F(1, 1), B(1, 1),
       recv_grad(0, 0), send_grad(1, 0, 1).with_previous(), B(0), recv_grad(1, 0), send_grad(0, 0).with_previous(), B(1),
       send_grad(1, 0)}};
};

static_assert(proven<GPipeByHand> && GPipeByHand::table == GPipe<2, 2>::table);
static_assert(proven<OneFOneBByHand> && OneFOneBByHand::table == OneFOneB<2, 2>::table);
static_assert(proven<ZBH1ByHand> && ZBH1ByHand::table == ZBH1<2, 2>::table);
static_assert(proven<InterleavedByHand> && InterleavedByHand::table == Interleaved1F1B<2, 2, 2>::table);
static_assert(Proven<ZBH1ByHand>::figures.makespan == 7);  // 3M + P - 1: ramp-up alone

// The examples in table.hpp and proven.hpp: P = 2, M = 1, every message in its own step.
struct Mine {
  static constexpr Table<2, 1> table{{F(0), send_act(0, 1), recv_grad(0, 1), B(0)},
                                     {recv_act(0, 0), F(0), B(0), send_grad(0, 0)}};
};
static_assert(proven<Mine> && Proven<Mine>::figures.bubble == 0.5);

// Compute actions only, in order.
std::vector<Action> compute_of(std::span<const Action> program) {
  std::vector<Action> out;
  for (const Action& a : program)
    if (is_compute(a.op)) out.push_back(a);
  return out;
}

// ---- run-time helpers ----------------------------------------------------------------------

Schedule by_hand(int P, int M, std::vector<std::vector<Action>> programs, int V = 1,
                 StageOrder order = StageOrder::looped) {
  Schedule s({P, M, V, order});
  s.programs = std::move(programs);
  return s;
}

// 1F1B, P = 2, M = 2, by hand; tests below break it in one place each.
Schedule one_f_one_b_2_2() { return OneFOneBByHand::table.schedule(); }

void erase_first(std::vector<Action>& program, const Action& a) {
  for (auto it = program.begin(); it != program.end(); ++it)
    if (*it == a) {
      program.erase(it);
      return;
    }
  FAIL("action not found");
}

}  // namespace

TEST_CASE("the ZB-V order is the paper's V: P = 2, M = 4") {
  // Rank r: 2(P-r)-1 forwards of chunk 0, r pairs F1 F0, P-r triples F1 I1 W1, then steady
  // F0 I0 W0 F1 I1 W1, cool-down r pairs I0 I1 and P-r pairs I0 W0, the remaining W's.
  const Schedule s = zb_v(2, 4);
  CHECK(s.shape.order == StageOrder::vee);
  const std::vector<Action> rank0{F(0),    F(1),    F(2),    F(0, 1), I(0, 1), W(0, 1), F(1, 1), I(1, 1),
                                  W(1, 1), F(3),    I(0),    W(0),    F(2, 1), I(2, 1), W(2, 1), I(1),
                                  W(1),    F(3, 1), I(3, 1), W(3, 1), I(2),    W(2),    I(3),    W(3)};
  const std::vector<Action> rank1{F(0),    F(0, 1), F(1),    F(1, 1), I(0, 1), W(0, 1), F(2),    I(0),
                                  W(0),    F(2, 1), I(1, 1), W(1, 1), F(3),    I(1),    W(1),    F(3, 1),
                                  I(2, 1), W(2, 1), I(2),    I(3, 1), I(3),    W(2),    W(3, 1), W(3)};
  CHECK(compute_of(s.program(0)) == rank0);
  CHECK(compute_of(s.program(1)) == rank1);
  // Stage P-1 and P are both on rank P-1: no message between them.
  for (const Action& a : s.program(1))
    if (is_comm(a.op)) CHECK(a.peer == 0);
  CHECK(verify(s).ok());
}

TEST_CASE("an executor walks a rank's program in steps: one compute action or one comm group") {
  const auto program = OneFOneB<2, 2>::table.program(0);
  std::vector<std::vector<Op>> steps;
  for (int i = 0; i < static_cast<int>(program.size()); i = step_end(program, i)) {
    auto& step = steps.emplace_back();
    for (int j = i; j < step_end(program, i); ++j) step.push_back(program[j].op);
  }
  const std::vector<std::vector<Op>> expected{{Op::forward},
                                              {Op::send_act},
                                              {Op::forward},
                                              {Op::send_act, Op::recv_grad},  // one NCCL group
                                              {Op::backward},
                                              {Op::recv_grad},
                                              {Op::backward}};
  CHECK(steps == expected);
}

TEST_CASE("Table and Schedule convert both ways") {
  const Schedule s = interleaved_1f1b(4, 8, 2);
  const Table<4, 8, 2> t(s);
  CHECK(t.schedule() == s);
  CHECK(t == Interleaved1F1B<4, 8, 2>::table);
  CHECK(static_cast<int>(t.program(3).size()) == t.sizes[3]);
  CHECK_THROWS_AS((Table<4, 8>(s)), std::invalid_argument);  // another shape
}

// A schedule type's generator writes into the type's own fixed-size orders (lower.hpp's
// TimedOrders), the run-time function into an Orders: both must give the same table.
TEST_CASE("every schedule type's table is its generator's schedule") {
  constexpr Cost zb{.forward = 3, .backward = 5, .input_grad = 3, .weight_grad = 2};
  CHECK(Table<3, 2>(gpipe(3, 2)) == GPipe<3, 2>::table);
  CHECK(Table<4, 9>(one_f_one_b(4, 9)) == OneFOneB<4, 9>::table);
  CHECK(Table<4, 8, 3>(interleaved_1f1b(4, 8, 3)) == Interleaved1F1B<4, 8, 3>::table);
  CHECK(Table<4, 6>(zb_h1(4, 6)) == ZBH1<4, 6>::table);
  CHECK(Table<4, 6>(with_messages(zb_h1_order(4, 6), zb)) == ZBH1<4, 6, zb>::table);
  CHECK((Table<3, 7, 2, StageOrder::vee>(zb_v(3, 7)) == ZBV<3, 7>::table));
  CHECK((Table<3, 8, 2, StageOrder::vee>(with_messages(dualpipe_v_order(3, 8), zb)) == DualPipeV<3, 8, zb>::table));
}

TEST_CASE("generators reject bad arguments with the static_assert's sentence") {
  CHECK_THROWS_WITH_AS(one_f_one_b(4, 3), FIVED_PIPELINE_SAYS_1F1B_NEEDS_M_GE_P, std::invalid_argument);
  CHECK_THROWS_WITH_AS(zb_h1(4, 3), FIVED_PIPELINE_SAYS_1F1B_NEEDS_M_GE_P, std::invalid_argument);
  CHECK_THROWS_WITH_AS(interleaved_1f1b(4, 6, 2), FIVED_PIPELINE_SAYS_INTERLEAVED_NEEDS_ROUNDS, std::invalid_argument);
  CHECK_THROWS_WITH_AS(interleaved_1f1b(4, 8, 1), FIVED_PIPELINE_SAYS_INTERLEAVED_NEEDS_CHUNKS, std::invalid_argument);
  CHECK_THROWS_WITH_AS(zb_v(4, 7), FIVED_PIPELINE_SAYS_V_NEEDS_M_GE_2P, std::invalid_argument);
  CHECK_THROWS_WITH_AS(gpipe(0, 4), FIVED_PIPELINE_SAYS_AT_LEAST_ONE, std::invalid_argument);
  CHECK_THROWS_WITH_AS(gpipe(2, 0), FIVED_PIPELINE_SAYS_AT_LEAST_ONE, std::invalid_argument);
}

TEST_CASE("every property has its own sentence") {
  std::vector<std::string_view> seen;
  for (int p = 0; p <= static_cast<int>(Property::progresses); ++p) {
    const std::string_view s = describe(static_cast<Property>(p));
    CHECK(s.starts_with("fived::pipeline: "));
    for (auto other : seen) CHECK(other != s);
    seen.push_back(s);
  }
}

// ---- broken tables: the first property that fails, and where ---------------------------------

TEST_CASE("a missing backward is found, at its stage") {
  Schedule s = one_f_one_b_2_2();
  erase_first(s.programs[1], B(1));
  const Verdict v = verify(s);
  CHECK(v.failed == Property::one_backward_each);
  CHECK(v.rank == 1);
  CHECK(v.mb == 1);
  CHECK(v.chunk == 0);
  CHECK(v.position == -1);  // missing
}

TEST_CASE("a repeated forward, and a B mixed with an I, are found") {
  Schedule s = one_f_one_b_2_2();
  s.programs[0].insert(s.programs[0].begin() + 2, F(0));
  CHECK(verify(s).failed == Property::one_forward_each);
  CHECK(verify(s).position == 2);

  Schedule t = one_f_one_b_2_2();
  t.programs[1].push_back(I(1));
  CHECK(verify(t).failed == Property::one_backward_each);
}

TEST_CASE("a backward before its forward, and a W before its I, are found") {
  Schedule s = one_f_one_b_2_2();
  // rank 1: recv_act(0), F(0), ... -> B(0) moved to the front
  erase_first(s.programs[1], B(0));
  s.programs[1].insert(s.programs[1].begin(), B(0));
  CHECK(verify(s).failed == Property::forward_before_backward);
  CHECK(verify(s).rank == 1);
  CHECK(verify(s).position == 0);

  Schedule z = ZBH1ByHand::table.schedule();
  erase_first(z.programs[1], W(1));
  z.programs[1].insert(z.programs[1].begin() + 6, W(1));  // before I(1)
  CHECK(verify(z).failed == Property::input_grad_before_weight_grad);
}

TEST_CASE("messages must go between neighbouring stages, once each, both ends present") {
  Schedule wrong_peer = GPipe<4, 4>::table.schedule();
  for (Action& a : wrong_peer.programs[1])
    if (a.op == Op::send_act) a.peer = 3;
  CHECK(verify(wrong_peer).failed == Property::peers_are_neighbours);

  Schedule last_sends = one_f_one_b_2_2();
  last_sends.programs[1].push_back(send_act(1, 0));  // the last stage has no next stage
  CHECK(verify(last_sends).failed == Property::peers_are_neighbours);

  Schedule no_send = one_f_one_b_2_2();
  erase_first(no_send.programs[1], send_grad(1, 0));
  CHECK(verify(no_send).failed == Property::one_send_each);

  Schedule no_receive = one_f_one_b_2_2();
  erase_first(no_receive.programs[0], recv_grad(1, 1));
  CHECK(verify(no_receive).failed == Property::one_receive_each);
  CHECK(verify(no_receive).rank == 0);
  CHECK(verify(no_receive).mb == 1);
}

TEST_CASE("data must exist before it is sent or used") {
  Schedule early_send = one_f_one_b_2_2();  // rank 0: send_act(1) before F(1)
  early_send.programs[0] = {F(0), send_act(0, 1), send_act(1, 1), F(1), recv_grad(0, 1), B(0), recv_grad(1, 1), B(1)};
  CHECK(verify(early_send).failed == Property::sends_after_compute);
  CHECK(verify(early_send).position == 2);

  Schedule late_input = one_f_one_b_2_2();  // rank 1: F(1) before its activations arrive
  erase_first(late_input.programs[1], F(1));
  late_input.programs[1].insert(late_input.programs[1].begin() + 2, F(1));
  CHECK(verify(late_input).failed == Property::forward_after_input);

  Schedule late_grad = one_f_one_b_2_2();  // rank 0: B(1) before its gradient arrives
  erase_first(late_grad.programs[0], recv_grad(1, 1));
  late_grad.programs[0].push_back(recv_grad(1, 1));
  CHECK(verify(late_grad).failed == Property::backward_after_gradient);

  // On one rank, a V's turning point: stage P on rank P-1 needs stage P-1's forward first.
  Schedule v = zb_v(2, 4);
  auto& last = v.programs[1];
  erase_first(last, F(0, 1));
  last.insert(last.begin(), F(0, 1));
  CHECK(verify(v).failed == Property::forward_after_input);
  CHECK(verify(v).rank == 1);
  CHECK(verify(v).chunk == 1);
}

TEST_CASE("receives in another order than the sends are caught: NCCL would swap the buffers") {
  Schedule s = GPipeByHand::table.schedule();
  // rank 1 posts activations 1 and 0 together, in the wrong order (still before both F's)
  s.programs[1] = {recv_act(1, 0), recv_act(0, 0).with_previous(), F(0), F(1), B(0), send_grad(0, 0), B(1),
                   send_grad(1, 0)};
  const Verdict v = verify(s);
  CHECK(v.failed == Property::sends_match_receives);
  CHECK(v.rank == 1);
  CHECK(v.position == 0);
}

TEST_CASE("of receives out of order on two ranks, the first rank's first is reported") {
  // GPipe, P = 3, M = 2. Rank 1 takes the gradients from rank 2 in the wrong order, late in its
  // program; rank 2 takes the activations from rank 1 in the wrong order, at its very start.
  Schedule s = gpipe(3, 2);
  s.programs[1] = {recv_act(0, 0), F(0), recv_act(1, 0), send_act(0, 2).with_previous(), F(1), send_act(1, 2),
                   recv_grad(1, 2).with_previous(), recv_grad(0, 2).with_previous(), B(0), send_grad(0, 0), B(1),
                   send_grad(1, 0)};
  s.programs[2] = {recv_act(1, 1), recv_act(0, 1).with_previous(), F(0), F(1), B(0), send_grad(0, 1), B(1),
                   send_grad(1, 1)};
  const Verdict v = verify(s);
  CHECK(v.failed == Property::sends_match_receives);
  CHECK(v.rank == 1);
  CHECK(v.position == 6);  // recv_grad(1): rank 2's failures come later in rank order, though at position 0
  CHECK(v.mb == 1);
}

TEST_CASE("crossed blocking sends deadlock; one group on one side resolves them") {
  // Megatron's classic: rank 0 sends activations 1 while rank 1 sends gradient 0; each
  // then waits in its send for the other's receive.
  const std::vector<Action> rank1{recv_act(0, 0), F(0), B(0), send_grad(0, 0), recv_act(1, 0), F(1), B(1), send_grad(1, 0)};
  const Schedule crossed = by_hand(
      2, 2, {{F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1), B(0), recv_grad(1, 1), B(1)}, rank1});
  const Verdict v = verify(crossed);
  CHECK(v.failed == Property::no_crossed_sends);
  CHECK(v.position == 3);  // rank 0's send_act(1), or rank 1's send_grad(0): both are stuck in a send
  CHECK((v.rank == 0 || v.rank == 1));

  const Schedule grouped = by_hand(
      2, 2,
      {{F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1).with_previous(), B(0), recv_grad(1, 1), B(1)},
       rank1});
  CHECK(verify(grouped).ok());
}

TEST_CASE("a deadlock without crossed sends: both ranks wait to receive") {
  const Schedule s = by_hand(2, 1, {{recv_grad(0, 1), F(0), send_act(0, 1), B(0)},  // waits before sending
                                    {recv_act(0, 0), F(0), B(0), send_grad(0, 0)}});
  CHECK(verify(s).failed == Property::progresses);
  CHECK(verify(s).rank == 0);
  CHECK(verify(s).position == 0);
}

TEST_CASE("a table packs every action of its shape in an int, and keeps the first it cannot as given") {
  constexpr Shape shape{3, 2, 2};
  constexpr Packing packing(shape);
  int packed = 0;
  for (int op = 1; op <= 8; ++op)
    for (int mb = 0; mb < 2; ++mb)
      for (int chunk = 0; chunk < 2; ++chunk)
        for (int peer = -1; peer < 3; ++peer)
          for (const bool joins : {false, true}) {
            const Action a{static_cast<Op>(op), joins, mb, chunk, is_comm(static_cast<Op>(op)) ? peer : -1};
            CHECK(packing.holds(a));
            CHECK(packing.unpack(packing.pack(a)) == a);
            ++packed;
          }
  CHECK(packed == 8 * 2 * 2 * 4 * 2);
  CHECK_FALSE(packing.holds(forward(2)));          // M = 2
  CHECK_FALSE(packing.holds(forward(0, 2)));       // V = 2
  CHECK_FALSE(packing.holds(send_act(0, 3)));      // P = 3
  CHECK(packing.unpack(packing.pack(forward(1, 1))).peer == -1);  // a compute action keeps no peer
  CHECK(packing.holds(Action{Op::forward, false, 1, 0, 7}));

  // Out of range: stored as an empty slot, reported where it was with what it said.
  using namespace notation;
  constexpr Table<2, 1> t{{F(0), send_act(0, 1), recv_grad(0, 1), B(0)}, {recv_act(0, 0), F(3, 1), B(0), F(5)}};
  static_assert(t.action(1, 1) == F(3, 1) && t.action(1, 3) == Action{});
  constexpr Verdict v = verify(t);
  static_assert(v.failed == Property::well_formed && v.rank == 1 && v.position == 1 && v.mb == 3 && v.chunk == 1);
  CHECK(t.schedule().programs[1][1] == F(3, 1));
}

TEST_CASE("malformed actions and shapes") {
  Schedule s = one_f_one_b_2_2();
  s.programs[0][0].mb = 2;  // M = 2
  CHECK(verify(s).failed == Property::well_formed);
  Schedule g = one_f_one_b_2_2();
  g.programs[1][1].joins_previous = true;  // a compute action cannot join a group
  CHECK(verify(g).failed == Property::well_formed);
  Schedule self = one_f_one_b_2_2();
  self.programs[0][1].peer = 0;  // sends to itself
  CHECK(verify(self).failed == Property::well_formed);
  Schedule shape = one_f_one_b_2_2();
  shape.programs.pop_back();
  CHECK(verify(shape).failed == Property::shape);
  CHECK(verify(by_hand(2, 2, {{}, {}}, 3, StageOrder::vee)).failed == Property::shape);
}

// ---- the sweep: every generator over many (P, M, V), proofs and closed forms -------------------

namespace {

struct Expect {
  long long num, den;           // bubble = num / den exactly
  std::vector<int> peak;        // peak_activations per rank
  std::vector<int> peak_to_w;   // peak_pending per rank
  bool blocking_is_free = true; // a blocking executor loses nothing
};

void check_schedule(const char* name, const Schedule& s, const Expect& e) {
  const auto& sh = s.shape;
  CAPTURE(name);
  CAPTURE(sh.ranks);
  CAPTURE(sh.micro_batches);
  CAPTURE(sh.chunks);
  const Verdict v = verify(s);
  CHECK_MESSAGE(v.ok(), describe(v.failed));
  const Figures f = measure(s);
  CHECK(f.idle() * e.den == f.rank_time() * e.num);
  CHECK(f.bubble() == doctest::Approx(static_cast<double>(e.num) / static_cast<double>(e.den)));
  CHECK(f.peak_activations == e.peak);
  CHECK(f.peak_pending == e.peak_to_w);
  for (int b : f.busy) CHECK(b == 3 * sh.micro_batches * sh.chunks);  // F + B, or F + I + W, per chunk
  CHECK(f.blocking_makespan >= f.makespan);
  if (e.blocking_is_free) CHECK(f.blocking_makespan == f.makespan);
  CHECK(f.blocking_bubble() >= f.bubble());
}

}  // namespace

TEST_CASE("sweep: P in 1..8, M in P..4P, V in 2..4: proven, and the bubbles and peaks in closed form") {
  int checked = 0;
  for (int P = 1; P <= 8; ++P)
    for (int M = P; M <= 4 * P; ++M) {
      std::vector<int> all_m(P, M), one_f_one_b_peak, all_p(P, P), zbv_peak(P, 2 * P);
      for (int r = 0; r < P; ++r) one_f_one_b_peak.push_back(P - r);

      check_schedule("gpipe", gpipe(P, M), {P - 1, M + P - 1, all_m, all_m});
      check_schedule("1f1b", one_f_one_b(P, M), {P - 1, M + P - 1, one_f_one_b_peak, one_f_one_b_peak});
      // ZB-H1: a third of 1F1B's bubble in the limit; 1F1B's peak until I, P until W on every rank.
      check_schedule("zb-h1", zb_h1(P, M), {P - 1, 3 * M + P - 1, one_f_one_b_peak, all_p});
      // ZB-V: the ramp-up alone; 2P chunk-micro-batches = P whole stages, 1F1B's peak, on every rank.
      if (M >= 2 * P) check_schedule("zb-v", zb_v(P, M), {P - 1, 6 * M + P - 1, zbv_peak, zbv_peak});
      if (M % P == 0)
        for (int V = 2; V <= 4; ++V) {
          std::vector<int> peak;
          for (int r = 0; r < P; ++r) peak.push_back(std::min(2 * (P - 1 - r) + (V - 1) * P + 1, M * V));
          // 1F1B's bubble divided by V in the limit. Blocking sends cost extra here for some P
          // (P = 2, 5, 8 below): see the blocking_bubble figures in simulate.hpp.
          check_schedule("interleaved", interleaved_1f1b(P, M, V), {P - 1, V * M + P - 1, peak, peak, false});
          ++checked;
        }
      checked += 3 + (M >= 2 * P ? 1 : 0);
    }
  CHECK(checked == 524);
}

TEST_CASE("the limits: ZB-H1 tends to a third of 1F1B's bubble, interleaving divides it by V") {
  const Figures one = measure(one_f_one_b(8, 256)), zb = measure(zb_h1(8, 256));
  CHECK(zb.bubble() / one.bubble() == doctest::Approx(1.0 / 3).epsilon(0.01));
  for (int V = 2; V <= 4; ++V)
    CHECK(measure(interleaved_1f1b(8, 256, V)).bubble() / one.bubble() == doctest::Approx(1.0 / V).epsilon(0.01));
  CHECK(measure(zb_v(8, 256)).bubble() < one.bubble() / 5);
}

TEST_CASE("blocking sends: free for GPipe, 1F1B, ZB-H1 and ZB-V, not for every interleaving") {
  // Interleaved P = 2, M = 4, V = 2: the eager (messages free) run is Megatron's
  // 1/9; with blocking sends a sender waits for a receiver that is still in a B.
  const Figures f = measure(interleaved_1f1b(2, 4, 2));
  CHECK(f.makespan == 27);
  CHECK(f.bubble() == doctest::Approx(1.0 / 9));
  CHECK(f.blocking_makespan == 29);
  CHECK(measure(interleaved_1f1b(4, 8, 2)).blocking_makespan == measure(interleaved_1f1b(4, 8, 2)).makespan);
}

TEST_CASE("the timed run: when each action runs") {
  const Run run = simulate(OneFOneB<2, 2>::table.schedule());
  REQUIRE(run.finished);
  // rank 1: recv_act(0) posted at 0, met at 1; F(0) at 1; recv_act(1) at 2; B(0) at 2..4;
  // send_grad(0) at 4 (eager: messages free); F(1) at 4; B(1) at 5..7
  const std::vector<int> start1{0, 1, 2, 2, 4, 4, 5, 7}, end1{1, 2, 2, 4, 4, 5, 7, 7};
  CHECK(run.start[1] == start1);
  CHECK(run.end[1] == end1);
  CHECK(run.makespan == 9);
}
