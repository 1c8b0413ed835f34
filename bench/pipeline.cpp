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
// messages in flight). The median step of --steps is reported. Sleeping, not spinning, so
// the 2-core VM can run 4 ranks.

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
  double grad_sum_of_squares() { return 0; }
  void update(double) {}
  double average(double v) { return v; }
};

struct Measured {
  std::vector<double> idle;  // per rank
  int slots0 = 0;            // rank 0's activation slots, over its chunks
};

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
  std::vector<double> idle;
  for (int s = 0; s < steps; ++s) {
    pp.barrier();
    busy.seconds = 0;
    const auto t0 = Clock::now();
    exec.step(ids, ids, 1, 1);
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    idle.push_back(1.0 - busy.seconds / wall);
  }
  std::sort(idle.begin(), idle.end());
  step_idle[static_cast<std::size_t>(r)] = idle[idle.size() / 2];
  if (r == 0) out.slots0 = (exec.slots(static_cast<int>(c)) + ...);
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
  std::printf("   %5d %5d %6d\n", f.peak_activations[0], f.peak_pending[0], m.slots0);
  std::fflush(stdout);
}

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
  namespace pl = fived::pipeline;
  std::printf("fived bench/pipeline: host executor, stand-in stages sleeping F = %g ms, B = 2F, I = W = F; "
              "median of %d steps\n",
              unit_ms, steps);
  std::printf("%-13s %2s %3s %2s %9s %9s %7s   %-23s   %5s %5s %6s\n", "schedule", "P", "M", "V", "table", "measured",
              "diff", "idle % per rank", "to BI", "to W", "slots");
  row<pl::GPipe<4, 8>>("GPipe", steps);
  row<pl::OneFOneB<4, 8>>("1F1B", steps);
  row<pl::Interleaved1F1B<4, 8, 2>>("interleaved", steps);
  row<pl::ZBH1<4, 8>>("ZB-H1", steps);
  row<pl::ZBV<4, 8>>("ZB-V", steps);
  row<pl::DualPipeV<4, 8>>("DualPipeV", steps);
  return 0;
}
