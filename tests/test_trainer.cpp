// The 5D trainer against the serial model, on the host backend (ranks as threads).
//
// Mesh<DP<2>, PP<2>, CP<2>, TP<2>> (16 ranks) with an EP<2> view: a mixture of experts in
// every second block, ZeRO-1, 1F1B over 4 micro-batches, sequence parallelism and selective
// recomputation, trained by one Trainer for 3 steps on the warmup + cosine learning rate,
// equals the serial GPT trained by the one optimizer step on the same global batches: every
// step's loss, the dense and the expert weights after the last step. The serial model takes
// each data rank's rows of a micro-batch as a micro-batch of its own (the balancing loss is
// a statistic of the micro-batch a replica routes). The experts' selection bias moves by
// their loads, summed over the global batch. Trainer::evaluate, between the steps, gives the
// serial model's loss on a held-out batch and leaves the steps as they were, bit for bit.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/train/trainer.hpp"
#include "support/batches.hpp"
#include "support/compare.hpp"
#include "support/file_text.hpp"

using namespace fived;

namespace {

struct five_cfg : gpt_config {
  static constexpr int layers = 4, d_model = 32, heads = 4, vocab = 53, max_seq = 32, vocab_multiple = 16;
  static constexpr bool tied = false;  // pipeline stages
  static constexpr int experts = 4, top_k = 2, moe_every = 2, mlp_ratio = 2;
  static constexpr double aux_loss_coef = 0.05;
  using balancing = AuxLossFreeBias;  // an evaluation that counted its loads would move it
  using recompute = SelectiveRecompute;
};
struct serial_cfg : five_cfg {
  using recompute = NoRecompute;  // the reference keeps everything
};

constexpr int B = 4, T = 16, steps = 3;
const GptInit init{5, 0.05};
const TrainerConfig hp{
    .adamw = {.lr = 0, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f},
    .lr = WarmupCosine{.peak = 3e-3, .warmup = 1, .total = steps, .floor = 0.1}};

struct Result {
  std::vector<double> losses;
  std::vector<float> weights, experts;  // serial layouts
  std::vector<double> held_out;         // the held-out loss before each step and after the last
};

// The held-out batch: micro micro-batches of [B, T], drawn as no step draws.
void held_out_batch(int micro, std::vector<int>& tok, std::vector<int>& tgt) {
  test::global_batch(1000, micro, B, T, five_cfg::vocab, tok, tgt);
}

// The serial model: `micro` micro-batches of B rows per step, each fed as `data_ranks` of
// B/data_ranks. The held-out loss: the mean of its forwards over the held-out batch's rows.
template <class Cfg>
Result serial_run(int micro, int data_ranks) {
  GPT<Cfg> m(init);
  DataParallel<GPT<Cfg>> dp(m, hp.adamw, micro * data_ranks);
  Result r;
  std::vector<int> tok, tgt, held_tok, held_tgt;
  held_out_batch(micro, held_tok, held_tgt);
  const auto held_out = [&] {
    m.set_training(false);
    double sum = 0;
    for (int k = 0; k < micro * data_ranks; ++k) {
      const std::size_t off = static_cast<std::size_t>(k) * (B / data_ranks) * T;
      sum += m.forward(held_tok.data() + off, held_tgt.data() + off, B / data_ranks, T);
    }
    m.set_training(true);
    return sum / (micro * data_ranks);
  };
  for (int s = 1; s <= steps; ++s) {
    r.held_out.push_back(held_out());
    test::global_batch(s, micro, B, T, Cfg::vocab, tok, tgt);
    dp.optimizer().hp.lr = hp.lr(s);
    r.losses.push_back(dp.step(tok, tgt, B / data_ranks, T));
  }
  r.held_out.push_back(held_out());
  r.weights.assign(m.params().begin(), m.params().end());
  r.experts.assign(m.expert_params().begin(), m.expert_params().end());
  return r;
}

// With `evaluating`, Trainer::evaluate on the held-out batch before each step and after the last.
template <class M, class Policy, class Sched, class SP = SequenceParallel>
std::vector<Result> trainer_run(bool evaluating = false) {
  using Model = GPT<five_cfg, M, float, Host, SP>;
  std::vector<Result> out(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<Model, Policy, Sched> t(ctx, hp, init);
    Result& r = out[static_cast<std::size_t>(ctx.rank())];
    std::vector<int> tok, tgt, held_tok, held_tgt;
    held_out_batch(Sched::table.micro_batches, held_tok, held_tgt);
    for (int s = 1; s <= steps; ++s) {
      if (evaluating) r.held_out.push_back(t.evaluate(held_tok, held_tgt, B, T));
      test::global_batch(s, Sched::table.micro_batches, B, T, five_cfg::vocab, tok, tgt);
      r.losses.push_back(t.step(s, tok, tgt, B, T));
    }
    if (evaluating) r.held_out.push_back(t.evaluate(held_tok, held_tgt, B, T));
    r.weights = t.serial_params();
    r.experts = t.serial_expert_params();
  });
  return out;
}

void check_equal(const std::vector<Result>& ranks, const Result& ref) {
  for (const Result& got : ranks) {
    for (int s = 0; s < steps; ++s) {
      CAPTURE(s);
      const auto i = static_cast<std::size_t>(s);
      CHECK(std::abs(got.losses[i] - ref.losses[i]) <= 1e-5 * ref.losses[i]);
    }
    CHECK(test::max_rel_error(got.weights, ref.weights) <= 1e-5);
    CHECK(test::max_rel_error(got.experts, ref.experts) <= 1e-5);
  }
}

// The trainer evaluating between its steps: each held-out loss the serial model's (on every
// rank), and the steps those of the same trainer not evaluating, bit for bit.
template <class M, class Policy, class Sched>
void check_evaluation(const Result& ref) {
  const std::vector<Result> plain = trainer_run<M, Policy, Sched>(), evaluated = trainer_run<M, Policy, Sched>(true);
  for (std::size_t rank = 0; rank < evaluated.size(); ++rank) {
    CAPTURE(rank);
    const Result& got = evaluated[rank];
    REQUIRE(got.held_out.size() == ref.held_out.size());
    for (std::size_t i = 0; i < ref.held_out.size(); ++i) {
      CAPTURE(i);
      CHECK(std::abs(got.held_out[i] - ref.held_out[i]) <= 1e-5 * ref.held_out[i]);
    }
    CHECK(got.losses == plain[rank].losses);
    CHECK(got.weights == plain[rank].weights);
    CHECK(got.experts == plain[rank].experts);
  }
  CHECK(ref.held_out.front() > ref.held_out.back());  // training lowered it
}

}  // namespace

TEST_CASE("5D: Mesh<DP<2>, PP<2>, CP<2>, TP<2>> with EP<2>, MoE in half the blocks, ZeRO-1, 1F1B, selective "
          "recomputation: 3 steps equal the serial model") {
  using M = Mesh<DP<2>, PP<2>, CP<2>, TP<2>, EP<2>>;
  static_assert(M::size == 16 && M::ep == 2);
  using Sched = pipeline::OneFOneB<2, 4>;
  const Result ref = serial_run<serial_cfg>(Sched::table.micro_batches, 2);
  check_equal(trainer_run<M, ZeRO<1>, Sched>(), ref);
}

TEST_CASE("Trainer::evaluate on the 5D mesh (forwards through both stages, nothing reduced) and on DP 4 x TP 2 under "
          "ZeRO-3 (units gathered and given back): the serial model's held-out loss; the steps as without it") {
  using Sched = pipeline::OneFOneB<2, 4>;
  check_evaluation<Mesh<DP<2>, PP<2>, CP<2>, TP<2>, EP<2>>, ZeRO<1>, Sched>(
      serial_run<serial_cfg>(Sched::table.micro_batches, 2));
  check_evaluation<Mesh<DP<4>, TP<2>, EP<2>>, ZeRO<3>, Accumulate<2>>(serial_run<serial_cfg>(2, 4));
}

TEST_CASE("without a pipeline the trainer accumulates: Mesh<DP<2>, TP<2>> and the serial mesh, 2 micro-batches") {
  const Result ref = serial_run<serial_cfg>(2, 2);
  check_equal(trainer_run<Mesh<DP<2>, TP<2>>, ZeRO<1>, Accumulate<2>>(), ref);
  check_equal(trainer_run<Mesh<>, NoZeRO, Accumulate<4>>(), serial_run<serial_cfg>(4, 1));
}

TEST_CASE("ZeRO-3 with experts: Mesh<DP<4>, TP<2>, EP<2>> (dense shards over 4 ranks, expert shards over their "
          "2-rank data group), 2 micro-batches, equals the serial model; serial_params gathers the shards") {
  check_equal(trainer_run<Mesh<DP<4>, TP<2>, EP<2>>, ZeRO<3>, Accumulate<2>>(), serial_run<serial_cfg>(2, 4));
}

namespace {

// What was written to f, from its start; f closed.
std::string read_and_close(std::FILE* f) {
  std::string s = test::file_text(f);
  std::fclose(f);
  return s;
}

// The number after "key": in each line of a metrics file that has one, as the lines hold it.
std::vector<double> field(const std::string& lines, const std::string& key) {
  std::vector<double> v;
  const std::string quoted = "\"" + key + "\":";
  for (std::size_t at = lines.find(quoted); at != std::string::npos; at = lines.find(quoted, at + 1))
    v.push_back(std::strtod(lines.c_str() + at + quoted.size(), nullptr));
  return v;
}

}  // namespace

TEST_CASE("fit prints a held-out loss every eval_every steps and after the last: evaluate over the held-out "
          "sampler's first batches; the metrics file holds every step's loss and every evaluation exactly") {
  using Model = GPT<five_cfg, Mesh<>, float, Host, SequenceParallel>;
  std::string text;  // ids below the model's vocabulary
  for (int i = 0; i < 4000; ++i) text += static_cast<char>((i * 7 + i / 13) % five_cfg::vocab);
  const TokenStream data = TokenStream::bytes_of(text);
  const BatchSampler train(data, 0, 3000, 1), held(data, 3000, 4000, 2);
  std::string printed, metrics;
  double last = 0;
  std::vector<double> losses;
  host::run(1, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<>>(world);
    Trainer<Model, NoZeRO, Accumulate<4>> t(ctx, hp, init);
    std::FILE* out = std::tmpfile();
    std::FILE* lines = std::tmpfile();
    REQUIRE(out != nullptr);
    REQUIRE(lines != nullptr);
    t.fit(train, 1, 5, B, T,
          {.log_every = 5, .out = out, .metrics = lines, .held_out = &held, .eval_every = 2, .eval_batches = 2},
          [&](int, double loss) { losses.push_back(loss); });
    metrics = read_and_close(lines);
    last = t.evaluate(held, 2, B, T);
    // Held-out settings that cannot work are refused before the first step.
    const auto never = [](int, double) { FAIL("a step ran"); };
    CHECK_THROWS_WITH_AS(t.fit(train, 6, 7, B, T, {.out = nullptr, .held_out = &held}, never),
                         "fived::Trainer::fit: held_out is given but eval_every is 0: set eval_every to evaluate "
                         "every so many steps",
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(t.fit(train, 6, 7, B, T, {.out = nullptr, .eval_every = 2}, never),
                         "fived::Trainer::fit: eval_every 2 needs held_out: the sampler of the held-out data",
                         std::invalid_argument);
    const BatchSampler short_part(data, 3000, 3010, 2);
    CHECK_THROWS_WITH_AS(t.fit(train, 6, 7, B, T, {.out = nullptr, .held_out = &short_part, .eval_every = 2}, never),
                         "fived::Trainer::fit: the held-out part of text has 10 tokens, fewer than a window of T + 1 "
                         "= 17",
                         std::invalid_argument);
    printed = read_and_close(out);
  });
  CAPTURE(printed);
  CAPTURE(metrics);
  CHECK(field(metrics, "loss") == losses);  // bit for bit what the steps returned
  CHECK(field(metrics, "step") == std::vector<double>{1, 2, 2, 3, 4, 4, 5, 5});
  const std::vector<double> held_out = field(metrics, "held_out_loss");
  REQUIRE(held_out.size() == 3);
  CHECK(held_out[2] == last);
  CHECK(field(metrics, "batches") == std::vector<double>{2, 2, 2});
  CHECK(field(metrics, "tokens") == std::vector<double>(5, 4.0 * B * T));
  char expected[96];
  std::snprintf(expected, sizeof expected, "     5   held-out loss %.4f (2 batches)\n", last);
  CHECK(printed.find("     2   held-out loss ") != std::string::npos);
  CHECK(printed.find("     4   held-out loss ") != std::string::npos);
  CHECK(printed.find(expected) != std::string::npos);
  CHECK(printed.find("     1   held-out") == std::string::npos);
  CHECK(printed.find("     3   held-out") == std::string::npos);
}

TEST_CASE("fit stops at a step whose loss is not finite, on every rank, before its callback (which saves) sees it") {
  using M = Mesh<DP<2>, TP<2>>;
  using Model = GPT<five_cfg, M, float, Host, SequenceParallel>;
  std::string text;
  for (int i = 0; i < 2000; ++i) text += static_cast<char>((i * 5 + i / 7) % five_cfg::vocab);
  const TokenStream data = TokenStream::bytes_of(text);
  const BatchSampler train(data, 0, data.size(), 1);
  std::vector<int> stopped_at(M::size, 0), callbacks(M::size, 0);
  std::string metrics;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<Model, ZeRO<1>, Accumulate<2>> t(ctx, hp, init);
    std::vector<float> w = t.serial_params();
    // Position 0's embedding: every sequence reads it.
    using layout = Model::serial_layout;
    const std::size_t wpe = layout::tensors[static_cast<std::size_t>(*layout::find("wpe.weight"))].offset;
    w[wpe] = std::numeric_limits<float>::quiet_NaN();
    t.load_serial(w, t.serial_expert_params());
    const auto r = static_cast<std::size_t>(ctx.rank());
    std::FILE* lines = r == 0 ? std::tmpfile() : nullptr;  // rank 0 writes the metrics
    try {
      t.fit(train, 1, 3, B, T, {.out = nullptr, .metrics = lines}, [&](int, double) { ++callbacks[r]; });
    } catch (const NonFiniteStep& e) {
      stopped_at[r] = e.step;
      CHECK(std::isnan(e.loss));
      CHECK(std::string(e.what()).find("fived::Trainer::fit: step 1: the loss is nan and the gradient norm nan") == 0);
    }
    if (lines) metrics = read_and_close(lines);
  });
  CHECK(stopped_at == std::vector<int>(M::size, 1));
  CHECK(callbacks == std::vector<int>(M::size, 0));
  // The step that stopped the run is its metrics file's last line.
  CHECK(metrics.find("{\"step\":1,\"loss\":null,\"lr\":") == 0);
  CHECK(metrics.find("\"grad_norm\":null") != std::string::npos);
  CHECK(std::count(metrics.begin(), metrics.end(), '\n') == 1);
}

namespace {

// Bit for bit, nan included.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// hp, with the steps whose gradient norm is not finite skipped; on DP 2 x TP 2.
const TrainerConfig skipping = [] {
  TrainerConfig c = hp;
  c.adamw.skip_non_finite = true;
  return c;
}();
using SkipModel = GPT<five_cfg, Mesh<DP<2>, TP<2>>, float, Host, SequenceParallel>;

}  // namespace

TEST_CASE("with skip_non_finite a step whose gradient norm is not finite changes nothing: on DP 2 x TP 2 (ZeRO-1, "
          "experts with a selection bias) the steps around it are those of a run without it, bit for bit") {
  using Model = SkipModel;
  using M = Model::mesh;
  // Token `poison` has a nan embedding: the one batch that holds it makes every gradient nan.
  constexpr int poison = five_cfg::vocab - 1, micro = 2;
  struct Run {
    std::vector<double> losses;
    std::vector<bool> skipped;
    std::vector<float> weights, experts;
  };
  // Steps 1 and 3 on good batches, with (step 2) or without the bad batch between them.
  const auto run = [&](bool with_bad_step) {
    std::vector<Run> out(M::size);
    host::run(M::size, [&](host::Comm& world) {
      auto ctx = make_mesh_context<M>(world);
      Trainer<Model, ZeRO<1>, Accumulate<micro>> t(ctx, skipping, init);
      std::vector<float> w = t.serial_params();
      using layout = Model::serial_layout;
      const auto& wte = layout::tensors[static_cast<std::size_t>(*layout::find("wte.weight"))];
      std::fill_n(w.begin() + static_cast<std::ptrdiff_t>(wte.offset + std::size_t{poison} * five_cfg::d_model),
                  five_cfg::d_model, std::numeric_limits<float>::quiet_NaN());
      t.load_serial(w, t.serial_expert_params());
      Run& r = out[static_cast<std::size_t>(ctx.rank())];
      std::vector<int> tok, tgt;
      for (int s : with_bad_step ? std::vector<int>{1, 2, 3} : std::vector<int>{1, 3}) {
        test::global_batch(s, micro, B, T, poison, tok, tgt);  // ids below `poison`
        if (s == 2) tok[5] = poison;
        r.losses.push_back(t.step(s, tok, tgt, B, T));
        r.skipped.push_back(t.last_step_skipped());
      }
      r.weights = t.serial_params();
      r.experts = t.serial_expert_params();
    });
    return out;
  };
  const std::vector<Run> with = run(true), without = run(false);
  for (int r = 0; r < M::size; ++r) {
    CAPTURE(r);
    const Run &a = with[static_cast<std::size_t>(r)], &b = without[static_cast<std::size_t>(r)];
    REQUIRE(a.losses.size() == 3);
    CHECK(std::isnan(a.losses[1]));
    CHECK(a.skipped == std::vector<bool>{false, true, false});
    CHECK(b.skipped == std::vector<bool>{false, false});
    CHECK(a.losses[0] == b.losses[0]);
    CHECK(a.losses[2] == b.losses[1]);  // the selection bias did not move either: the same routing
    CHECK(same_bits(a.weights, b.weights));  // nor the moments or the step count (bias corrections)
    CHECK(same_bits(a.experts, b.experts));
    CHECK(std::count_if(a.weights.begin(), a.weights.end(), [](float x) { return std::isnan(x); }) ==
          five_cfg::d_model);  // the poisoned row only
  }
}

TEST_CASE("fit goes on past skipped steps, logs them as skipped, and stops at one more than max_skipped in a row with "
          "the weights of the step before them") {
  using Model = SkipModel;
  using M = Model::mesh;
  std::string text;
  for (int i = 0; i < 2000; ++i) text += static_cast<char>((i * 5 + i / 7) % five_cfg::vocab);
  const TokenStream data = TokenStream::bytes_of(text);
  const BatchSampler train(data, 0, data.size(), 1);
  std::vector<int> stopped_at(M::size, 0), callbacks(M::size, 0);
  std::string printed, metrics;
  std::vector<float> before, after;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<Model, ZeRO<1>, Accumulate<2>> t(ctx, skipping, init);
    std::vector<float> w = t.serial_params();
    using layout = Model::serial_layout;  // position 0's embedding: every step is nan
    w[layout::tensors[static_cast<std::size_t>(*layout::find("wpe.weight"))].offset] =
        std::numeric_limits<float>::quiet_NaN();
    t.load_serial(w, t.serial_expert_params());
    const auto r = static_cast<std::size_t>(ctx.rank());
    const std::vector<float> loaded = t.serial_params();  // a collective
    if (r == 0) before = loaded;
    std::FILE* out = r == 0 ? std::tmpfile() : nullptr;
    std::FILE* lines = r == 0 ? std::tmpfile() : nullptr;
    try {
      t.fit(train, 1, 6, B, T, {.log_every = 2, .out = out, .metrics = lines, .max_skipped = 2},
            [&](int, double) { ++callbacks[r]; });
    } catch (const NonFiniteStep& e) {
      stopped_at[r] = e.step;
      CHECK(e.skipped == 3);
      CHECK(std::string(e.what()).find("fived::Trainer::fit: step 3: the loss is nan and the gradient norm nan, not "
                                       "both finite, at 3 steps in a row, each skipped (nothing updated): the weights "
                                       "are those after step 0.") == 0);
    }
    const std::vector<float> now = t.serial_params();  // a collective
    if (r == 0) after = now, printed = read_and_close(out), metrics = read_and_close(lines);
  });
  CHECK(stopped_at == std::vector<int>(M::size, 3));
  CHECK(callbacks == std::vector<int>(M::size, 2));
  CHECK(same_bits(before, after));
  CAPTURE(printed);
  CAPTURE(metrics);
  CHECK(printed.find("(2 skipped)\n") != std::string::npos);
  CHECK(printed.find("(1 skipped)\n") != std::string::npos);  // step 3's line, the last
  CHECK(std::count(metrics.begin(), metrics.end(), '\n') == 3);
  CHECK(field(metrics, "step") == std::vector<double>{1, 2, 3});
  std::size_t marks = 0;
  for (std::size_t at = metrics.find(",\"skipped\":true}"); at != std::string::npos;
       at = metrics.find(",\"skipped\":true}", at + 1))
    ++marks;
  CHECK(marks == 3);
}

TEST_CASE("fit ends after the step at which any rank is asked to stop, on every rank: that step logged and passed "
          "to after as the last, not evaluated (its checkpoint first)") {
  using M = Mesh<DP<2>, TP<2>>;
  using Model = GPT<five_cfg, M, float, Host, SequenceParallel>;
  std::string text;
  for (int i = 0; i < 2000; ++i) text += static_cast<char>((i * 5 + i / 7) % five_cfg::vocab);
  const TokenStream data = TokenStream::bytes_of(text);
  const BatchSampler train(data, 0, 1600, 1), held(data, 1600, data.size(), 2);
  std::vector<std::vector<int>> steps(M::size), last_flags(M::size);
  std::string metrics;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<Model, ZeRO<1>, Accumulate<2>> t(ctx, hp, init);
    const auto r = static_cast<std::size_t>(ctx.rank());
    std::FILE* lines = r == 0 ? std::tmpfile() : nullptr;
    int asked = 0;
    // Rank 3 alone is asked to stop, at its third step (as one process of a job may be
    // signalled before the others).
    t.fit(train, 1, 6, B, T,
          {.out = nullptr, .metrics = lines, .held_out = &held, .eval_every = 2, .eval_batches = 1,
           .stop = [&] { return ++asked == 3 && r == 3; }},
          [&](int s, double, bool last) {
            steps[r].push_back(s);
            last_flags[r].push_back(last);
          });
    if (lines) metrics = read_and_close(lines);
  });
  CHECK(steps == std::vector<std::vector<int>>(M::size, {1, 2, 3}));
  CHECK(last_flags == std::vector<std::vector<int>>(M::size, {0, 0, 1}));
  CAPTURE(metrics);
  CHECK(field(metrics, "step") == std::vector<double>{1, 2, 2, 3});  // step 2 evaluated (eval_every), 3 not
  CHECK(field(metrics, "held_out_loss").size() == 1);
}

TEST_CASE("the learning rate warms up linearly, then falls on a cosine to its floor") {
  const WarmupCosine lr{.peak = 1.0, .warmup = 4, .total = 14, .floor = 0.1};
  CHECK(lr(1) == doctest::Approx(0.25));
  CHECK(lr(4) == doctest::Approx(1.0));
  CHECK(lr(9) == doctest::Approx(0.55));  // half way down the cosine
  CHECK(lr(14) == doctest::Approx(0.1));
  CHECK(lr(100) == doctest::Approx(0.1));
}

// ---- a Trainer an outside user drives: given weights, the gradient read between reduction
// and update, any learning-rate schedule --------------------------------------------------

namespace {

struct hf_tiny : gpt_config {  // tests/data/hf_tiny_gpt2.safetensors (make_hf_fixture.py)
  static constexpr int layers = 2, d_model = 16, heads = 2, vocab = 37, max_seq = 8, vocab_multiple = 8;
};
struct untied4 : gpt_config {
  static constexpr int layers = 4, d_model = 16, heads = 2, vocab = 37, max_seq = 8, vocab_multiple = 8;
  static constexpr bool tied = false;
};

// The serial model's gradient of the mean loss over `micro` micro-batches of [b, t].
template <class Cfg, class T>
std::vector<T> serial_grads(GPT<Cfg, Mesh<>, T>& m, const std::vector<int>& tok, const std::vector<int>& tgt, int micro,
                            int b, int t) {
  m.zero_grad();
  for (int k = 0; k < micro; ++k) {
    m.forward(tok.data() + k * b * t, tgt.data() + k * b * t, b, t);
    m.backward();
  }
  std::vector<T> g(m.grads().begin(), m.grads().end());
  for (T& x : g) x /= static_cast<T>(micro);
  return g;
}

// Per tensor of the serial layout, max |got - ref| / max |ref|: the worst one (and its name).
template <class L, class T>
double worst_tensor(const std::vector<T>& got, const std::vector<T>& ref, std::string* where = nullptr) {
  REQUIRE(got.size() == ref.size());
  double worst = 0;
  for (const ParamInfo& info : L::tensors)
    if (const double e = test::max_rel_error(got, ref, info.offset, info.size()); e > worst) {
      worst = e;
      if (where) *where = info.name();
    }
  return worst;
}

}  // namespace

// From the Hugging Face fixture (tied GPT-2: on a pipeline the last stage's head holds a copy
// of wte) onto mesh M: the weights every rank gathers are the file's, and the gradient read
// after one reduction is the serial model's. In double (the file's floats, exactly): in float
// this tiny model's first norm's bias gradient is a sum that cancels, and the serial model's
// own rounding there reaches 1.6e-5 of the exact gradient (seeds 1-4), more than the 1e-5 that
// would tell a wrong gradient from a reordered sum.
template <class M, class Policy, class Sched>
void from_hf_file(const char* what) {
  using Model = GPT<hf_tiny, M, double, Host, SequenceParallel>;
  const std::string file = std::string(FIVED_TEST_DATA_DIR) + "/hf_tiny_gpt2.safetensors";
  constexpr int b = 4, t = 8, micro = Sched::table.micro_batches;
  std::vector<int> tok, tgt;
  test::global_batch(1, micro, b, t, hf_tiny::vocab, tok, tgt);
  GPT<hf_tiny, Mesh<>, double> serial;
  serial.load(file);
  const std::vector<double> ref = serial_grads(serial, tok, tgt, micro, b, t);
  const std::vector<double> weights(serial.params().begin(), serial.params().end());
  std::vector<std::vector<double>> got(M::size), loaded(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<Model, Policy, Sched> tr(ctx, {.adamw = {.max_norm = 1.0}, .lr = ConstantLr{1e-3}}, GptInit{99});
    tr.load_weights(file);
    loaded[static_cast<std::size_t>(ctx.rank())] = tr.serial_params();
    tr.reduce(1, tok, tgt, b, t);
    got[static_cast<std::size_t>(ctx.rank())] = tr.serial_grads();
    tr.update();
  });
  for (int r = 0; r < M::size; ++r) {
    CAPTURE(r);
    CHECK(loaded[static_cast<std::size_t>(r)] == weights);  // the file's weights, on every rank
    std::string where;
    const double e = worst_tensor<GPT<hf_tiny>::serial_layout>(got[static_cast<std::size_t>(r)], ref, &where);
    if (r == 0) MESSAGE(std::string(what) << " from the HF file: gradient within " << e << " (" << where << ") of serial");
    CHECK(e <= 1e-12);
  }
}

TEST_CASE("a Trainer starts from the Hugging Face GPT-2 fixture; its gradient, read after the reduction, is the "
          "serial model's: Mesh<DP<2>, TP<2>> and Mesh<DP<2>, PP<2>, TP<2>> (tied across the stages)") {
  from_hf_file<Mesh<DP<2>, TP<2>>, ZeRO<1>, Accumulate<2>>("DP 2 x TP 2 (SP, ZeRO-1)");
  from_hf_file<Mesh<DP<2>, PP<2>, TP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 4>>("DP 2 x PP 2 x TP 2 (SP, ZeRO-1, 1F1B)");
}

TEST_CASE("a Trainer on Mesh<DP<2>, PP<2>, TP<2>> (1F1B, ZeRO-2) starts from the serial model's weights; its gathered "
          "gradient is the serial model's, and update() then equals step()") {
  using M = Mesh<DP<2>, PP<2>, TP<2>>;
  using Model = GPT<untied4, M, float, Host, SequenceParallel>;
  using Sched = pipeline::OneFOneB<2, 4>;
  constexpr int b = 2, t = 8;
  std::vector<int> tok, tgt;
  test::global_batch(1, 4, b, t, untied4::vocab, tok, tgt);
  GPT<untied4> serial(GptInit{3, 0.1});
  const std::vector<float> ref = serial_grads(serial, tok, tgt, 4, b, t);
  const std::vector<float> weights(serial.params().begin(), serial.params().end());
  std::vector<std::vector<float>> got(M::size), split(M::size), whole(M::size);
  const TrainerConfig cfg{.adamw = {.weight_decay = 0.1, .max_norm = 0.5},
                          .lr = WarmupStableDecay{.peak = 1e-2, .warmup = 0, .total = 10, .decay = 5}};
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    const auto me = static_cast<std::size_t>(ctx.rank());
    Trainer<Model, ZeRO<2>, Sched> a(ctx, cfg, GptInit{99});  // another init: the loaded weights must win
    a.load_serial(weights);
    a.reduce(1, tok, tgt, b, t);
    got[me] = a.serial_grads();
    a.update();
    split[me] = a.serial_params();
    Trainer<Model, ZeRO<2>, Sched> c(ctx, cfg, GptInit{99});
    c.load_serial(weights);
    c.step(1, tok, tgt, b, t);
    whole[me] = c.serial_params();
  });
  for (int r = 0; r < M::size; ++r) {
    CAPTURE(r);
    const double e = worst_tensor<GPT<untied4>::serial_layout>(got[static_cast<std::size_t>(r)], ref);
    if (r == 0) MESSAGE("DP 2 x PP 2 x TP 2 (SP, ZeRO-2, 1F1B) from serial weights: gradient within " << e << " of serial");
    CHECK(e <= 1e-5);
    CHECK(split[static_cast<std::size_t>(r)] == whole[static_cast<std::size_t>(r)]);  // reduce + update == step
    CHECK(split[static_cast<std::size_t>(r)] != weights);                             // and it moved
  }
}

TEST_CASE("learning-rate schedules: constant, warmup-stable-decay, any callable") {
  CHECK(ConstantLr{2e-4}(1) == 2e-4);
  CHECK(ConstantLr{2e-4}(1000) == 2e-4);
  const WarmupStableDecay wsd{.peak = 1.0, .warmup = 2, .total = 10, .decay = 4, .floor = 0.1};
  CHECK(wsd(1) == doctest::Approx(0.5));
  CHECK(wsd(2) == doctest::Approx(1.0));
  CHECK(wsd(6) == doctest::Approx(1.0));    // stable until total - decay
  CHECK(wsd(8) == doctest::Approx(0.55));   // halfway down
  CHECK(wsd(10) == doctest::Approx(0.1));
  CHECK(wsd(50) == doctest::Approx(0.1));
  const LrSchedule mine = [](int step) { return 1.0 / step; };
  const TrainerConfig cfg{.adamw = {}, .lr = mine};
  CHECK(cfg.lr(4) == 0.25);
}

// ---- tied embeddings across pipeline stages -----------------------------------------------

namespace {

struct tied4 : gpt_config {  // GPT-2's tie: the head multiplies by wte
  static constexpr int layers = 4, d_model = 16, heads = 2, vocab = 37, max_seq = 16, vocab_multiple = 8;
};
static_assert(GPT<tied4, Mesh<PP<2>>, float, Host, NoSequenceParallel, Layers<2, 2>>::has_tied_copy);
static_assert(!GPT<tied4, Mesh<PP<2>>, float, Host, NoSequenceParallel, Layers<0, 2>>::has_tied_copy);

constexpr int tied_steps = 3;
// eps 1e-4: the attention key bias has an exactly zero gradient, so its computed gradient is
// float rounding noise, which AdamW with a small eps turns into steps of random sign (2e-5
// relative with eps 1e-6): a measure of summation order, not of the tie.
const TrainerConfig tied_hp{.adamw = {.beta2 = 0.95, .eps = 1e-4, .weight_decay = 0.1, .max_norm = 0.5},
                            .lr = ConstantLr{3e-3}};

// held_out: the mean loss of the forwards of a batch no step draws, before the last step
// and after it.
std::vector<std::vector<float>> serial_tied(int micro, std::vector<double>& losses, std::vector<double>& held_out) {
  GPT<tied4> m(GptInit{7, 0.1});
  DataParallel<GPT<tied4>> dp(m, tied_hp.adamw, micro);
  dp.optimizer().hp.lr = 3e-3;
  std::vector<int> tok, tgt, held_tok, held_tgt;
  test::global_batch(1000, micro, 4, 8, tied4::vocab, held_tok, held_tgt);
  const auto evaluate = [&] {
    double sum = 0;
    for (int k = 0; k < micro; ++k) sum += m.forward(held_tok.data() + k * 32, held_tgt.data() + k * 32, 4, 8) / micro;
    held_out.push_back(sum);
  };
  for (int s = 1; s <= tied_steps; ++s) {
    if (s == tied_steps) evaluate();
    test::global_batch(s, micro, 4, 8, tied4::vocab, tok, tgt);
    losses.push_back(dp.step(tok, tgt, 4, 8));
  }
  evaluate();
  return {std::vector<float>(m.params().begin(), m.params().end())};
}

// The trainer's run: each rank's losses, weights and (evaluating) held-out losses before the
// last step and after it.
struct TiedRun {
  std::vector<std::vector<double>> losses, held_out;
  std::vector<std::vector<float>> weights;
};
template <class M, class Policy, class Sched, class SP>
TiedRun tied_run(bool evaluating) {
  using Model = GPT<tied4, M, float, Host, SP>;
  constexpr int micro = Sched::table.micro_batches;
  TiedRun out{std::vector<std::vector<double>>(M::size), std::vector<std::vector<double>>(M::size),
              std::vector<std::vector<float>>(M::size)};
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    const auto r = static_cast<std::size_t>(ctx.rank());
    Trainer<Model, Policy, Sched> t(ctx, tied_hp, GptInit{7, 0.1});
    std::vector<int> tok, tgt, held_tok, held_tgt;
    test::global_batch(1000, micro, 4, 8, tied4::vocab, held_tok, held_tgt);
    for (int s = 1; s <= tied_steps; ++s) {
      if (evaluating && s == tied_steps) out.held_out[r].push_back(t.evaluate(held_tok, held_tgt, 4, 8));
      test::global_batch(s, micro, 4, 8, tied4::vocab, tok, tgt);
      out.losses[r].push_back(t.step(s, tok, tgt, 4, 8));
    }
    if (evaluating) out.held_out[r].push_back(t.evaluate(held_tok, held_tgt, 4, 8));
    out.weights[r] = t.serial_params();
  });
  return out;
}

// Equal to serial after the steps; Trainer::evaluate (the chunks' forwards in turn) equal to
// the serial forwards, and the steps after it bit for bit those of a run without it.
template <class M, class Policy, class Sched, class SP>
void tied_equals_serial(const char* what) {
  constexpr int micro = Sched::table.micro_batches;
  std::vector<double> ref_losses, ref_held_out;
  const std::vector<float> ref = serial_tied(micro, ref_losses, ref_held_out)[0];
  const TiedRun got = tied_run<M, Policy, Sched, SP>(true), plain = tied_run<M, Policy, Sched, SP>(false);
  double worst = 0, worst_loss = 0, worst_held_out = 0;
  std::string where;
  for (int r = 0; r < M::size; ++r) {
    const auto i = static_cast<std::size_t>(r);
    for (int s = 0; s < tied_steps; ++s)
      worst_loss = std::max(worst_loss, std::abs(got.losses[i][static_cast<std::size_t>(s)] - ref_losses[static_cast<std::size_t>(s)]) /
                                            ref_losses[static_cast<std::size_t>(s)]);
    worst = std::max(worst, worst_tensor<GPT<tied4>::serial_layout>(got.weights[i], ref, &where));
    REQUIRE(got.held_out[i].size() == ref_held_out.size());
    for (std::size_t k = 0; k < ref_held_out.size(); ++k)
      worst_held_out = std::max(worst_held_out, std::abs(got.held_out[i][k] - ref_held_out[k]) / ref_held_out[k]);
    CHECK(got.losses[i] == plain.losses[i]);
    CHECK(got.weights[i] == plain.weights[i]);
  }
  MESSAGE(std::string(what) << ": losses within " << worst_loss << ", weights within " << worst << " (" << where
                            << ") of serial after " << tied_steps << " steps, held-out losses within " << worst_held_out);
  CHECK(worst_loss <= 1e-5);
  CHECK(worst <= 1e-5);
  CHECK(worst_held_out <= 1e-5);
}

}  // namespace

TEST_CASE("tied GPT-2 embeddings across pipeline stages (the head's copy of wte, gradients summed): equal serial; "
          "so does Trainer::evaluate before the last step and after it, through two chunks a rank and a V's turn, "
          "the steps after it as without it") {
  tied_equals_serial<Mesh<PP<2>>, NoZeRO, pipeline::OneFOneB<2, 4>, NoSequenceParallel>("PP 2, 1F1B");
  tied_equals_serial<Mesh<DP<2>, PP<2>, TP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 4>, SequenceParallel>(
      "DP 2 x PP 2 x TP 2, 1F1B, ZeRO-1, SP");
  tied_equals_serial<Mesh<DP<2>, PP<2>, TP<2>>, ZeRO<2>, pipeline::Interleaved1F1B<2, 4, 2>, SequenceParallel>(
      "DP 2 x PP 2 x TP 2, interleaved 1F1B (2 chunks), ZeRO-2, SP");
  // A V: the first and the last stage are both chunks of rank 0, which adds them in place.
  tied_equals_serial<Mesh<DP<2>, PP<2>>, ZeRO<3>, pipeline::ZBV<2, 4>, NoSequenceParallel>(
      "DP 2 x PP 2, ZB-V (both ends on rank 0), ZeRO-3");
}

TEST_CASE("an executor whose two stages cut the tied wte differently (other bucket sizes) refuses on every rank") {
  using M = Mesh<PP<2>>;
  using Sched = pipeline::OneFOneB<2, 2>;
  using Whole = GPT<tied4, M, float>;
  using cut = StageLayers<Whole, 2>;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    const int r = ctx.coord()[Axis::pp];
    auto build = [&]<int s, std::size_t bucket_bytes>() {
      using Part = typename Whole::template part<typename cut::template part<s>>;
      Part model(ctx, GptInit{7, 0.1});
      DataParallel<Part, NoZeRO, bucket_bytes> dp(model, ctx, tied_hp.adamw, 2);
      CHECK_THROWS_WITH_AS(pipeline::make_executor(Sched::table, r, ctx.comm<Axis::pp>(), std::tie(model), std::tie(dp)),
                           doctest::Contains("cut the tied tensor into different pieces (1 and 3 pieces of 640 and 640 "
                                             "elements)"),
                           std::logic_error);
    };
    if (r == 0) build.template operator()<0, std::size_t{4} << 20>();  // wte [40, 16]: one bucket
    else build.template operator()<1, 1024>();                         // three of 256 elements at most
  });
}

TEST_CASE("the 5D mesh's gradients read after one reduction, dense and experts (DP, PP, CP, TP, EP gathered), are the "
          "serial model's") {
  using M = Mesh<DP<2>, PP<2>, CP<2>, TP<2>, EP<2>>;
  using Sched = pipeline::OneFOneB<2, 4>;
  constexpr int micro = Sched::table.micro_batches, data_ranks = 2, b = B / data_ranks;
  std::vector<int> tok, tgt;
  test::global_batch(1, micro, B, T, five_cfg::vocab, tok, tgt);
  GPT<serial_cfg> serial(init);  // each data rank's rows of a micro-batch as a micro-batch of its own
  serial.zero_grad();
  for (int k = 0; k < micro * data_ranks; ++k) {
    serial.forward(tok.data() + k * b * T, tgt.data() + k * b * T, b, T);
    serial.backward();
  }
  auto mean = [&](std::span<const float> g) {
    std::vector<float> v(g.begin(), g.end());
    for (float& x : v) x /= static_cast<float>(micro * data_ranks);
    return v;
  };
  const std::vector<float> ref = mean(serial.grads()), ref_experts = mean(serial.expert_grads());
  std::vector<std::vector<float>> dense(M::size), experts(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<GPT<five_cfg, M, float, Host, SequenceParallel>, ZeRO<1>, Sched> t(ctx, hp, init);
    t.reduce(1, tok, tgt, B, T);
    dense[static_cast<std::size_t>(ctx.rank())] = t.serial_grads();
    experts[static_cast<std::size_t>(ctx.rank())] = t.serial_expert_grads();
  });
  double worst = 0, worst_experts = 0;
  for (int r = 0; r < M::size; ++r) {
    worst = std::max(worst, worst_tensor<GPT<serial_cfg>::serial_layout>(dense[static_cast<std::size_t>(r)], ref));
    worst_experts = std::max(worst_experts, worst_tensor<GPT<serial_cfg>::serial_expert_layout>(
                                                experts[static_cast<std::size_t>(r)], ref_experts));
  }
  MESSAGE("5D gradients within " << worst << " (dense) and " << worst_experts << " (experts) of serial");
  CHECK(worst <= 1e-5);
  CHECK(worst_experts <= 1e-5);
}
