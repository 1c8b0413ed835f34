// Ring attention (context parallelism) beside the plain attention kernel at the same total
// sequence length, on GPUs over NCCL, or on one GPU with the exchange a local copy:
//
//   scripts/launch-local.sh 2 build/bench/ring_attention [--seq 4096] [--batch 1] [--steps 10] [--warmup 3]
//   build/bench/ring_attention --local [same options]
//
// GPT-2 124M's attention shape (12 heads of 64), bf16. Rows (median wall-clock ms of a
// forward + backward of the attention core, qkv -> y and back, over --steps after --warmup):
//   plain, 1 GPU       rank 0 alone: attention_forward/backward over the whole [B, T]
//   ring, CP 2         each rank: RingAttention over its T/2 tokens (zig-zag), the ring's
//                      transfers on the CP communicator
// Several ranks on ONE GPU share its SMs and talk over loopback sockets (scripts/launch-local.sh):
// then the ring row measures both ranks' work on one GPU plus socket transfers.
//   --local            one process, no NCCL: each CP rank's side of the ring alone, in turn, its
//                      exchange with the other rank a device copy of the same bytes on the
//                      compute stream (LoopbackComm, below), so the GPU runs one rank's blocks at
//                      a time: the ring's compute, what CP 2 costs a rank where the transfer
//                      is overlapped (NVLink moves a step's 2 x 3 MiB of [k | v] in ~20 us,
//                      beside blocks of ~100 us), measurable with one GPU. The CP step takes
//                      the slower rank's time; the last row is that over the plain kernel's
//                      for the same tokens.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fived/comm/communicator.hpp>
#include <fived/comm/nccl.hpp>
#include <fived/comm/nccl_bootstrap.hpp>
#include <fived/mesh/context.hpp>
#include <fived/nn/cuda/ops.hpp>
#include <fived/nn/ring_attention.hpp>
#include <fived/nn/stream.hpp>

#include "cli.hpp"

// --local's CP group of two on one process: rank `rank` of it, whose exchange with its peer
// copies what it sends into where it receives (the peer's keys and values are this rank's
// own: the same blocks and the same work as in the ring, other numbers), on the compute stream.
// Only the ring's calls (send_recv, send_recv_begin, join) are defined; the others throw.
namespace bench {

class LoopbackComm {
 public:
  LoopbackComm(int rank, std::string name) : rank_(rank), name_(std::move(name)) {}
  int rank() const { return rank_; }
  int size() const { return 2; }
  const std::string& name() const { return name_; }
  void set_compute_stream(cudaStream_t s) { stream_ = s; }

  template <class E>
  void send_recv(std::span<const fived::SendOp<E>> sends, std::span<const fived::RecvOp<E>> recvs) {
    if (sends.size() != recvs.size()) unused("send_recv with unequal numbers of sends and receives");
    for (std::size_t k = 0; k < sends.size(); ++k) {
      if (sends[k].buf.size() != recvs[k].buf.size()) unused("send_recv of unequal sizes");
      FIVED_CUDA_CHECK(cudaMemcpyAsync(recvs[k].buf.data(), sends[k].buf.data(), sends[k].buf.size_bytes(),
                                       cudaMemcpyDeviceToDevice, stream_));
    }
  }
  template <class E>
  void send_recv_begin(std::span<const fived::SendOp<E>> sends, std::span<const fived::RecvOp<E>> recvs) {
    send_recv(sends, recvs);
  }
  void join() {}

  template <class E>
  void all_reduce(std::span<const E>, std::span<E>, fived::ReduceOp) { unused("all_reduce"); }
  template <class E>
  void reduce_scatter(std::span<const E>, std::span<E>, fived::ReduceOp) { unused("reduce_scatter"); }
  template <class E>
  void all_gather(std::span<const E>, std::span<E>) { unused("all_gather"); }
  template <class E>
  void all_to_all(std::span<const E>, std::span<E>) { unused("all_to_all"); }
  template <class E>
  void all_to_all_v(std::span<const E>, std::span<const std::size_t>, std::span<E>, std::span<const std::size_t>) {
    unused("all_to_all_v");
  }
  template <class E>
  void broadcast(std::span<E>, int) { unused("broadcast"); }
  void barrier() { unused("barrier"); }
  void synchronize() { FIVED_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  LoopbackComm split(int, int, std::string) { unused("split"); }

 private:
  [[noreturn]] static void unused(const char* what) {
    throw std::logic_error(std::string("ring_attention --local: ") + what + " is not part of the ring");
  }
  int rank_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
};
static_assert(fived::Communicator<LoopbackComm>);

}  // namespace bench

namespace {

using fived::bf16;
using fived::Cuda;
using CPMesh = fived::Mesh<fived::CP<2>>;
using Step = fived::Step<CPMesh, bf16, Cuda, fived::NoSequenceParallel>;
constexpr int C = 768, NH = 12;
using Ring = fived::RingAttention<Step, NH>;

struct Options {
  int batch = 1, seq = 4096, steps = 10, warmup = 3;
  bool local = false;
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "%s\nusage: scripts/launch-local.sh 2 ring_attention [--seq T (4096, a multiple of 4)] [--batch B (1)] "
               "[--steps N (10)] [--warmup W (3)]\n       ring_attention --local [the same options]\n",
               msg.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  bench::parse_options(argc, argv, usage, [&](std::string_view a, auto value) {
    if (a == "--local") o.local = true;
    else if (a == "--seq") o.seq = std::stoi(value());
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


// Forward + backward of the attention core over the whole sequence on one GPU.
double plain_ms(const Options& opt, fived::Ops<bf16, Cuda>& ops) {
  const std::size_t N = static_cast<std::size_t>(opt.batch) * static_cast<std::size_t>(opt.seq);
  auto qkv = ops.make_buffer<bf16>(N * 3 * C), y = ops.make_buffer<bf16>(N * C), dy = ops.make_buffer<bf16>(N * C),
       dqkv = ops.make_buffer<bf16>(N * 3 * C);
  auto lse = ops.make_buffer<float>(N * NH);
  fill(ops, qkv, 1), fill(ops, dy, 2);
  return median_ms(opt, ops, [&] {
    ops.attention_forward(y.data(), lse.data(), qkv.data(), opt.batch, opt.seq, C, NH, NH);
    ops.attention_backward(dqkv.data(), dy.data(), qkv.data(), y.data(), lse.data(), opt.batch, opt.seq, C, NH, NH);
  });
}

// Forward + backward of one rank's ring (its T/2 tokens) over the CP communicator `cp`.
double ring_ms(const Options& opt, fived::Ops<bf16, Cuda>& ops, fived::AxisComm<CPMesh, fived::Axis::cp>& cp,
               unsigned seed) {
  fived::AxisComm<CPMesh, fived::Axis::tp> tp;
  cp.set_compute_stream(ops.stream());
  const int Tl = opt.seq / 2;
  const std::size_t N = static_cast<std::size_t>(opt.batch) * static_cast<std::size_t>(Tl);
  Step s{ops, tp, cp, opt.batch, Tl};
  Ring::Work w;
  w.reserve(ops, N, C);
  auto qkv = ops.make_buffer<bf16>(N * 3 * C), y = ops.make_buffer<bf16>(N * C), dy = ops.make_buffer<bf16>(N * C),
       dqkv = ops.make_buffer<bf16>(N * 3 * C);
  auto lse = ops.make_buffer<float>(N * NH);
  fill(ops, qkv, seed), fill(ops, dy, 4);
  return median_ms(opt, ops, [&] {
    Ring::forward(s, w, y.data(), lse.data(), qkv.data(), C);
    Ring::backward(s, w, dqkv.data(), dy.data(), qkv.data(), y.data(), lse.data(), C);
  });
}

void print_head(const Options& opt, const char* how) {
  cudaDeviceProp prop{};
  FIVED_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s  fived bench/ring_attention  12 heads x 64, bf16, B = %d, T = %d, %s\n", prop.name, opt.batch,
              opt.seq, how);
  std::printf("%-44s %8s %14s\n", "attention fwd + bwd", "T/rank", "ms/step");
}

// --local: the plain kernel, then each CP rank's ring in turn on this one GPU.
int run_local(const Options& opt) {
  fived::Ops<bf16, Cuda> ops;
  const double plain = plain_ms(opt, ops);
  double ring[2];
  for (int r = 0; r < 2; ++r) {
    bench::LoopbackComm peer(r, CPMesh::cp_group::name());
    fived::AxisComm<CPMesh, fived::Axis::cp> cp(peer);
    ring[r] = ring_ms(opt, ops, cp, 3 + static_cast<unsigned>(r));
  }
  print_head(opt, "one GPU, each CP rank's ring alone (its exchange a device copy)");
  std::printf("%-44s %8d %14.3f\n", "plain kernel, 1 GPU", opt.seq, plain);
  for (int r = 0; r < 2; ++r) {
    char name[64];
    std::snprintf(name, sizeof name, "ring compute, CP 2 rank %d", r);
    std::printf("%-44s %8d %14.3f\n", name, opt.seq / 2, ring[r]);
  }
  const double slower = std::max(ring[0], ring[1]);
  std::printf("CP 2 step (the slower rank) / plain kernel, same tokens: %.2f (issue 26 asks at most 1.3)\n",
              slower / plain);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (fived::cuda::device_count() == 0) {
    std::fprintf(stderr, "ring_attention: no CUDA device\n");
    return 1;
  }
  try {
    if (opt.local) return run_local(opt);
    auto ctx = fived::make_mesh_context<CPMesh>(fived::nccl::init_world());
    const bool printer = ctx.rank() == 0;
    fived::Ops<bf16, Cuda> ops;
    double plain = 0;
    if (printer) plain = plain_ms(opt, ops);  // the whole sequence on one GPU
    ctx.world().barrier();
    fived::AxisComm<CPMesh, fived::Axis::cp> cp(ctx.comm<fived::Axis::cp>());
    const double ring = ring_ms(opt, ops, cp, 3 + static_cast<unsigned>(ctx.rank()));
    if (printer) {
      print_head(opt, "2 ranks");
      std::printf("%-44s %8d %14.3f\n", "plain kernel, 1 GPU", opt.seq, plain);
      std::printf("%-44s %8d %14.3f\n", "ring, CP 2 (rank 0)", opt.seq / 2, ring);
    }
    ctx.world().barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ring_attention: %s\n", e.what());
    return 1;
  }
}
