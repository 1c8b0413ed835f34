// Pipeline schedules on the host executor with equal-cost stand-in stages: does the
// executor reach the bubble the table promises?
//
//   bench/pipeline [--unit-ms 10] [--steps 3]
//
// Each schedule (P = 4 ranks as threads of the host backend, M = 8 micro-batches; V = 2
// for interleaved and ZB-V) runs through pipeline::Executor with stages that sleep for a
// fixed time per action: F = 1 unit, B = 2, I = W = 1 (the table's cost model). Per rank
// the idle fraction is 1 - (time asleep in actions) / (step time), the step timed from a
// barrier; the bubble is the mean over ranks. Printed beside the table's bubble (eager
// sends: the host backend's sends do not wait for the receiver) and the table's peak
// activations on rank 0 (micro-batch x chunk pairs held until B or I, and until W), and
// the executor's activation slots there (the most micro-batches it kept at once, over its
// chunks: a slot is held until W and until d(input) has been sent, and at the turn of a V
// from the forward that hands it over, so it can exceed the table's count by the
// messages in flight), and the most micro-batches any rank holds between I and W (a
// model's tapes of snapshots for W: nn/weight_grads.hpp). The planner's figures are these
// counts (plan/plan.hpp: slots to W, tapes I..W); then the step time, the table's makespan
// in units (a chunk's F is one unit) against rank 0's median. M = 8 and 16; then one line per
// schedule in the form scripts read. The median step of --steps is reported. Sleeping,
// not spinning, so the 2-core VM can run 4 ranks.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/device/buffer.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/pipeline/stage_layers.hpp"
#include "fived/train/data_parallel.hpp"
#include "fived/model/unit_hooks.hpp"
#include "fived/optim/flat_range.hpp"
#include "fived/pipeline/executor.hpp"
#include "fived/pipeline/schedules.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double unit_ms = 10;

// Sleeps `units` and counts the time as busy.
struct Busy {
  double seconds = 0;
  void work(int units) {
    const auto t0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(unit_ms * units));
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }
};

// A stage with the executor's model interface that computes nothing: one float crosses
// each boundary, and every action sleeps its cost.
template <bool Embedding, bool Head>
struct SleepStage {
  using value_type = float;
  using device = fived::Host;
  static constexpr bool has_embedding = Embedding, has_head = Head;
  struct Ops {
    double losses = 0;
    void copy(float* dst, const float* src, std::size_t n) { std::copy_n(src, n, dst); }
    void begin_loss_sum() { losses = 0; }
    double loss_sum() const { return losses; }
    template <class U>
    fived::Buffer<U, fived::Host> make_buffer(std::size_t n) {
      return fived::Buffer<U, fived::Host>(n);
    }
  };
  Busy* busy = nullptr;
  Ops ops_;
  std::vector<float> acts;
  float grad = 0;

  static std::size_t boundary_size(int, int) { return 1; }
  static int local_length(int T) { return T; }
  Ops& ops() { return ops_; }
  void set_slots(int k) { acts.assign(static_cast<std::size_t>(k), 0.0f); }
  void enqueue_forward(const int*, const int*, int, int, const fived::UnitHooks&, int) { busy->work(1); }
  void add_to_loss_sum(int) { ops_.losses += 1.0; }
  void backward(const fived::UnitHooks&, int) { busy->work(2); }
  void backward_input(const fived::UnitHooks&, int) { busy->work(1); }
  void backward_weight(const fived::UnitHooks&, int) { busy->work(1); }
  float* input(int slot, int, int) { return &acts[static_cast<std::size_t>(slot)]; }
  const float* output(int slot) const { return &acts[static_cast<std::size_t>(slot)]; }
  float* output_grad(int, int) { return &grad; }
  const float* input_grad() const { return &grad; }
};

// The trainer interface with nothing to train.
template <int M>
struct NoTrainer {
  fived::UnitHooks none;
  static fived::FlatRange rows(int, int B) { return {0, static_cast<std::size_t>(B)}; }
  int rank() const { return 0; }
  int data_rank() const { return 0; }
  int accum() const { return M; }
  void begin_step() {}
  const fived::UnitHooks& hooks() const { return none; }
  void begin_backward(bool) {}
  void end_backward() {}
  void end_micro_batches() {}
  struct NoOps {
    void zero(double*, std::size_t) {}
  };
  struct NoModel {
    NoOps none;
    NoOps& ops() { return none; }
  } nothing;
  NoModel& model() { return nothing; }
  void add_grad_sum_of_squares(double*) {}
  void update(const double*) {}
  double average(double v) { return v; }
};

struct Measured {
  std::vector<double> idle;  // per rank
  int slots0 = 0;            // rank 0's activation slots, over its chunks
  double step_ms = 0;        // rank 0's median step
};

// One line per schedule, for scripts: schedule=<name> P=<p> M=<m> bubble_measured=<x> bubble_table=<y>.
std::vector<std::string> summary;

template <class Sched, int r, std::size_t... c>
void run_rank(fived::host::Comm& pp, int steps, Measured& out, std::vector<double>& step_idle,
              std::index_sequence<c...>) {
  constexpr auto shape = Sched::table.shape;
  constexpr int S = shape.stages(), M = shape.micro_batches;
  std::tuple<SleepStage<shape.stage(r, static_cast<int>(c)) == 0, shape.stage(r, static_cast<int>(c)) == S - 1>...>
      stages;
  std::tuple<NoTrainer<(static_cast<void>(c), M)>...> trainers;
  Busy busy;
  ((std::get<c>(stages).busy = &busy), ...);
  auto exec = fived::pipeline::make_executor(Sched::table, r, pp, std::tie(std::get<c>(stages)...),
                                             std::tie(std::get<c>(trainers)...));
  const std::vector<int> ids(static_cast<std::size_t>(M), 0);
  std::vector<double> idle, ms;
  for (int s = 0; s < steps; ++s) {
    pp.barrier();
    busy.seconds = 0;
    const auto t0 = Clock::now();
    exec.step(ids, ids, 1, 1);
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    idle.push_back(1.0 - busy.seconds / wall);
    ms.push_back(1e3 * wall);
  }
  std::sort(idle.begin(), idle.end());
  std::sort(ms.begin(), ms.end());
  step_idle[static_cast<std::size_t>(r)] = idle[idle.size() / 2];
  if (r == 0) out.slots0 = (exec.slots(static_cast<int>(c)) + ...), out.step_ms = ms[ms.size() / 2];
}

template <class Sched>
Measured measure(int steps) {
  constexpr int P = Sched::table.ranks, V = Sched::table.chunks;
  Measured m;
  m.idle.assign(P, 0.0);
  fived::host::run(P, [&](fived::host::Comm& pp) {
    [&]<int... r>(std::integer_sequence<int, r...>) {
      (..., (pp.rank() == r ? run_rank<Sched, r>(pp, steps, m, m.idle, std::make_index_sequence<V>{}) : void()));
    }(std::make_integer_sequence<int, P>{});
  });
  return m;
}

template <class Sched>
void row(const char* name, int steps) {
  const Measured m = measure<Sched>(steps);
  double bubble = 0;
  for (double i : m.idle) bubble += i;
  bubble /= static_cast<double>(m.idle.size());
  const auto& f = Sched::figures;
  std::printf("%-13s %2d %3d %2d %8.1f%% %8.1f%% %+7.1f   ", name, Sched::table.ranks, Sched::table.micro_batches,
              Sched::table.chunks, 100.0 * f.bubble, 100.0 * bubble, 100.0 * (bubble - f.bubble));
  for (double i : m.idle) std::printf(" %5.1f", 100.0 * i);
  const int deferred = *std::max_element(f.peak_deferred.begin(), f.peak_deferred.end());
  std::printf("   %5d %5d %6d %6d   %7.0f %7.0f\n", f.peak_activations[0], f.peak_pending[0], m.slots0, deferred,
              unit_ms * f.makespan, m.step_ms);
  std::fflush(stdout);
  char line[160];
  std::snprintf(line, sizeof line, "schedule=%s P=%d M=%d bubble_measured=%.4f bubble_table=%.4f", name,
                Sched::table.ranks, Sched::table.micro_batches, bubble, f.bubble);
  summary.emplace_back(line);
}

template <int M>
void every_schedule(int steps) {
  namespace pl = fived::pipeline;
  row<pl::GPipe<4, M>>("GPipe", steps);
  row<pl::OneFOneB<4, M>>("1F1B", steps);
  row<pl::Interleaved1F1B<4, M, 2>>("interleaved", steps);
  row<pl::ZBH1<4, M>>("ZB-H1", steps);
  row<pl::ZBV<4, M>>("ZB-V", steps);
  row<pl::DualPipeV<4, M>>("DualPipeV", steps);
}

// ---- the schedules on a real model --------------------------------------------------------

// GPT-2 blocks on Mesh<PP<2>> (one core a rank on the 2-core VM), the backward split into I
// and W for real (nn/weight_grads.hpp). Each rank's idle share is measured as above, with its
// compute timed around the model's calls (Timed), so the bubble does not depend on how fast
// the machine happens to be. Its actions do not cost the table's units: their mean times are
// printed, and the table's bubble at those costs ("at costs": the dry run of
// pipeline/simulate.hpp with rank 0's mean F, B, I and W). ZB-H1 runs twice: with its
// messages placed for unit costs (the default) and for about these costs (model_costs).
struct bench_gpt : fived::gpt_config {
  static constexpr int layers = 8, d_model = 128, heads = 4, vocab = 512, max_seq = 128, vocab_multiple = 64;
  static constexpr bool tied = false;
};
constexpr int model_B = 2, model_T = 128;

struct Timing {
  double seconds = 0;
  double op[4] = {};  // F, B, I, W: seconds in all
  int count[4] = {};
};

// A model part whose compute calls are timed.
template <class Part>
struct Timed : Part {
  using Part::Part;
  Timing* timing = nullptr;
  template <class F>
  void timed(int op, F&& f) {
    const auto t0 = Clock::now();
    f();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    timing->seconds += s, timing->op[op] += s, ++timing->count[op];
  }
  void enqueue_forward(const int* tok, const int* tgt, int B, int T, const fived::UnitHooks& h, int k) {
    timed(0, [&] { Part::enqueue_forward(tok, tgt, B, T, h, k); });
  }
  void backward(const fived::UnitHooks& h, int k) { timed(1, [&] { Part::backward(h, k); }); }
  void backward_input(const fived::UnitHooks& h, int k) { timed(2, [&] { Part::backward_input(h, k); }); }
  void backward_weight(const fived::UnitHooks& h, int k) { timed(3, [&] { Part::backward_weight(h, k); }); }
};

struct ModelMeasured {
  std::vector<double> idle;  // per rank
  Timing timing;             // rank 0's, over the timed steps
};

template <class Sched, int r>
void run_model_rank(fived::MeshContext<fived::Mesh<fived::PP<2>>, fived::host::Comm>& ctx, int steps,
                    ModelMeasured& out) {
  using M = fived::Mesh<fived::PP<2>>;
  using Part = fived::GPT<bench_gpt, M, float, fived::Host, fived::NoSequenceParallel,
                          typename fived::StageLayers<fived::GPT<bench_gpt>, 2>::template part<r>>;
  constexpr int micro = Sched::table.micro_batches;
  Timed<Part> model(ctx, fived::GptInit{.seed = 1});
  fived::DataParallel<Timed<Part>> dp(model, ctx, {.lr = 1e-3f, .max_norm = 1.0f}, micro);
  auto& pp = ctx.template comm<fived::Axis::pp>();
  auto exec = fived::pipeline::make_executor(Sched::table, r, pp, std::tie(model), std::tie(dp));
  std::vector<int> tok(static_cast<std::size_t>(micro) * model_B * model_T), tgt(tok.size());
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int>(i * 7 % 512), tgt[i] = tok[(i + 1) % tok.size()];
  Timing timing;
  std::vector<double> idle;
  for (int s = 0; s <= steps; ++s) {  // step 0 sizes the buffers
    model.timing = &timing;
    timing = {};
    pp.barrier();
    const auto t0 = Clock::now();
    exec.step(tok, tgt, model_B, model_T);
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s > 0) idle.push_back(1.0 - timing.seconds / wall);
    if (r == 0 && s == steps) out.timing = timing;
  }
  std::sort(idle.begin(), idle.end());
  out.idle[r] = idle[idle.size() / 2];
}

template <class Sched>
void model_row(const char* name, int steps) {
  static_assert(Sched::table.ranks == 2 && Sched::table.chunks == 1);
  ModelMeasured m;
  m.idle.assign(2, 0.0);
  fived::host::run(2, [&](fived::host::Comm& world) {
    auto ctx = fived::make_mesh_context<fived::Mesh<fived::PP<2>>>(world);
    if (ctx.rank() == 0) run_model_rank<Sched, 0>(ctx, steps, m);
    else run_model_rank<Sched, 1>(ctx, steps, m);
  });
  const double bubble = (m.idle[0] + m.idle[1]) / 2;
  auto mean_ms = [&](int op) { return m.timing.count[op] ? 1e3 * m.timing.op[op] / m.timing.count[op] : 0.0; };
  // The table's bubble at these costs (rank 0's means in 0.1 ms, the same on both ranks).
  auto tenths = [&](int op) { return std::max(1, static_cast<int>(10 * mean_ms(op) + 0.5)); };
  const double at_costs =
      fived::pipeline::measure(Sched::table, {tenths(0), tenths(1), tenths(2), tenths(3)}).bubble();
  std::printf("%-13s %2d %3d %8.1f%% %9.1f%% %9.1f%%     %5.1f %5.1f   %5.1f %5.1f %5.1f %5.1f\n", name, 2,
              Sched::table.micro_batches, 100.0 * Sched::figures.bubble, 100.0 * at_costs, 100.0 * bubble,
              100.0 * m.idle[0], 100.0 * m.idle[1], mean_ms(0), mean_ms(1), mean_ms(2), mean_ms(3));
  std::fflush(stdout);
}

// ZB-H1's and 1F1B's bubbles at costs C, ZB-H1's messages placed for unit costs and for C.
template <fived::pipeline::Cost C>
void dry_run_row() {
  namespace pl = fived::pipeline;
  auto at = [](const auto& table) { return 100.0 * pl::measure(table, C).bubble(); };
  std::printf("%6d %6d %11.1f%% %11.1f%% %11.1f%%   %11.1f%% %11.1f%% %11.1f%%\n", C.input_grad, C.weight_grad,
              at(pl::ZBH1<2, 8>::table), at(pl::ZBH1<2, 8, C>::table), at(pl::OneFOneB<2, 8>::table),
              at(pl::ZBH1<4, 8>::table), at(pl::ZBH1<4, 8, C>::table), at(pl::OneFOneB<4, 8>::table));
}

// About this model's costs on the 2-core VM (ms): what ZB-H1's messages are placed for below.
constexpr fived::pipeline::Cost model_costs{.forward = 29, .backward = 57, .input_grad = 40, .weight_grad = 17};

}  // namespace

int main(int argc, char** argv) {
  int steps = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if ((a == "--unit-ms" || a == "--steps") && i + 1 < argc) {
      const double v = std::atof(argv[++i]);
      if (!(v > 0)) {
        std::fprintf(stderr, "pipeline: %s needs a positive number\n", a.data());
        return 2;
      }
      (a == "--steps" ? steps = static_cast<int>(v) : (unit_ms = v, 0));
    } else {
      std::fprintf(stderr, "usage: pipeline [--unit-ms 10] [--steps 3]\n");
      return 2;
    }
  }
  std::printf("fived bench/pipeline: host executor, stand-in stages sleeping F = %g ms, B = 2F, I = W = F; "
              "median of %d steps\n",
              unit_ms, steps);
  std::printf("%-13s %2s %3s %2s %9s %9s %7s   %-23s   %5s %5s %6s %6s   %7s %7s\n", "schedule", "P", "M", "V",
              "table", "measured", "diff", "idle % per rank", "to BI", "to W", "slots", "I..W", "step ms", "measured");
  every_schedule<8>(steps);
  every_schedule<16>(steps);
  std::printf("\n");
  for (const std::string& l : summary) std::printf("%s\n", l.c_str());

  namespace pl = fived::pipeline;
  // A zero-bubble table's receives are placed for the costs it is made for (unit costs by
  // default, I = W = F). When I costs more than W (attention's backward is all I), a rank
  // waits at a receive placed for unit costs before W's it could run; placed for the real
  // costs, the same order keeps its gain. The dry run at F = 29, I + W = B = 57 (about this
  // model's on the 2-core VM), as I grows:
  std::printf("\nthe dry run at F = 29, I + W = B = 57 as I grows (M = 8): ZB-H1 with its messages placed for unit "
              "costs, and for these\n");
  std::printf("%6s %6s %12s %12s %12s   %12s %12s %12s\n", "I", "W", "P=2 unit", "P=2 costs", "1F1B P=2",
              "P=4 unit", "P=4 costs", "1F1B P=4");
  [&]<pl::Cost... C>() { (dry_run_row<C>(), ...); }.template operator()<pl::Cost{29, 57, 29, 28}, pl::Cost{29, 57, 34, 23},
                                                                       pl::Cost{29, 57, 40, 17}, pl::Cost{29, 57, 45, 12}>();
  std::printf("\n");
  std::printf("the backward split for real: GPT-2 blocks (%d layers, d_model %d, B %d, T %d) on Mesh<PP<2>>, "
              "ranks as threads, compute timed in the model's calls; median of %d steps\n",
              bench_gpt::layers, bench_gpt::d_model, model_B, model_T, steps);
  std::printf("%-13s %2s %3s %9s %10s %10s     %-11s   %5s %5s %5s %5s\n", "schedule", "P", "M", "table",
              "at costs", "measured", "idle % rank", "F ms", "B ms", "I ms", "W ms");
  model_row<pl::OneFOneB<2, 8>>("1F1B", steps);
  model_row<pl::ZBH1<2, 8>>("ZB-H1 (unit)", steps);
  model_row<pl::ZBH1<2, 8, model_costs>>("ZB-H1 (costs)", steps);
  model_row<pl::OneFOneB<2, 16>>("1F1B", steps);
  model_row<pl::ZBH1<2, 16>>("ZB-H1 (unit)", steps);
  model_row<pl::ZBH1<2, 16, model_costs>>("ZB-H1 (costs)", steps);
  return 0;
}
