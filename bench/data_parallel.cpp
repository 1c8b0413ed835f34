// Data-parallel training steps on the host backend (ranks as threads): for each ZeRO
// policy, with the reductions overlapped with backward (on the communication thread) and
// after backward, the median step time and what a rank holds, in bytes per parameter.
//
//   bench/data_parallel [--ranks 2] [--steps 7] [--accum 2]
//
// The host backend exists for testing; the times show the cost of the policies' extra
// collectives and copies relative to each other on this machine, not a product speed (on
// a machine with fewer cores than ranks x 2 threads, the communication thread competes with
// compute for a core).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/train/data_parallel.hpp"

namespace {

struct cfg : fived::gpt_config {
  static constexpr int layers = 4, d_model = 128, heads = 4, vocab = 512, max_seq = 64;
};
template <int DP>
using Model = fived::GPT<cfg, fived::Mesh<fived::DP<DP>>>;
constexpr int B = 8, T = 64;  // global micro-batch

struct Options {
  int ranks = 2, steps = 7, accum = 2;
};

struct Row {
  double step_ms = 0, held = 0, peak = 0;  // held/peak: bytes per parameter
};

template <int DP, class Policy>
Row measure(const Options& o, bool overlap) {
  Row row;
  fived::host::run(DP, [&](fived::host::Comm& world) {
    auto ctx = fived::make_mesh_context<fived::Mesh<fived::DP<DP>>>(world);
    auto& comm = ctx.template comm<fived::Axis::dp>();
    Model<DP> m(fived::GptInit{.seed = 1});
    fived::DataParallel<Model<DP>, Policy> dp(m, ctx, {.lr = 1e-3f, .weight_decay = 0.1f, .max_norm = 1.0f},
                                              o.accum);
    dp.set_overlap(overlap);
    std::mt19937 rng(5);
    std::uniform_int_distribution<int> id(0, cfg::vocab - 1);
    std::vector<int> tok(static_cast<std::size_t>(o.accum) * B * T), tgt(tok.size());
    std::vector<double> ms;
    for (int s = 0; s < o.steps + 2; ++s) {  // 2 warm-up steps
      for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = id(rng), tgt[i] = id(rng);
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      dp.step(tok, tgt, B, T);
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (s >= 2) ms.push_back(t);
    }
    if (comm.rank() != 0) return;
    std::sort(ms.begin(), ms.end());
    const auto mem = dp.memory();
    const double n = static_cast<double>(Model<DP>::layout::size);
    row = {ms[ms.size() / 2], static_cast<double>(mem.params + mem.grads + mem.optimizer) / n,
           static_cast<double>(mem.transient_peak) / n};
  });
  return row;
}

template <int DP>
void table(const Options& o) {
  auto line = [&](const char* name, auto measure_one) {
    const Row on = measure_one(true), off = measure_one(false);
    std::printf("%10s %5d %16.1f %16.1f %9.3f %12.2f %14.2f\n", name, DP, on.step_ms, off.step_ms,
                off.step_ms / on.step_ms, on.held, on.peak);
  };
  line("no ZeRO", [&](bool ov) { return measure<DP, fived::NoZeRO>(o, ov); });
  line("ZeRO-1", [&](bool ov) { return measure<DP, fived::ZeRO<1>>(o, ov); });
  line("ZeRO-2", [&](bool ov) { return measure<DP, fived::ZeRO<2>>(o, ov); });
  line("ZeRO-3", [&](bool ov) { return measure<DP, fived::ZeRO<3>>(o, ov); });
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (a == "--ranks") o.ranks = v;
    else if (a == "--steps") o.steps = v;
    else if (a == "--accum") o.accum = v;
    else {
      std::fprintf(stderr, "usage: %s [--ranks 2|4] [--steps N] [--accum N]\n", argv[0]);
      return 2;
    }
  }
  if (o.steps < 1 || o.accum < 1 || (o.ranks != 2 && o.ranks != 4)) {
    std::fprintf(stderr, "bench/data_parallel: --ranks must be 2 or 4, --steps and --accum at least 1\n");
    return 2;
  }
  try {
    std::printf("# fived data-parallel step on the host backend (ranks as threads)\n");
    std::printf("# model: GPT %d layers, d_model %d, vocab %d: %zu parameters (fp32); global micro-batch %d x %d, "
                "accum %d\n",
                cfg::layers, cfg::d_model, cfg::vocab, Model<1>::layout::size, B, T, o.accum);
    std::printf("# machine: %u hardware threads; step = median of %d steps after 2 warm-up steps, rank 0\n",
                std::thread::hardware_concurrency(), o.steps);
    std::printf("# held = params + grads + optimizer bytes per parameter between steps; peak = whole units\n"
                "# held during a step (ZeRO-2/3), bytes per parameter\n#\n");
    std::printf("%10s %5s %16s %16s %9s %12s %14s\n", "policy", "ranks", "overlap(ms)", "after bwd(ms)", "speedup",
                "held(B/p)", "peak(B/p)");
    if (o.ranks == 2) table<2>(o);
    else table<4>(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench/data_parallel: %s\n", e.what());
    return 1;
  }
  return 0;
}
