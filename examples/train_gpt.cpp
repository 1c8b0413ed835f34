// Train a small byte-level GPT on a mesh on the host (or on a GPU, see below).
//
//   train_gpt [text-file] [--steps N] [--batch B] [--seq T] [--lr LR] [--seed S] [--save out.safetensors]
//             [--serial] [--host] [--peak-tflops P]
//
// On the host it trains on Mesh<DP<2>, TP<2>>: four ranks as threads of the host backend,
// the one model (fived::GPT) split over TP with sequence parallelism, data-parallel over DP
// with ZeRO-1 (DataParallel). --serial trains the same model on one rank instead (the runs start
// from the same weights and see the same tokens). The trained model is gathered into the
// serial GPT for sampling and --save (the same safetensors file either way).
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
// (fp32) when one is present, and on the host otherwise or with --host. Started as one
// process it trains one rank on the GPU; launched as the mesh's 4 processes it trains the
// mesh over NCCL (on one GPU: scripts/launch-local.sh 4 build/examples/train_gpt_cuda).
// MFU there is (6 * params + 12 * L * C * T) * tokens/s per GPU / --peak-tflops (default
// 989.4, H100 SXM bf16 dense: a ceiling this fp32 demo cannot reach).

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
#include <type_traits>
#include <vector>

#if defined(FIVED_WITH_CUDA) && defined(__CUDACC__)
#define FIVED_TRAIN_GPT_CUDA 1
#include "fived/comm/nccl_bootstrap.hpp"
#include "fived/nn/cuda/ops.hpp"  // before gpt.hpp: Ops<T, Cuda>
#endif
#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/train/data_parallel.hpp"

namespace {

// 4 layers, d_model 128, 4 heads, byte vocabulary: 0.84M parameters.
struct demo_config : fived::gpt_config {
  static constexpr int layers = 4, d_model = 128, heads = 4, vocab = 256, max_seq = 128;
  static constexpr int vocab_multiple = 64;
};
template <class Device>
using ModelOn = fived::GPT<demo_config, fived::Mesh<>, float, Device>;
using Layout = ModelOn<fived::Host>::layout;
// The host run's mesh: 2-way data parallel x 2-way tensor parallel, TP fastest.
using DemoMesh = fived::Mesh<fived::DP<2>, fived::TP<2>>;
constexpr int demo_dp = DemoMesh::extent(fived::Axis::dp), demo_tp = DemoMesh::extent(fived::Axis::tp);

struct Options {
  std::string file, save;
  int steps = 300, batch = 8, seq = 64;
  float lr = 2e-3f;
  unsigned seed = 1337;
  bool host = false;           // stay on the host even when a GPU is there (CUDA build)
  bool serial = false;         // one rank instead of the mesh (host)
  double peak_tflops = 989.4;  // for MFU on CUDA
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "%s\nusage: train_gpt [text-file] [--steps N] [--batch B] [--seq T (<= %d)] [--lr LR] [--seed S] "
               "[--save out.safetensors] [--serial] [--host] [--peak-tflops P]\n",
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
      else if (a == "--serial") o.serial = true;
      else if (a == "--peak-tflops") o.peak_tflops = std::stod(value());
      else if (a == "-h" || a == "--help") usage("Trains a byte-level GPT on a mesh on the host.");
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

// B windows of T + 1 bytes from data[begin, end): tokens and next-byte targets.
void fill_batch(const std::vector<int>& data, std::size_t begin, std::size_t end, int B, int T, std::mt19937& rng,
                std::vector<int>& tok, std::vector<int>& tgt) {
  tok.resize(static_cast<std::size_t>(B) * static_cast<std::size_t>(T));
  tgt.resize(tok.size());
  std::uniform_int_distribution<std::size_t> start(begin, end - static_cast<std::size_t>(T) - 1);
  for (int b = 0; b < B; ++b) {
    const std::size_t s = start(rng);
    for (int t = 0; t < T; ++t) {
      tok[static_cast<std::size_t>(b * T + t)] = data[s + static_cast<std::size_t>(t)];
      tgt[static_cast<std::size_t>(b * T + t)] = data[s + static_cast<std::size_t>(t) + 1];
    }
  }
}

// The mean loss over 4 fixed held-out batches; loss_of(tok, tgt) runs one forward.
template <class LossOf>
double held_out_loss(const Options& opt, const std::vector<int>& data, std::size_t split, LossOf loss_of) {
  std::mt19937 rng(opt.seed + 1);  // the same held-out windows every time
  std::vector<int> tok, tgt;
  double sum = 0;
  for (int i = 0; i < 4; ++i) {
    fill_batch(data, split, data.size(), opt.batch, opt.seq, rng, tok, tgt);
    sum += loss_of(tok, tgt);
  }
  return sum / 4;
}

// Linear warmup over the first 5% of the steps, then cosine down to 10% of --lr.
float lr_at(const Options& opt, int step) {
  const int warmup = std::max(1, opt.steps / 20);
  if (step <= warmup) return opt.lr * static_cast<float>(step) / static_cast<float>(warmup);
  const double progress = static_cast<double>(step - warmup) / std::max(1, opt.steps - warmup);
  return opt.lr * static_cast<float>(0.1 + 0.45 * (1 + std::cos(std::numbers::pi * progress)));
}

// AdamW with global-norm clipping at 1, weight decay 0.1 on matrices only.
fived::AdamWConfig adamw_config(const Options& opt) {
  return {.lr = opt.lr, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .max_norm = 1.0f};
}

// The progress table: a row every steps/20 steps (mean loss, tokens/s, ms/step and, on
// CUDA, MFU), with the held-out loss every fifth row and at the end.
class Progress {
 public:
  Progress(const Options& opt, double mfu_flops_per_token) : opt_(opt), flops_(mfu_flops_per_token) {}

  void header(double val_start) const {
    std::printf("%6s %9s %9s %12s %9s%s\n", "step", "loss", "val", "tokens/s", "ms/step", flops_ > 0 ? "     MFU%" : "");
    std::printf("%6d %9s %9.4f %12s %9s\n", 0, "-", val_start, "-", "-");
  }
  bool row_due(int step) const { return step % every() == 0 || step == opt_.steps; }
  bool val_due(int step) const { return row_due(step) && (step % (every() * 5) == 0 || step == opt_.steps); }
  // Adds a step; prints a row when one is due (val: the held-out loss, when val_due).
  void add(int step, double loss, double seconds, double val) {
    tokens_ += static_cast<double>(opt_.batch) * opt_.seq;
    seconds_ += seconds;
    loss_ += loss;
    ++n_;
    if (!row_due(step)) return;
    char vbuf[16] = "-";
    if (val_due(step)) std::snprintf(vbuf, sizeof vbuf, "%.4f", val);
    std::printf("%6d %9.4f %9s %12.0f %9.1f", step, loss_ / n_, vbuf, tokens_ / seconds_, 1e3 * seconds_ / n_);
    if (flops_ > 0) std::printf(" %8.3g", 100.0 * flops_ * tokens_ / seconds_ / (opt_.peak_tflops * 1e12));
    std::printf("\n");
    std::fflush(stdout);
    tokens_ = seconds_ = loss_ = 0;
    n_ = 0;
  }

 private:
  int every() const { return std::max(1, opt_.steps / 20); }
  const Options& opt_;
  double flops_;
  double tokens_ = 0, seconds_ = 0, loss_ = 0;
  int n_ = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void describe_run(const Options& opt, const std::vector<int>& data, std::size_t split, const std::string& backend) {
  std::printf("train_gpt: %s, %zu bytes (%zu train, %zu held out)\n",
              opt.file.empty() ? "generated corpus of additions" : opt.file.c_str(), data.size(), split,
              data.size() - split);
  std::printf("model: %s; %zu parameters (%zu in the buffer, vocab padded to %d)\n",
              ModelOn<fived::Host>::describe().c_str(), Layout::num_parameters, Layout::size,
              ModelOn<fived::Host>::Vp);
  std::printf("training: %d steps, batch %d x seq %d, AdamW lr %g (warmup, cosine), %s\n", opt.steps, opt.batch,
              opt.seq, static_cast<double>(opt.lr), backend.c_str());
}

struct TrainResult {
  double val_start = 0, val_end = 0, seconds = 0;
};

// The loop both paths share: a batch per step from the training part (the same sequence on
// every rank), one_step(tok, tgt, step) -> loss, the held-out loss when a row wants it, and
// the progress table (printed where `prints`).
template <class LossOf, class Step>
TrainResult training_loop(const Options& opt, const std::vector<int>& data, std::size_t split, Progress& progress,
                          bool prints, LossOf loss_of, Step one_step) {
  TrainResult r;
  r.val_start = r.val_end = held_out_loss(opt, data, split, loss_of);
  if (prints) progress.header(r.val_start);
  std::mt19937 rng(opt.seed);
  std::vector<int> tok, tgt;
  const auto t_start = std::chrono::steady_clock::now();
  for (int step = 1; step <= opt.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    fill_batch(data, 0, split, opt.batch, opt.seq, rng, tok, tgt);
    const double loss = one_step(tok, tgt, step);
    const double dt = seconds_since(t0);
    if (progress.val_due(step)) r.val_end = held_out_loss(opt, data, split, loss_of);
    if (prints) progress.add(step, loss, dt, r.val_end);
  }
  r.seconds = seconds_since(t_start);
  return r;
}

// After training: save, sample, complete sums; the exit status says whether the held-out
// loss fell (the demo's promise).
template <class Model>
int finish(Model& model, const Options& opt, const std::vector<int>& data, std::size_t split, double val_start,
           double val_end) {
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
  if (!(val_end < val_start)) {
    std::printf("held-out loss did not fall (%.4f -> %.4f)\n", val_start, val_end);
    return 1;
  }
  return 0;
}

// FLOPs per token for MFU (CUDA): 6 * params + 12 * L * C * T (attention, causal mask not
// discounted); 0 on the host, where no MFU is printed.
template <class Device>
double flops_per_token(const Options& opt) {
  if constexpr (std::is_same_v<Device, fived::Host>) return 0.0;
  else return 6.0 * static_cast<double>(Layout::num_parameters) + 12.0 * demo_config::layers * demo_config::d_model * opt.seq;
}

// One rank: the serial GPT on the host or on a GPU, trained by the one optimizer step
// (DataParallel over Mesh<>: clip + AdamW, no collective).
template <class Device>
int train(const Options& opt, const std::vector<int>& data, std::size_t split, const std::string& backend) {
  using Model = ModelOn<Device>;
  Model model(fived::GptInit{opt.seed, 0.02});
  describe_run(opt, data, split, backend);
  auto loss_of = [&](const std::vector<int>& tok, const std::vector<int>& tgt) {
    return model.forward(tok.data(), tgt.data(), opt.batch, opt.seq);
  };
  fived::DataParallel<Model> trainer(model, adamw_config(opt));
  Progress progress(opt, flops_per_token<Device>(opt));
  const TrainResult r = training_loop(opt, data, split, progress, true, loss_of,
                                      [&](const std::vector<int>& tok, const std::vector<int>& tgt, int step) {
                                        trainer.optimizer().hp.lr = lr_at(opt, step);
                                        return trainer.step(tok, tgt, opt.batch, opt.seq);  // clip, then AdamW
                                      });
  std::printf("trained %d steps in %.1f s\n", opt.steps, r.seconds);
  return finish(model, opt, data, split, r.val_start, r.val_end);
}

// The mesh: each rank holds its TP piece of the model (sequence parallel); DataParallel
// gives each DP rank B / DP rows of every batch and shards AdamW over DP (ZeRO-1). Every
// rank draws the same global batches; rank 0 prints. On the host the ranks are threads of
// the host backend; on CUDA each rank is a process of a launch (scripts/launch-local.sh,
// torchrun, mpirun, srun) talking NCCL. The trained pieces are gathered into a serial GPT on
// the host for sampling and saving.
template <class Device>
int train_mesh(const Options& opt, const std::vector<int>& data, std::size_t split, const std::string& backend) {
  using TpModel = fived::GPT<demo_config, DemoMesh, float, Device, fived::SequenceParallel>;
  if (opt.batch % demo_dp != 0 || opt.seq % demo_tp != 0)
    usage(("on " + DemoMesh::name() + " --batch must be a multiple of " + std::to_string(demo_dp) +
           " (DP) and --seq of " + std::to_string(demo_tp) + " (TP, sequence parallel); or use --serial")
              .c_str());
  // MFU per GPU: the mesh's tokens/s shared by its ranks.
  Progress progress(opt, flops_per_token<Device>(opt) / DemoMesh::size);
  std::vector<float> trained;  // the whole model, serial layout (rank 0)
  TrainResult result;
  bool printer = false;  // this process holds rank 0
  auto rank_main = [&](auto& ctx) {
    const bool prints = ctx.rank() == 0;
    if (prints)
      describe_run(opt, data, split,
                   backend + ", " + DemoMesh::name() + ": " + std::to_string(DemoMesh::size) +
                       " ranks, TP with sequence parallelism, DP with ZeRO-1");
    TpModel model(ctx, fived::GptInit{opt.seed, 0.02});
    fived::DataParallel<TpModel, fived::ZeRO<1>> dp(model, ctx, adamw_config(opt));
    // Held-out loss: every DP replica evaluates the whole batch over its TP group.
    auto loss_of = [&](const std::vector<int>& tok, const std::vector<int>& tgt) {
      return model.forward(tok.data(), tgt.data(), opt.batch, opt.seq);
    };
    const TrainResult r = training_loop(opt, data, split, progress, prints, loss_of,
                                        [&](const std::vector<int>& tok, const std::vector<int>& tgt, int step) {
                                          dp.optimizer().hp.lr = lr_at(opt, step);
                                          return dp.step(tok, tgt, opt.batch, opt.seq);
                                        });
    std::vector<float> all = model.gather_params();
    if (prints) trained = std::move(all), result = r, printer = true;
  };
  if constexpr (std::is_same_v<Device, fived::Host>) {
    fived::host::run(DemoMesh::size, [&](fived::host::Comm& world) {
      auto ctx = fived::make_mesh_context<DemoMesh>(world);
      rank_main(ctx);
    });
  } else {
#if defined(FIVED_TRAIN_GPT_CUDA)
    auto ctx = fived::make_mesh_context<DemoMesh>(fived::nccl::init_world());
    rank_main(ctx);
#endif
  }
  if (!printer) return 0;
  std::printf("trained %d steps in %.1f s\n", opt.steps, result.seconds);
  ModelOn<fived::Host> serial;
  std::copy(trained.begin(), trained.end(), serial.params().begin());
  return finish(serial, opt, data, split, result.val_start, result.val_end);
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
    char peak[32];
    std::snprintf(peak, sizeof peak, "%g", opt.peak_tflops);
    const std::string gpu = std::string("CUDA backend (") + prop.name + ", fp32; MFU of " + peak + " TFLOP/s per GPU)";
    // Launched as several processes (scripts/launch-local.sh 4 ..., torchrun, mpirun): the mesh over NCCL.
    if (fived::launch_env().world_size > 1) return train_mesh<fived::Cuda>(opt, data, split, gpu + ", NCCL");
    return train<fived::Cuda>(opt, data, split, gpu + ", one rank");
  }
  if (const int world = fived::launch_env().world_size; world > 1)
    usage(("launched as " + std::to_string(world) + " processes, but " +
           (opt.host ? std::string("--host was given") : std::string("there is no CUDA device")) +
           ": the host backend runs the mesh's ranks as threads of one process; start train_gpt_cuda once")
              .c_str());
  const std::string backend = opt.host ? "host backend (--host)" : "host backend (no CUDA device)";
#else
  const std::string backend = "host backend";
#endif
  if (!opt.serial) return train_mesh<fived::Host>(opt, data, split, backend + " (ranks as threads)");
  return train<fived::Host>(opt, data, split, backend + ", one rank (--serial)");
}
