// Saving a checkpoint, synchronously and in the background, on the host backend: the 16-rank
// mesh of examples/train_gpt (Mesh<DP<2>, PP<2>, CP<2>, TP<2>>, ZeRO-1, 1F1B), a GPT of about
// 10M parameters (with AdamW's state, ~124 MB a save).
//
//   bench/checkpoint [--saves 5] [--dir /tmp/fived_bench_checkpoint]
//
// sync_ms: a save() from its call until every rank has it committed (files written and
// fsynced, hashes gathered, manifest written). async_stall_ms: what save_async() holds a rank
// up (the state copied out; the writing happens behind the following steps). Medians over
// --saves saves, each after a training step, as rank 0 sees them. The last line is the one
// the issue asks for: `checkpoint sync_ms=<x> async_stall_ms=<y>`.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/train/trainer.hpp"

namespace {

using namespace fived;

struct cfg : gpt_config {
  static constexpr int layers = 4, d_model = 384, heads = 6, vocab = 4096, max_seq = 64, vocab_multiple = 64;
  static constexpr bool tied = false;
};
using M = Mesh<DP<2>, PP<2>, CP<2>, TP<2>>;
using Sched = pipeline::OneFOneB<2, 4>;
using Model = GPT<cfg, M, float, Host, SequenceParallel>;
constexpr int B = 4, T = 32;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int saves = 5;
  std::filesystem::path dir = std::filesystem::temp_directory_path() / "fived_bench_checkpoint";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--saves") == 0 && i + 1 < argc) saves = std::max(1, std::atoi(argv[++i]));
    else if (std::strcmp(argv[i], "--dir") == 0 && i + 1 < argc) dir = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--saves N] [--dir DIR]\n", argv[0]);
      return 2;
    }
  }
  std::vector<double> sync_ms, stall_ms, step_ms, step_behind_ms;
  std::size_t bytes = 0;
  for (const bool async : {false, true}) {
    std::filesystem::remove_all(dir);
    host::run(M::size, [&](host::Comm& world) {
      auto ctx = make_mesh_context<M>(world);
      Trainer<Model, ZeRO<1>, Sched> t(ctx, {.adamw = {.lr = 1e-3}, .lr = ConstantLr{1e-3}}, GptInit{1});
      std::vector<int> tok(static_cast<std::size_t>(Sched::table.micro_batches) * B * T), tgt(tok.size());
      for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int>(i * 7 % cfg::vocab), tgt[i] = static_cast<int>(i * 11 % cfg::vocab);
      using clock = std::chrono::steady_clock;
      auto ms = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
      for (int s = 1; s <= saves + 1; ++s) {
        world.barrier();
        const auto t0 = clock::now();
        t.step(s, tok, tgt, B, T);
        const auto t1 = clock::now();
        if (s == 1) continue;  // warm-up
        if (async) t.save_async(dir, s);
        else t.save(dir, s);
        const auto t2 = clock::now();
        if (ctx.rank() != 0) continue;
        (async ? step_behind_ms : step_ms).push_back(ms(t0, t1));
        (async ? stall_ms : sync_ms).push_back(ms(t1, t2));
      }
      t.wait_for_save();
      if (ctx.rank() == 0) {
        bytes = 0;
        for (const auto& e : std::filesystem::directory_iterator(checkpoint::step_folder(dir, saves + 1)))
          bytes += e.file_size();
      }
    });
  }
  std::filesystem::remove_all(dir);
  std::printf("fived bench/checkpoint: %s, %d ranks as threads, GPT %d layers d_model %d vocab %d, ZeRO-1, one save "
              "%.1f MB over %d files; medians of %d saves as rank 0 sees them\n",
              M::name().c_str(), M::size, cfg::layers, cfg::d_model, cfg::vocab, static_cast<double>(bytes) / 1e6, M::size,
              saves);
  std::printf("%-28s %10s\n", "", "ms");
  std::printf("%-28s %10.1f\n", "training step (no save)", median(step_ms));
  std::printf("%-28s %10.1f\n", "save()", median(sync_ms));
  std::printf("%-28s %10.1f\n", "save_async() stall", median(stall_ms));
  std::printf("%-28s %10.1f\n", "step behind a background save", median(step_behind_ms));
  std::printf("checkpoint sync_ms=%.1f async_stall_ms=%.1f\n", median(sync_ms), median(stall_ms));
  return 0;
}
