// A GPT trained with pipeline parallelism on the host backend: the README's pipeline
// example, whole.
//
//   pipeline [--steps 30]
//
// Mesh<PP<2>>: two ranks as threads, each holding half of the blocks (rank 0 also the
// embedding, rank 1 ln_f, the head and the loss), running 1F1B over 4 micro-batches per
// step. Rank 0 prints the loss (the same on both ranks: the executor hands it out) of
// generated sequences it can learn (each token is followed by the next of a fixed cycle).

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string_view>
#include <tuple>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/pipeline/executor.hpp"
#include "fived/pipeline/schedules.hpp"
#include "fived/pipeline/stage_layers.hpp"
#include "fived/train/data_parallel.hpp"

using namespace fived;

struct cfg : gpt_config {  // 4 blocks, d_model 64, an untied head (tied weights cannot span stages yet)
  static constexpr int layers = 4, d_model = 64, heads = 4, vocab = 64, max_seq = 32, vocab_multiple = 16;
  static constexpr bool tied = false;
};
using mesh = Mesh<PP<2>>;
using sched = pipeline::OneFOneB<2, 4>;  // P = 2 ranks, M = 4 micro-batches: proven when named
using cut = StageLayers<GPT<cfg>, 2>;         // the blocks over 2 stages, balanced by FLOPs
template <int stage>
using Stage = GPT<cfg, mesh, float, Host, NoSequenceParallel, cut::part<stage>>;

constexpr int B = 4, T = 32;
const AdamWConfig adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f, .max_norm = 1.0f};

// A global batch of 4 micro-batches: random starts along a fixed cycle of the vocabulary.
void batch(std::mt19937& rng, std::vector<int>& tok, std::vector<int>& tgt) {
  static const std::vector<int> next = [] {
    std::vector<int> p(cfg::vocab);
    for (int i = 0; i < cfg::vocab; ++i) p[static_cast<std::size_t>(i)] = (i * 37 + 11) % cfg::vocab;
    return p;
  }();
  std::uniform_int_distribution<int> start(0, cfg::vocab - 1);
  tok.resize(static_cast<std::size_t>(sched::table.micro_batches) * B * T);
  tgt.resize(tok.size());
  for (std::size_t row = 0; row < tok.size() / T; ++row) {
    int t = start(rng);
    for (std::size_t i = 0; i < T; ++i) {
      tok[row * T + i] = t;
      t = next[static_cast<std::size_t>(t)];
      tgt[row * T + i] = t;
    }
  }
}

template <int stage>
void train(MeshContext<mesh, host::Comm>& ctx, int steps) {
  Stage<stage> model(ctx, GptInit{1, 0.02});
  DataParallel<Stage<stage>> trainer(model, ctx, adamw, sched::table.micro_batches);
  auto run = pipeline::make_executor(sched::table, stage, ctx.comm<Axis::pp>(), std::tie(model), std::tie(trainer));
  if (stage == 0)
    std::printf("pipeline: GPT over %s, 1F1B with %d micro-batches (bubble %.1f%%); stage 0: %s\n",
                mesh::name().c_str(), sched::table.micro_batches, 100.0 * sched::figures.bubble,
                Stage<0>::describe().c_str());
  std::mt19937 rng(7);
  std::vector<int> tok, tgt;
  for (int s = 1; s <= steps; ++s) {
    batch(rng, tok, tgt);
    const double loss = run.step(tok, tgt, B, T);  // the same on every rank
    if (stage == 0 && (s == 1 || s % 5 == 0)) std::printf("step %3d  loss %.4f\n", s, loss);
  }
}

int main(int argc, char** argv) {
  int steps = 30;
  if (argc == 3 && std::string_view(argv[1]) == "--steps") steps = std::atoi(argv[2]);
  else if (argc != 1) {
    std::fprintf(stderr, "usage: pipeline [--steps N]\n");
    return 2;
  }
  if (steps < 1) {
    std::fprintf(stderr, "pipeline: --steps must be at least 1\n");
    return 2;
  }
  host::run(mesh::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<mesh>(world);
    if (ctx.coord()[Axis::pp] == 0) train<0>(ctx, steps);
    else train<1>(ctx, steps);
  });
  return 0;
}
