// Your own model on every axis: examples/parallel_blocks.hpp's model (parallel attention +
// MLP blocks, written outside namespace fived) trained by fived::Trainer on
// Mesh<DP<2>, PP<2>, TP<2>> (8 ranks as threads) with sequence parallelism, ZeRO-1 and 1F1B
// over 4 micro-batches. It prints the model's plan (bytes per GPU and traffic per step,
// computed at compile time from the model type), trains half the steps, saves a sharded
// checkpoint, then a second Trainer resumes from it and trains the rest, with a held-out loss
// (the last tenth of the lines, Trainer::evaluate on the mesh) every 10 steps. Exit status 0
// when both the training and the held-out loss fell.
//
//   custom_model [--steps N] [--dir DIR]        (defaults: 60 steps, ./custom_model_checkpoints)
//
// Data: lines of arithmetic progressions modulo 64 (a, a+d, a+2d, ...), whose next token is
// easy once a line's first two are seen: the loss falls from ln 64 = 4.16 within the run. The
// training lines are drawn each once an epoch (SampleOrder::epochs).

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>

#include <fived/comm/host.hpp>
#include <fived/plan/plan.hpp>
#include <fived/train/trainer.hpp>

#include "parallel_blocks.hpp"

namespace {

using namespace fived;
using mesh = Mesh<DP<2>, PP<2>, TP<2>>;
using model = parallel_gpt::Model<mesh, SequenceParallel>;
using schedule = pipeline::OneFOneB<2, 4>;
using trainer = Trainer<model, ZeRO<1>, schedule>;
constexpr int B = 4, T = 16;  // each micro-batch: B sequences of T tokens

// The run as the planner reads it (plan/layout.hpp), with the Trainer's own cut of the blocks.
struct run : plan::layout {
  using mesh = ::mesh;
  using schedule = ::schedule;
  static constexpr bool sequence_parallel = true;
  static constexpr int zero = 1, element_bytes = 4, micro_batch = B / mesh::dp, sequence = T;
  static constexpr auto bounds = trainer::cut::bounds;
};
using the_plan = plan::Plan<plan::from_model<model>(), run>;

void print_plan() {
  constexpr plan::Memory m = the_plan::memory;
  auto kib = [](plan::Bytes b) { return static_cast<double>(b) / 1024.0; };
  std::printf("plan (compile time), pipeline rank %d, the fullest: %.1f KiB\n", the_plan::fullest_rank, kib(m.total()));
  std::printf("  parameters %.1f, gradients %.1f, AdamW %.1f, ZeRO staging %.1f KiB\n", kib(m.parameters),
              kib(m.gradients), kib(m.optimizer), kib(m.staging));
  std::printf("  activations %.1f KiB a micro-batch x %d in flight, work %.1f KiB\n", kib(m.activations), m.in_flight,
              kib(m.work));
  constexpr plan::Traffic t = the_plan::traffic;
  std::printf("  per step: TP all-gather %lld calls, reduce-scatter %lld; DP reduce-scatter %lld KiB; "
              "PP %lld send/recv; bubble %.0f%%\n",
              static_cast<long long>(t.tp.all_gather.calls), static_cast<long long>(t.tp.reduce_scatter.calls),
              static_cast<long long>(t.grad.reduce_scatter.bytes / 1024), static_cast<long long>(t.pp.send_recv.calls),
              100 * the_plan::bubble);
}

// Lines of T + 1 tokens, each an arithmetic progression modulo the vocabulary.
TokenStream progressions(int lines) {
  std::mt19937 rng(7);
  std::string text;
  for (int i = 0; i < lines; ++i) {
    const int a = static_cast<int>(rng() % 64), d = 1 + static_cast<int>(rng() % 5);
    for (int k = 0; k <= T; ++k) text.push_back(static_cast<char>((a + k * d) % 64));
  }
  return TokenStream::bytes_of(std::move(text), "progressions");
}

}  // namespace

int main(int argc, char** argv) try {
  int steps = 60;
  std::filesystem::path dir = "custom_model_checkpoints";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::stoi(argv[++i]);
    else if (a == "--dir" && i + 1 < argc) dir = argv[++i];
    else throw std::invalid_argument("usage: custom_model [--steps N >= 2] [--dir DIR] (got '" + a + "')");
  }
  if (steps < 2) throw std::invalid_argument("custom_model: --steps must be at least 2 (half before the checkpoint)");
  std::printf("model: %s, %zu parameters\n", model::config_name().c_str(), model::serial_layout::num_parameters);
  std::printf("mesh: %s, %d ranks; ZeRO-1, sequence parallel, 1F1B over %d micro-batches of %d x %d\n",
              mesh::name().c_str(), mesh::size, schedule::table.micro_batches, B, T);
  print_plan();

  const TokenStream data = progressions(4096);
  const std::size_t split = data.size() / (T + 1) * 9 / 10 * (T + 1);  // the last tenth of the lines held out
  BatchSampler sampler(data, 0, split, 1), held(data, split, data.size(), 2);
  sampler.align = held.align = T + 1;
  sampler.order = SampleOrder::epochs;  // each line once an epoch
  const TrainerConfig hp{.adamw = {.weight_decay = 0.1, .max_norm = 1.0},
                         .lr = WarmupCosine{.peak = 3e-3, .warmup = 5, .total = steps, .floor = 0.1}};
  const int half = steps / 2;
  std::filesystem::remove_all(dir);
  double first_loss = 0, last_loss = 0, held_before = 0, held_after = 0;
  host::run(mesh::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<mesh>(world);
    {
      trainer t(ctx, hp, GptInit{1});
      const double before = t.evaluate(held, 4, B, T);  // on the mesh, forwards only: every rank calls it
      if (ctx.rank() == 0) held_before = before;
      t.fit(sampler, 1, half, B, T, {.log_every = 10}, [&](int s, double loss) {
        if (s == 1 && ctx.rank() == 0) first_loss = loss;
      });
      t.save(dir, half);
    }
    trainer resumed(ctx, hp, GptInit{2});  // another start: the checkpoint must replace it
    const int from = resumed.load(dir);
    if (ctx.rank() == 0) std::printf("saved step %d to %s and resumed from it in a new Trainer\n", from, dir.c_str());
    resumed.fit(sampler, from + 1, steps, B, T,
                {.log_every = 10, .held_out = &held, .eval_every = 10, .eval_batches = 4},
                [&](int, double loss) {
                  if (ctx.rank() == 0) last_loss = loss;
                });
    const double after = resumed.evaluate(held, 4, B, T);
    if (ctx.rank() == 0) held_after = after;
  });
  std::printf("loss %.3f at step 1, %.3f at step %d; held-out loss %.3f before training, %.3f after\n", first_loss,
              last_loss, steps, held_before, held_after);
  return last_loss < first_loss && held_after < held_before ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "custom_model: %s\n", e.what());
  return 2;
}
