// Train a small mixture-of-experts GPT with expert parallelism, on the host backend or a GPU.
//
//   train_moe [--steps N] [--batch B] [--seq T] [--lr LR] [--seed S] [--aux-loss]
//   scripts/launch-local.sh 4 build/examples/train_moe_cuda [...]     # the same on CUDA + NCCL
//
// The mesh is Mesh<DP<2>, TP<2>, EP<2>>: four ranks as threads, or (train_moe_cuda, the same
// source through nvcc, GPU only) four processes launched like torchrun. The dense layers are split
// over TP with sequence parallelism and replicated over DP (ZeRO-1); every block's MLP is a
// mixture of 4 experts (top-2): each of the two EP ranks (carved out of DP, so the two TP
// slices of a replica exchange tokens with their counterparts of the other replica) holds two
// experts, split over TP like the dense MLP. The corpus is lines of additions ("17+5=22").
//
// Every few steps it prints the loss, the load-balancing loss, tokens/s and, per MoE block,
// the tokens each expert took in the last step with the balance (the busiest expert over the
// mean: 1.00 is perfect). The loads are balanced by DeepSeek-V3's selection bias; --aux-loss
// uses the Switch auxiliary loss instead (on this tiny model the router then tends to send
// every token to the same two experts: the bias keeps them spread).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#if defined(FIVED_WITH_CUDA) && defined(__CUDACC__)
#define FIVED_TRAIN_MOE_CUDA 1
#include "fived/comm/nccl_bootstrap.hpp"
#include "fived/nn/cuda/ops.hpp"  // before gpt.hpp: Ops<T, Cuda>
#endif
#include "fived/comm/bootstrap.hpp"
#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/train/data_parallel.hpp"

namespace {

struct moe_config : fived::gpt_config {
  static constexpr int layers = 2, d_model = 64, heads = 4, vocab = 256, max_seq = 64, vocab_multiple = 64;
  static constexpr int experts = 4, top_k = 2, mlp_ratio = 2;
  static constexpr double aux_loss_coef = 0.1;
};
struct bias_config : moe_config {
  using balancing = fived::AuxLossFreeBias;
  static constexpr double aux_loss_coef = 0, bias_update_rate = 1e-2;
};
using MoeMesh = fived::Mesh<fived::DP<2>, fived::TP<2>, fived::EP<2>>;

struct Options {
  int steps = 60, batch = 8, seq = 32;
  float lr = 3e-3f;
  unsigned seed = 1337;
  bool aux = false;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr, "%s\nusage: train_moe [--steps N] [--batch B (even)] [--seq T (<= %d)] [--lr LR] [--seed S] [--aux-loss]\n",
               msg, moe_config::max_seq);
  std::exit(2);
}

// A whole decimal number, nothing after it.
long number(std::string_view what, const std::string& v) {
  std::size_t used = 0;
  const long x = std::stol(v, &used);
  if (used != v.size()) throw std::invalid_argument(std::string(what));
  return x;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + std::string(a)).c_str());
      return argv[++i];
    };
    try {
      if (a == "--steps") o.steps = static_cast<int>(number(a, value()));
      else if (a == "--batch") o.batch = static_cast<int>(number(a, value()));
      else if (a == "--seq") o.seq = static_cast<int>(number(a, value()));
      else if (a == "--lr") {
        const std::string v = value();
        std::size_t used = 0;
        o.lr = std::stof(v, &used);
        if (used != v.size()) throw std::invalid_argument("--lr");
      } else if (a == "--seed") {
        const long s = number(a, value());
        if (s < 0) throw std::invalid_argument("--seed");
        o.seed = static_cast<unsigned>(s);
      } else if (a == "--aux-loss") o.aux = true;
      else if (a == "-h" || a == "--help") usage("Trains a small mixture-of-experts GPT over EP on the host.");
      else usage(("unknown option " + std::string(a)).c_str());
    } catch (const std::logic_error&) {
      usage(("bad number after " + std::string(a)).c_str());
    }
  }
  if (o.steps < 1 || o.batch < 2 || o.batch % 2 != 0 || o.seq < 2 || o.seq > moe_config::max_seq || !(o.lr > 0))
    usage("need --steps >= 1, an even --batch >= 2, 2 <= --seq <= 64, --lr > 0");
  return o;
}

// "a+b=c\n" lines as bytes.
std::vector<int> corpus(std::size_t bytes, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, 19);
  std::vector<int> s;
  while (s.size() < bytes) {
    const int a = d(rng), b = d(rng);
    for (char c : std::to_string(a) + "+" + std::to_string(b) + "=" + std::to_string(a + b) + "\n")
      s.push_back(static_cast<unsigned char>(c));
  }
  return s;
}

// One rank's training: the same on host threads and on CUDA processes.
template <class Cfg, class Device, class Ctx>
void train_rank(Ctx& ctx, const Options& opt, const char* backend) {
  using Model = fived::GPT<Cfg, MoeMesh, float, Device, fived::SequenceParallel>;
  const std::vector<int> data = corpus(1 << 16, opt.seed);
  if (ctx.rank() == 0) {
    std::printf("%s on %s, %zu dense and %zu expert parameters on each of %d ranks, balancing by %s\n",
                Model::describe().c_str(), backend, Model::layout::size, Model::expert_layout::size, MoeMesh::size,
                Cfg::balancing::bias ? "the selection bias" : "the auxiliary loss");
    std::printf("%6s %8s %8s %10s   %s\n", "step", "loss", "aux", "tokens/s", "tokens per expert (balance: max/mean)");
  }
  {
    Model model(ctx, fived::GptInit{.seed = opt.seed});
    const fived::AdamWConfig hp{.lr = opt.lr, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f,
                                .max_norm = 1.0f};
    fived::DataParallel<Model, fived::ZeRO<1>> dp(model, ctx, hp);
    std::mt19937 rng(opt.seed + 7);  // the same windows on every rank
    std::uniform_int_distribution<std::size_t> start(0, data.size() - static_cast<std::size_t>(opt.seq) - 1);
    std::vector<int> tok(static_cast<std::size_t>(opt.batch * opt.seq)), tgt(tok.size());
    const int every = std::max(1, opt.steps / 10);
    auto t0 = std::chrono::steady_clock::now();
    for (int step = 1; step <= opt.steps; ++step) {
      for (int b = 0; b < opt.batch; ++b) {
        const std::size_t s = start(rng);
        for (int t = 0; t < opt.seq; ++t) {
          tok[static_cast<std::size_t>(b * opt.seq + t)] = data[s + static_cast<std::size_t>(t)];
          tgt[static_cast<std::size_t>(b * opt.seq + t)] = data[s + static_cast<std::size_t>(t) + 1];
        }
      }
      const double loss = dp.step(tok, tgt, opt.batch, opt.seq);
      const double aux = dp.average(model.aux_loss());
      if (ctx.rank() != 0 || (step % every != 0 && step != 1 && step != opt.steps)) continue;
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double tps = static_cast<double>(opt.batch) * opt.seq * (step == 1 ? 1 : every) / secs;
      std::string loads;
      const std::vector<double> l = model.expert_loads();
      for (int m = 0; m < Model::moe_blocks; ++m) {
        double sum = 0, most = 0;
        loads += m ? "  |" : "";
        for (int e = 0; e < Cfg::experts; ++e) {
          const double x = l[static_cast<std::size_t>(m * Cfg::experts + e)];
          sum += x, most = std::max(most, x);
          loads += ' ';  // (not " " + to_string: GCC 12's -Wrestrict false positive at -O3)
          loads += std::to_string(static_cast<long>(x));
        }
        char b[32];
        std::snprintf(b, sizeof b, " (%.2f)", sum > 0 ? most / (sum / Cfg::experts) : 0.0);
        loads += b;
      }
      std::printf("%6d %8.4f %8.5f %10.0f  %s\n", step, loss, aux, tps, loads.c_str());
      std::fflush(stdout);
      t0 = std::chrono::steady_clock::now();
    }
  }
}

template <class Cfg>
void train(const Options& opt) {
#if defined(FIVED_TRAIN_MOE_CUDA)
  if (fived::cuda::device_count() == 0)
    usage("train_moe_cuda trains on a GPU and there is no CUDA device: build/examples/train_moe is the same program on "
          "the host backend");
  if (const int world = fived::launch_env().world_size; world != MoeMesh::size)
    usage(("needs " + std::to_string(MoeMesh::size) + " processes, one per rank, but this launch has " +
           std::to_string(world) + ": scripts/launch-local.sh 4 build/examples/train_moe_cuda (or torchrun, mpirun, srun)")
              .c_str());
  auto ctx = fived::make_mesh_context<MoeMesh>(fived::nccl::init_world());
  train_rank<Cfg, fived::Cuda>(ctx, opt, "CUDA + NCCL, fp32");
#else
  fived::host::run(MoeMesh::size, [&](fived::host::Comm& world) {
    auto ctx = fived::make_mesh_context<MoeMesh>(world);
    train_rank<Cfg, fived::Host>(ctx, opt, (std::string("the host backend, ") + fived::host::ranks_are()).c_str());
  });
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  try {
    if (opt.aux) train<moe_config>(opt);
    else train<bias_config>(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_moe: %s\n", e.what());
    return 1;
  }
}
