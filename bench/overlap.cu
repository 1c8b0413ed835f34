// Data-parallel step time with the gradient reductions overlapped with backward, issued
// after it, and with no communication at all, on GPUs over NCCL:
//
//   scripts/launch-local.sh 2 build/bench/overlap [--batch 8] [--seq 1024] [--steps 10] [--warmup 3] [--zero 0|1|2|3]
//
// Each rank trains GPT-2 124M in bf16 (fp32 masters, AdamW, clip 1.0) with
// DataParallel<GPT<gpt2_124m, Mesh<DP<2>>, bf16, Cuda>, NoZeRO or ZeRO<1..3>> on B / 2 rows of a
// global batch of B. Rows of the table (median wall-clock ms of a step over --steps, after
// --warmup; every rank waits for the loss at the end of a step, so wall clock is step time):
//   no communication   rank 0 alone: the serial model on the same B / 2 rows (no collective)
//   DP 2, after        the reductions issued once backward has finished
//   DP 2, overlapped   each unit's reductions issued on the side stream as backward finishes it
//                      (ZeRO-3: and each unit's parameters gathered there before it runs)
// The difference between the last two is what overlap hides; against the first, what
// communication still costs. With --zero 2 or 3, a second table: what the model's buffers
// hold on the device during a step (the pages ZeRO gives back, device/cuda_pages.hpp)
// against DataParallel's count of it. Several ranks on ONE GPU share its SMs and talk over loopback
// sockets (NCCL_HOSTID per rank, see scripts/launch-local.sh): such numbers show whether the
// overlap works, not what a real DP 2 costs.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fived/comm/nccl.hpp>
#include <fived/comm/nccl_bootstrap.hpp>
#include <fived/mesh/context.hpp>
#include <fived/nn/cuda/ops.hpp>
#include <fived/nn/gpt.hpp>
#include <fived/train/data_parallel.hpp>

#include "cli.hpp"

namespace {

struct gpt2_124m : fived::gpt_config {};
using DpMesh = fived::Mesh<fived::DP<2>>;
using Model = fived::GPT<gpt2_124m, DpMesh, fived::bf16, fived::Cuda>;
using Serial = fived::GPT<gpt2_124m, fived::Mesh<>, fived::bf16, fived::Cuda>;

struct Options {
  int batch = 8, seq = 1024, steps = 10, warmup = 3, zero = 1;
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "%s\nusage: scripts/launch-local.sh 2 overlap [--batch B (8, even)] [--seq T (1024)] [--steps N (10)] "
               "[--warmup W (3)] [--zero 0|1|2|3 (1)]\n",
               msg.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  bench::parse_options(argc, argv, usage, [&](std::string_view a, auto value) {
    if (a == "--batch") o.batch = std::stoi(value());
    else if (a == "--seq") o.seq = std::stoi(value());
    else if (a == "--steps") o.steps = std::stoi(value());
    else if (a == "--warmup") o.warmup = std::stoi(value());
    else if (a == "--zero") o.zero = std::stoi(value());
    else return false;
    return true;
  });
  if (o.batch < 2 || o.batch % 2 != 0 || o.seq < 1 || o.seq > gpt2_124m::max_seq || o.steps < 1 || o.warmup < 0 ||
      o.zero < 0 || o.zero > 3)
    usage("need an even --batch >= 2, 1 <= --seq <= 1024, --steps >= 1, --warmup >= 0, --zero 0, 1, 2 or 3");
  return o;
}

const fived::AdamWConfig hp{.lr = 6e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f,
                            .max_norm = 1.0f};

// Median wall-clock milliseconds of `step` over opt.steps calls, after opt.warmup.
template <class Step>
double median_ms(const Options& opt, Step step) {
  for (int i = 0; i < opt.warmup; ++i) step();
  std::vector<double> ms;
  for (int i = 0; i < opt.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// What the model's flat buffers hold on the device in one step (ZeRO-2/3), this rank:
// DataParallel's count (the planner's formula: plan/memory.hpp; equal on the host, tests/
// test_data_parallel.cpp) against the chunks device/cuda_pages.hpp mapped at most at once.
struct PagesRow {
  std::size_t counted = 0, mapped_peak = 0, at_rest = 0, held = 0, chunk = 0;
};

template <class Policy>
void dp_rows(const Options& opt, fived::MeshContext<DpMesh, fived::nccl::Comm>& ctx, const std::vector<int>& tok,
             const std::vector<int>& tgt, double& after, double& overlapped, PagesRow& pages) {
  Model model(ctx, fived::GptInit{1337, 0.02});
  fived::DataParallel<Model, Policy> dp(model, ctx, hp);
  dp.set_overlap(false);
  after = median_ms(opt, [&] { dp.step(tok, tgt, opt.batch, opt.seq); });
  dp.set_overlap(true);
  overlapped = median_ms(opt, [&] { dp.step(tok, tgt, opt.batch, opt.seq); });
  if constexpr (Policy::stage >= 2) {
    // The steps after backward held every unit's gradients until its end, and the pool kept
    // their chunks: given back first, so that the pool grows again to what an overlapped
    // step holds at once.
    fived::cuda::trim_pages();
    fived::cuda::reset_page_peak();
    for (int i = 0; i < 2; ++i) dp.step(tok, tgt, opt.batch, opt.seq);
    FIVED_CUDA_CHECK(cudaDeviceSynchronize());
    const auto m = dp.memory();
    const auto st = fived::cuda::page_stats();
    // ZeRO-2 keeps every parameter in the model's buffer; both keep the units a step holds.
    pages.counted = (Policy::stage == 2 ? m.params : 0) + m.transient_peak;
    pages.mapped_peak = st.peak_mapped;
    fived::cuda::settle_pages();
    pages.at_rest = fived::cuda::page_stats().mapped;
    pages.held = st.held;
    pages.chunk = st.chunk;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (fived::cuda::device_count() == 0) {
    std::fprintf(stderr, "overlap: no CUDA device\n");
    return 1;
  }
  try {
    auto ctx = fived::make_mesh_context<DpMesh>(fived::nccl::init_world());
    const bool printer = ctx.rank() == 0;
    std::vector<int> tok(static_cast<std::size_t>(opt.batch) * opt.seq), tgt(tok.size());
    for (std::size_t i = 0; i < tok.size(); ++i) {
      tok[i] = static_cast<int>((i * 2654435761u) % Model::V);
      tgt[i] = static_cast<int>((i * 40503u + 7) % Model::V);
    }

    double alone = 0;
    if (printer) {  // the same per-rank work with no collective
      Serial serial(fived::GptInit{1337, 0.02});
      fived::DataParallel<Serial> one(serial, hp);
      const std::size_t half = tok.size() / 2;
      const std::vector<int> t0(tok.begin(), tok.begin() + static_cast<std::ptrdiff_t>(half)),
          g0(tgt.begin(), tgt.begin() + static_cast<std::ptrdiff_t>(half));
      alone = median_ms(opt, [&] { one.step(t0, g0, opt.batch / 2, opt.seq); });
    }
    ctx.world().barrier();

    double after = 0, overlapped = 0;
    PagesRow pages;
    switch (opt.zero) {
      case 0: dp_rows<fived::NoZeRO>(opt, ctx, tok, tgt, after, overlapped, pages); break;
      case 1: dp_rows<fived::ZeRO<1>>(opt, ctx, tok, tgt, after, overlapped, pages); break;
      case 2: dp_rows<fived::ZeRO<2>>(opt, ctx, tok, tgt, after, overlapped, pages); break;
      default: dp_rows<fived::ZeRO<3>>(opt, ctx, tok, tgt, after, overlapped, pages); break;
    }

    if (printer) {
      cudaDeviceProp prop{};
      int dev = 0;
      FIVED_CUDA_CHECK(cudaGetDevice(&dev));
      FIVED_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
      std::printf("device: %s  fived bench/overlap  GPT-2 124M bf16, global batch %d x %d, %s, %d ranks\n", prop.name,
                  opt.batch, opt.seq, opt.zero ? ("ZeRO-" + std::to_string(opt.zero)).c_str() : "no ZeRO", DpMesh::size);
      std::printf("%-22s %10s %12s\n", "step", "ms/step", "tokens/s");
      auto row = [&](const char* name, double ms, double tokens) {
        std::printf("%-22s %10.1f %12.0f\n", name, ms, tokens / (ms * 1e-3));
      };
      const double global = static_cast<double>(opt.batch) * opt.seq;
      row("no communication", alone, global / 2);
      row("DP 2, after backward", after, global);
      row("DP 2, overlapped", overlapped, global);
      if (opt.zero >= 2) {  // rank 0's model buffers; the serial model of the first row is gone
        const double mb = 1 << 20;
        std::printf("\nmodel buffers on the device, rank 0 (chunks of %.0f MiB, device/cuda_pages.hpp)\n", pages.chunk / mb);
        std::printf("%-44s %10.1f MiB\n", "counted (DataParallel::memory, the planner's)", pages.counted / mb);
        std::printf("%-44s %10.1f MiB  (%+.1f%%)\n", "mapped at most at once in 2 steps", pages.mapped_peak / mb,
                    100.0 * (static_cast<double>(pages.mapped_peak) / static_cast<double>(pages.counted) - 1.0));
        std::printf("%-44s %10.1f MiB\n", "mapped between steps", pages.at_rest / mb);
        std::printf("%-44s %10.1f MiB  (%+.1f%%)\n", "held from the driver (mapped or pooled)", pages.held / mb,
                    100.0 * (static_cast<double>(pages.held) / static_cast<double>(pages.counted) - 1.0));
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "overlap: %s\n", e.what());
    return 1;
  }
}
