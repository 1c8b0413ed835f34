// Ring attention (context parallelism) beside the plain attention kernel at the same total
// sequence length, on GPUs over NCCL:
//
//   scripts/launch-local.sh 2 build/bench/ring_attention [--seq 4096] [--batch 1] [--steps 10] [--warmup 3]
//
// GPT-2 124M's attention shape (12 heads of 64), bf16. Rows (median wall-clock ms of a
// forward + backward of the attention core, qkv -> y and back, over --steps after --warmup):
//   plain, 1 GPU       rank 0 alone: attention_forward/backward over the whole [B, T]
//   ring, CP 2         each rank: RingAttention over its T/2 tokens (zig-zag), the ring's
//                      transfers on the CP communicator
// Several ranks on ONE GPU share its SMs and talk over loopback sockets (scripts/launch-local.sh):
// then the ring row measures both ranks' work on one GPU plus socket transfers.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <fived/comm/nccl.hpp>
#include <fived/comm/nccl_bootstrap.hpp>
#include <fived/mesh/context.hpp>
#include <fived/nn/cuda/ops.hpp>
#include <fived/nn/ring_attention.hpp>
#include <fived/nn/stream.hpp>

#include "cli.hpp"

namespace {

using fived::bf16;
using fived::Cuda;
using CPMesh = fived::Mesh<fived::CP<2>>;
using Step = fived::Step<CPMesh, bf16, Cuda, fived::NoSequenceParallel>;
constexpr int C = 768, NH = 12;
using Ring = fived::RingAttention<Step, NH>;

struct Options {
  int batch = 1, seq = 4096, steps = 10, warmup = 3;
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "%s\nusage: scripts/launch-local.sh 2 ring_attention [--seq T (4096, a multiple of 4)] [--batch B (1)] "
               "[--steps N (10)] [--warmup W (3)]\n",
               msg.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  bench::parse_options(argc, argv, usage, [&](std::string_view a, auto value) {
    if (a == "--seq") o.seq = std::stoi(value());
    else if (a == "--batch") o.batch = std::stoi(value());
    else if (a == "--steps") o.steps = std::stoi(value());
    else if (a == "--warmup") o.warmup = std::stoi(value());
    else return false;
    return true;
  });
  if (o.seq < 4 || o.seq % 4 != 0 || o.batch < 1 || o.steps < 1 || o.warmup < 0)
    usage("need --seq a positive multiple of 4, --batch >= 1, --steps >= 1, --warmup >= 0");
  return o;
}

template <class F>
double median_ms(const Options& opt, fived::Ops<bf16, Cuda>& ops, F body) {
  for (int i = 0; i < opt.warmup; ++i) body();
  ops.synchronize();
  std::vector<double> ms;
  for (int i = 0; i < opt.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    ops.synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void fill(fived::Ops<bf16, Cuda>& ops, fived::Buffer<bf16, Cuda>& b, unsigned seed) {
  ops.write_from_host(b, [&](std::span<bf16> h) {
    for (std::size_t i = 0; i < h.size(); ++i)
      h[i] = bf16(static_cast<float>(((i * 2654435761u + seed) % 2001) / 1000.0 - 1.0));
  });
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (fived::cuda::device_count() == 0) {
    std::fprintf(stderr, "ring_attention: no CUDA device\n");
    return 1;
  }
  try {
    auto ctx = fived::make_mesh_context<CPMesh>(fived::nccl::init_world());
    const bool printer = ctx.rank() == 0;
    fived::Ops<bf16, Cuda> ops;
    const std::size_t B = static_cast<std::size_t>(opt.batch);

    double plain = 0;
    if (printer) {  // the whole sequence on one GPU
      const std::size_t N = B * static_cast<std::size_t>(opt.seq);
      auto qkv = ops.make_buffer<bf16>(N * 3 * C), y = ops.make_buffer<bf16>(N * C), dy = ops.make_buffer<bf16>(N * C),
           dqkv = ops.make_buffer<bf16>(N * 3 * C);
      auto lse = ops.make_buffer<float>(N * NH);
      fill(ops, qkv, 1), fill(ops, dy, 2);
      plain = median_ms(opt, ops, [&] {
        ops.attention_forward(y.data(), lse.data(), qkv.data(), opt.batch, opt.seq, C, NH, NH);
        ops.attention_backward(dqkv.data(), dy.data(), qkv.data(), y.data(), lse.data(), opt.batch, opt.seq, C, NH, NH);
      });
    }
    ctx.world().barrier();

    fived::AxisComm<CPMesh, fived::Axis::tp> tp;
    fived::AxisComm<CPMesh, fived::Axis::cp> cp(ctx.comm<fived::Axis::cp>());
    cp.set_compute_stream(ops.stream());
    const int Tl = opt.seq / 2;
    const std::size_t N = B * static_cast<std::size_t>(Tl);
    Step s{ops, tp, cp, opt.batch, Tl};
    Ring::Work w;
    w.reserve(ops, N, C);
    auto qkv = ops.make_buffer<bf16>(N * 3 * C), y = ops.make_buffer<bf16>(N * C), dy = ops.make_buffer<bf16>(N * C),
         dqkv = ops.make_buffer<bf16>(N * 3 * C);
    auto lse = ops.make_buffer<float>(N * NH);
    fill(ops, qkv, 3 + static_cast<unsigned>(ctx.rank())), fill(ops, dy, 4);
    const double ring = median_ms(opt, ops, [&] {
      Ring::forward(s, w, y.data(), lse.data(), qkv.data(), C);
      Ring::backward(s, w, dqkv.data(), dy.data(), qkv.data(), y.data(), lse.data(), C);
    });

    if (printer) {
      cudaDeviceProp prop{};
      FIVED_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
      std::printf("device: %s  fived bench/ring_attention  12 heads x 64, bf16, B = %d, T = %d, %d ranks\n", prop.name,
                  opt.batch, opt.seq, CPMesh::size);
      std::printf("%-26s %8s %14s\n", "attention fwd + bwd", "T/rank", "ms/step");
      std::printf("%-26s %8d %14.3f\n", "plain kernel, 1 GPU", opt.seq, plain);
      std::printf("%-26s %8d %14.3f\n", "ring, CP 2 (rank 0)", Tl, ring);
    }
    ctx.world().barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ring_attention: %s\n", e.what());
    return 1;
  }
}
