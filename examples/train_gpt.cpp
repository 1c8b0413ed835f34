// Train a small byte-level GPT on the host (or on a GPU, see below).
//
//   train_gpt [text-file] [--steps N] [--batch B] [--seq T] [--lr LR] [--seed S] [--save out.safetensors]
//             [--host] [--peak-tflops P]
//
// With a text file, trains on its bytes (vocab 256). Without one, on a corpus the program
// generates: lines of additions ("17+5=22"), whose loss drops visibly within a
// minute or two on two CPU cores. Prints step, loss and tokens/s; MFU is reported on CUDA only.
// Ends with a sample of generated text (and, on the generated corpus, a few sums completed
// greedily).
//
// Built as C++ (train_gpt) it runs on the host backend: reference kernels in plain C++. Built
// by nvcc with fived::cuda (train_gpt_cuda: examples/train_gpt_cuda.cu includes this file,
// FIVED_WITH_CUDA and __CUDACC__ are defined) it runs the same model and loop on the GPU
// (fp32) when one is present, and on the host otherwise or with --host. MFU there is
// (6 * params + 12 * L * C * T) * tokens/s / --peak-tflops (default 989.4, H100 SXM bf16
// dense: a ceiling this fp32 demo cannot reach).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <numbers>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#if defined(FIVED_WITH_CUDA) && defined(__CUDACC__)
#define FIVED_TRAIN_GPT_CUDA 1
#include "fived/nn/cuda/ops.hpp"  // before gpt.hpp: Ops<T, Cuda>
#endif
#include "fived/nn/gpt.hpp"
#include "fived/optim/adamw.hpp"

namespace {

// 4 layers, d_model 128, 4 heads, byte vocabulary: 0.84M parameters.
struct demo_config : fived::gpt_config {
  static constexpr int layers = 4, d_model = 128, heads = 4, vocab = 256, max_seq = 128;
  static constexpr int vocab_multiple = 64;
};
template <class Device>
using ModelOn = fived::GPT<demo_config, float, Device>;
using Layout = ModelOn<fived::Host>::layout;

struct Options {
  std::string file, save;
  int steps = 300, batch = 8, seq = 64;
  float lr = 2e-3f;
  unsigned seed = 1337;
  bool host = false;           // stay on the host even when a GPU is there (CUDA build)
  double peak_tflops = 989.4;  // for MFU on CUDA
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "%s\nusage: train_gpt [text-file] [--steps N] [--batch B] [--seq T (<= %d)] [--lr LR] [--seed S] "
               "[--save out.safetensors] [--host] [--peak-tflops P]\n",
               msg, demo_config::max_seq);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + std::string(a)).c_str());
      return argv[++i];
    };
    try {
      if (a == "--steps") o.steps = std::stoi(value());
      else if (a == "--batch") o.batch = std::stoi(value());
      else if (a == "--seq") o.seq = std::stoi(value());
      else if (a == "--lr") o.lr = std::stof(value());
      else if (a == "--seed") o.seed = static_cast<unsigned>(std::stoul(value()));
      else if (a == "--save") o.save = value();
      else if (a == "--host") o.host = true;
      else if (a == "--peak-tflops") o.peak_tflops = std::stod(value());
      else if (a == "-h" || a == "--help") usage("Trains a byte-level GPT on the host.");
      else if (!a.empty() && a[0] == '-') usage(("unknown option " + std::string(a)).c_str());
      else if (o.file.empty()) o.file = a;
      else usage("more than one text file given");
    } catch (const std::logic_error&) {
      usage(("bad number after " + std::string(a)).c_str());
    }
  }
  if (o.steps < 1 || o.batch < 1 || o.seq < 2 || o.seq > demo_config::max_seq || !(o.lr > 0))
    usage("need --steps >= 1, --batch >= 1, 2 <= --seq <= 128, --lr > 0");
  return o;
}

// "a+b=c\n" lines with a, b in [0, max_operand].
constexpr int max_operand = 19;
std::string arithmetic_corpus(std::size_t bytes, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, max_operand);
  std::string s;
  while (s.size() < bytes) {
    const int a = d(rng), b = d(rng);
    s += std::to_string(a) + "+" + std::to_string(b) + "=" + std::to_string(a + b) + "\n";
  }
  return s;
}

// Next byte from the model given a context (cropped to max_seq): greedy when temperature is 0.
template <class Model>
int next_token(Model& model, const std::vector<int>& ctx, float temperature, std::mt19937& rng) {
  const int T = static_cast<int>(std::min<std::size_t>(ctx.size(), demo_config::max_seq));
  model.forward(ctx.data() + ctx.size() - static_cast<std::size_t>(T), nullptr, 1, T);
  std::vector<float> last;  // the last position's logits, in host memory
  if constexpr (Model::on_host) {
    const auto l = model.logits().subspan(static_cast<std::size_t>(T - 1) * Model::Vp, Model::V);
    last.assign(l.begin(), l.end());
  } else {
    const std::vector<float> all = model.logits_to_host();
    last.assign(all.begin() + static_cast<std::ptrdiff_t>(T - 1) * Model::Vp,
                all.begin() + static_cast<std::ptrdiff_t>(T - 1) * Model::Vp + Model::V);
  }
  const std::span<const float> logits(last);
  if (temperature <= 0) return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const float mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  for (std::size_t v = 0; v < p.size(); ++v) p[v] = std::exp((logits[v] - mx) / temperature);
  std::discrete_distribution<int> pick(p.begin(), p.end());
  return pick(rng);
}

std::string printable(const std::string& s) {
  std::string o;
  for (unsigned char c : s) o += (c == '\n' || c == '\t' || (c >= 0x20 && c < 0x7f)) ? static_cast<char>(c) : '?';
  return o;
}

template <class Device>
int train(const Options& opt, const std::vector<int>& data, std::size_t split, const std::string& backend) {
  using Model = ModelOn<Device>;
  Model model(fived::GptInit{opt.seed, 0.02});
  std::printf("train_gpt: %s, %zu bytes (%zu train, %zu held out)\n",
              opt.file.empty() ? "generated corpus of additions" : opt.file.c_str(), data.size(), split,
              data.size() - split);
  std::printf("model: %s; %zu parameters (%zu in the buffer, vocab padded to %d)\n", Model::describe().c_str(),
              Layout::num_parameters, Layout::size, Model::Vp);
  std::printf("training: %d steps, batch %d x seq %d, AdamW lr %g (warmup, cosine), %s\n", opt.steps, opt.batch,
              opt.seq, static_cast<double>(opt.lr), backend.c_str());

  const int B = opt.batch, T = opt.seq;
  std::mt19937 rng(opt.seed);
  std::vector<int> tok(static_cast<std::size_t>(B * T)), tgt(tok.size());
  auto fill = [&](std::size_t begin, std::size_t end) {
    std::uniform_int_distribution<std::size_t> start(begin, end - static_cast<std::size_t>(T) - 1);
    for (int b = 0; b < B; ++b) {
      const std::size_t s = start(rng);
      for (int t = 0; t < T; ++t) {
        tok[static_cast<std::size_t>(b * T + t)] = data[s + static_cast<std::size_t>(t)];
        tgt[static_cast<std::size_t>(b * T + t)] = data[s + static_cast<std::size_t>(t) + 1];
      }
    }
  };
  auto eval = [&](int batches) {
    std::mt19937 keep = rng;
    rng.seed(opt.seed + 1);  // the same held-out windows every time
    double sum = 0;
    for (int i = 0; i < batches; ++i) {
      fill(split, data.size());
      sum += model.forward(tok.data(), tgt.data(), B, T);
    }
    rng = keep;
    return sum / batches;
  };

  auto& ops = model.ops();
  // AdamW with global-norm clipping at 1, weight decay 0.1 on matrices only (fived::AdamW on
  // the host; on CUDA the same update as a per-tensor loop, below, until AdamW runs there).
  const fived::AdamWConfig adamw{.lr = opt.lr, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f,
                                 .max_norm = 1.0f};
  fived::AdamWFor<ModelOn<fived::Host>> optimizer(adamw, {0, Model::on_host ? Layout::size : 0});
  auto m = ops.template make_buffer<float>(Model::on_host ? 0 : Model::num_params),
       v = ops.template make_buffer<float>(Model::on_host ? 0 : Model::num_params);
  // MFU (CUDA): FLOPs per token = 6 * params + 12 * L * C * T (attention, causal mask not discounted)
  const double flops_per_token = 6.0 * static_cast<double>(Layout::size) + 12.0 * Model::L * Model::C * opt.seq;
  const int warmup = std::max(1, opt.steps / 20);
  const int every = std::max(1, opt.steps / 20);
  if constexpr (Model::on_host)
    std::printf("%6s %9s %9s %12s %9s\n", "step", "loss", "val", "tokens/s", "ms/step");
  else
    std::printf("%6s %9s %9s %12s %9s %8s\n", "step", "loss", "val", "tokens/s", "ms/step", "MFU%");
  const double val_start = eval(4);
  double val_end = val_start;
  std::printf("%6d %9s %9.4f %12s %9s\n", 0, "-", val_start, "-", "-");
  double tokens = 0, seconds = 0, loss_acc = 0;
  int loss_n = 0;
  const auto t_start = std::chrono::steady_clock::now();
  for (int step = 1; step <= opt.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    fill(0, split);
    model.zero_grad();
    const float loss = model.forward(tok.data(), tgt.data(), B, T);
    model.backward();
    const double progress = static_cast<double>(step - warmup) / std::max(1, opt.steps - warmup);
    const float lr = step <= warmup ? opt.lr * static_cast<float>(step) / static_cast<float>(warmup)
                                    : opt.lr * static_cast<float>(0.1 + 0.45 * (1 + std::cos(std::numbers::pi * progress)));
    if constexpr (Model::on_host) {
      optimizer.hp.lr = lr;
      optimizer.step(model);  // clip the global gradient norm, then AdamW
    } else {
      ops.clip_grad_norm(model.grads().data(), model.grads().size(), adamw.max_norm);
      for (const fived::ParamInfo& t : Layout::tensors)
        ops.adamw_update(model.params().data() + t.offset, static_cast<float*>(nullptr),
                         model.grads().data() + t.offset, m.data() + t.offset, v.data() + t.offset, t.size(), lr,
                         adamw.beta1, adamw.beta2, adamw.eps, decltype(optimizer)::decays(t) ? adamw.weight_decay : 0.0f,
                         step);
    }
    ops.synchronize();  // CUDA: the step is done (a no-op on the host)
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tokens += B * T;
    seconds += dt;
    loss_acc += loss;
    ++loss_n;
    if (step % every == 0 || step == opt.steps) {
      const bool val = step % (every * 5) == 0 || step == opt.steps;
      char vbuf[16] = "-";
      if (val) std::snprintf(vbuf, sizeof vbuf, "%.4f", val_end = eval(4));
      if constexpr (Model::on_host)
        std::printf("%6d %9.4f %9s %12.0f %9.1f\n", step, loss_acc / loss_n, vbuf, tokens / seconds,
                    1e3 * seconds / loss_n);
      else
        std::printf("%6d %9.4f %9s %12.0f %9.1f %8.3f\n", step, loss_acc / loss_n, vbuf, tokens / seconds,
                    1e3 * seconds / loss_n, 100.0 * flops_per_token * tokens / seconds / (opt.peak_tflops * 1e12));
      std::fflush(stdout);
      tokens = seconds = loss_acc = 0;
      loss_n = 0;
    }
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::printf("trained %d steps in %.1f s\n", opt.steps, total);

  if (!opt.save.empty()) {
    model.save(opt.save, {{"steps", std::to_string(opt.steps)}});
    std::printf("saved %s (Hugging Face GPT-2 names)\n", opt.save.c_str());
  }

  std::mt19937 srng(opt.seed + 2);
  std::vector<int> ctx(data.begin() + static_cast<std::ptrdiff_t>(split),
                       data.begin() + static_cast<std::ptrdiff_t>(split) + 16);
  std::string prompt(ctx.begin(), ctx.end()), out;
  for (int i = 0; i < 200; ++i) {
    const int next = next_token(model, ctx, 0.8f, srng);
    ctx.push_back(next);
    out += static_cast<char>(next);
  }
  std::printf("\nsample (temperature 0.8) after the held-out prompt \"%s\":\n%s%s\n",
              printable(prompt).c_str(), printable(prompt).c_str(), printable(out).c_str());

  if (opt.file.empty()) {  // greedy completions of unseen sums
    std::mt19937 qrng(opt.seed + 3);
    std::uniform_int_distribution<int> d(0, max_operand);
    int right = 0;
    const int n = 10;
    std::printf("\ngreedy completions:");
    for (int q = 0; q < n; ++q) {
      const int a = d(qrng), b = d(qrng);
      const std::string p = "\n" + std::to_string(a) + "+" + std::to_string(b) + "=";
      std::vector<int> c(p.begin(), p.end());
      std::string ans;
      for (int i = 0; i < 4; ++i) {
        const int next = next_token(model, c, 0.0f, srng);
        if (next == '\n') break;
        c.push_back(next);
        ans += static_cast<char>(next);
      }
      right += ans == std::to_string(a + b);
      std::printf(" %d+%d=%s", a, b, printable(ans).c_str());
    }
    std::printf("\n%d of %d correct\n", right, n);
  }
  // The demo's promise: training lowers the held-out loss. Say so in the exit status.
  if (!(val_end < val_start)) {
    std::printf("held-out loss did not fall (%.4f -> %.4f)\n", val_start, val_end);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);

  std::string text;
  if (!opt.file.empty()) {
    std::ifstream in(opt.file, std::ios::binary);
    if (!in) usage(("cannot read " + opt.file).c_str());
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } else {
    text = arithmetic_corpus(1 << 20, opt.seed);
  }
  if (text.size() < static_cast<std::size_t>(opt.seq) * 20)
    usage(("the text has " + std::to_string(text.size()) + " bytes; it needs at least 20 * seq").c_str());
  std::vector<int> data(text.begin(), text.end());
  for (int& t : data) t &= 0xff;
  const std::size_t split = data.size() * 9 / 10;  // last 10% held out

#if defined(FIVED_TRAIN_GPT_CUDA)
  if (!opt.host && fived::cuda::device_count() > 0) {
    cudaDeviceProp prop{};
    FIVED_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    return train<fived::Cuda>(opt, data, split,
                              std::string("CUDA backend (") + prop.name + ", fp32; MFU of " +
                                  std::to_string(opt.peak_tflops) + " TFLOP/s)");
  }
  const std::string backend = opt.host ? "host backend (--host)" : "host backend (no CUDA device)";
#else
  const std::string backend = "host backend (MFU is reported on CUDA only)";
#endif
  return train<fived::Host>(opt, data, split, backend);
}
