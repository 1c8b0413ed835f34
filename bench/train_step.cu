// One GPT-2 124M training step on one GPU: forward, backward, gradient clipping (global
// norm 1) and AdamW (fp32 master weights), bf16 parameters and activations: the library's
// one training step, DataParallel<GPT<..., Mesh<>, bf16, Cuda>> (no collective at DP 1). The
// counterpart of bench/train_step_pytorch.py (same shape, same steps):
//
//   bench/train_step [--batch 8] [--seq 1024] [--steps 20] [--warmup 5] [--peak-tflops 989.4]
//                    [--ids uniform|text]   (text: ids drawn as in text, a few of them frequent)
//                    [--graph]   (from the third step, each step replays the second as a CUDA graph)
//
// Every step runs on the model's stream; its time is measured with CUDA events around the
// step (so host launch gaps count, as in PyTorch's synchronised wall clock), and the median
// over --steps timed steps (after --warmup) is reported with tokens/s and MFU. The step
// waits for the device once, with the whole step queued, where the host reads the loss (the
// gradient norm and the clip factor stay on the device, as PyTorch's clip_grad_norm_ keeps them).
//
//   FLOPs per token = 6 * P + 12 * L * C * T
//     P = parameters in the buffer (124,475,904: wte with the vocabulary padded to 50304,
//         tied head, as PyTorch counts a model built with vocab 50304)
//     12 * L * C * T = attention scores and values (2 GEMMs of 2*C*T FLOPs per token and
//         layer, forward + backward = 3x), causal mask NOT discounted (nanoGPT / PaLM)
//   MFU = FLOPs per token * tokens/s / peak   (--peak-tflops, default H100 SXM bf16 dense)
//
// The same batch is used at every step (as the PyTorch script does). Without a GPU it
// prints "no CUDA device" and exits 1.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fived/nn/cuda/ops.hpp>
#include <fived/nn/gpt.hpp>
#include <fived/train/data_parallel.hpp>

#include "cli.hpp"
#include "text_ids.hpp"

namespace {

struct gpt2_124m : fived::gpt_config {};  // 12 layers, d_model 768, 12 heads, vocab 50257 (50304 padded), T <= 1024
using Model = fived::GPT<gpt2_124m, fived::Mesh<>, fived::bf16, fived::Cuda>;

struct Options {
  int batch = 8, seq = 1024, steps = 20, warmup = 5;
  double peak_tflops = 989.4;  // H100 SXM5, bf16 dense
  bool text_ids = false;       // --ids text: ids drawn as in text (Zipf), not uniformly
  bool graph = false;          // --graph: DataParallel::set_step_graph (nn/step_graph.hpp)
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "%s\nusage: train_step [--batch B (8)] [--seq T (1024, <= 1024)] [--steps N (20)] [--warmup W (5)] "
               "[--peak-tflops P (989.4: H100 SXM bf16 dense)] [--ids uniform|text (uniform)] [--graph]\n",
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
    else if (a == "--peak-tflops") o.peak_tflops = std::stod(value());
    else if (a == "--ids") {
      const std::string v(value());
      if (v != "uniform" && v != "text") usage("--ids takes uniform or text");
      o.text_ids = v == "text";
    }
    else if (a == "--graph") o.graph = true;
    else if (a == "-h" || a == "--help") usage("One GPT-2 124M training step (bf16, AdamW) on one GPU.");
    else return false;
    return true;
  });
  if (o.batch < 1 || o.seq < 1 || o.seq > gpt2_124m::max_seq || o.steps < 1 || o.warmup < 0 || !(o.peak_tflops > 0))
    usage("need --batch >= 1, 1 <= --seq <= 1024, --steps >= 1, --warmup >= 0, --peak-tflops > 0");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (fived::cuda::device_count() == 0) {
    std::fprintf(stderr, "train_step: no CUDA device\n");
    return 1;
  }
  try {
    int dev = 0;
    FIVED_CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    FIVED_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));

    const int B = opt.batch, T = opt.seq;
    Model model(fived::GptInit{1337, 0.02});
    auto& ops = model.ops();
    const std::size_t n = Model::num_params;

    fived::DataParallel<Model> trainer(
        model, fived::AdamWConfig{.lr = 6e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f,
                                  .max_norm = 1.0f});
    trainer.set_step_graph(opt.graph);

    // A fixed random batch of real token ids (LCG). Their values matter for speed only through
    // how often each repeats: uniform, or as text repeats them with --ids text (text_ids.hpp).
    std::vector<int> tok(static_cast<std::size_t>(B) * T), tgt(tok.size());
    unsigned long long s = 0x2545f4914f6cdd1dull;
    auto draw = [&] {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      if (!opt.text_ids) return static_cast<int>((s >> 33) % Model::V);
      const double u = static_cast<double>(s >> 11) / 9007199254740992.0;  // [0, 1)
      return bench::text_like_id(u, Model::V);
    };
    for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = draw(), tgt[i] = draw();

    double loss = 0;
    auto step = [&] { loss = trainer.step(tok, tgt, B, T); };  // forward, backward, clip, AdamW

    for (int i = 0; i < opt.warmup; ++i) step();
    ops.synchronize();
    fived::cuda::Event start, stop;
    std::vector<double> ms;
    for (int i = 0; i < opt.steps; ++i) {
      start.record(ops.stream());
      step();
      stop.record(ops.stream());
      ms.push_back(static_cast<double>(fived::cuda::Event::elapsed_ms(start, stop)));
    }
    std::sort(ms.begin(), ms.end());
    const std::size_t k = ms.size();
    const double median_ms = k % 2 ? ms[k / 2] : 0.5 * (ms[k / 2 - 1] + ms[k / 2]);

    const double tokens = static_cast<double>(B) * T;
    const double tok_s = tokens / (median_ms * 1e-3);
    const double flops_per_token = 6.0 * static_cast<double>(n) + 12.0 * Model::L * Model::C * static_cast<double>(T);
    const double tflops = flops_per_token * tok_s / 1e12;
    const double mfu = 100.0 * tflops / opt.peak_tflops;

    std::printf("device: %s (sm_%d%d)  fived bench/train_step%s%s\n", prop.name, prop.major, prop.minor,
                opt.text_ids ? "  text-like ids (Zipf)" : "", opt.graph ? "  step graph (CUDA graph replay)" : "");
    std::printf("GPT-2 124M (%.1fM params in the buffer), B=%d T=%d, bf16 params/activations, fp32 master + AdamW, "
                "clip 1.0\n",
                static_cast<double>(n) / 1e6, B, T);
    std::printf("FLOPs/token = 6*P + 12*L*C*T = %.4g; peak %.1f TFLOP/s\n", flops_per_token, opt.peak_tflops);
    std::printf("median step %.1f ms over %d steps (min %.1f, max %.1f), loss %.3f\n", median_ms, opt.steps, ms.front(),
                ms.back(), loss);
    std::printf("%-28s %-8s %3s %5s %10s %12s %9s %7s\n", "device", "impl", "B", "T", "ms/step", "tokens/s", "TFLOP/s",
                "MFU%");
    std::printf("%-28.28s %-8s %3d %5d %10.1f %12.0f %9.1f %7.1f\n", prop.name, "fived", B, T, median_ms, tok_s, tflops,
                mfu);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_step: %s\n", e.what());
    return 1;
  }
}
