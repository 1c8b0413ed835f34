// CUDA kernels at GPT-2 124M shapes (B=8, T=1024, C=768, NH=12, V=50257 padded
// to 50304), bf16 with fp32 accumulation: median time over --iters runs (CUDA
// events around each run; before each, the L2 is flushed and the stream held by a short
// spin kernel while the run is queued, so a run is timed from HBM and without the host's
// launch latency, as a kernel runs inside a step; --plain times it without either),
// achieved GB/s (memory-bound kernels: bytes that must move at least once) or TFLOP/s
// (GEMM, attention), and that as a fraction of this device's measured ceilings: HBM
// bandwidth from a device-to-device copy kernel, GEMM peak from a large cuBLASLt bf16
// GEMM (8192^3).
//   bench/kernels [--iters N] [--plain]        (not run by CTest)

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <fived/device/cuda.hpp>
#include <fived/kernels/cuda.hpp>
#include <fived/nn/gpt.hpp>
#include <fived/optim/adamw.hpp>
#include <fived/train/bucket_plan.hpp>

#include "text_ids.hpp"

namespace {

using fived::bf16;
using fived::Buffer;
using fived::Cuda;
namespace ck = fived::kernels::cuda;

// Deterministic pseudo-random fill on the device (hash of the index), values in [-scale, scale].
template <class E>
__global__ void fill_kernel(E* p, std::size_t n, std::uint32_t seed, float scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed * 0x9E3779B9u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    const float u = static_cast<float>(h & 0xFFFFFFu) / static_cast<float>(0xFFFFFF) * 2.0f - 1.0f;
    p[i] = ck::from_float<E>(u * scale);
  }
}

template <class T>
void fill(Buffer<T, Cuda>& b, std::uint32_t seed, float scale, cudaStream_t s) {
  fill_kernel<<<ck::detail::grid_for(b.size(), 256), 256, 0, s>>>(ck::dev(b.data()), b.size(), seed, scale);
  FIVED_CUDA_CHECK_LAUNCH("fill_kernel");
}

__global__ void copy_kernel(float4* dst, const float4* src, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// A plain copy of `bytes` (a multiple of 16, both pointers 16-byte aligned): the HBM ceiling,
// and the reference a memory-bound kernel's rate is read against at its own size.
void copy_bytes(cudaStream_t s, const cudaDeviceProp& prop, void* dst, const void* src, std::size_t bytes) {
  copy_kernel<<<prop.multiProcessorCount * 8, 512, 0, s>>>(static_cast<float4*>(dst), static_cast<const float4*>(src),
                                                           bytes / sizeof(float4));
  FIVED_CUDA_CHECK_LAUNCH("copy_kernel");
}

__global__ void tokens_kernel(int* t, std::size_t n, int V) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    t[i] = static_cast<int>((i * 2654435761ull) % static_cast<unsigned long long>(V));
}

// n ids drawn as text repeats them (bench/text_ids.hpp), with how many are distinct and how
// often the most frequent comes.
struct TextLikeIds {
  std::vector<int> ids;
  int distinct = 0, most = 0;
};
TextLikeIds text_like_ids(std::size_t n, int V) {
  TextLikeIds t;
  std::mt19937 gen(1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int> count(static_cast<std::size_t>(V));
  for (std::size_t i = 0; i < n; ++i) {
    const int id = bench::text_like_id(u(gen), V);
    t.ids.push_back(id);
    t.distinct += count[static_cast<std::size_t>(id)]++ == 0;
  }
  t.most = *std::max_element(count.begin(), count.end());
  return t;
}

int iters = 20;

// Reads `n` float4 (more than the L2 holds), so the timed run that follows reads its
// inputs from HBM; the write never happens (the sum is never that value) but keeps the reads.
__global__ void flush_kernel(const float4* p, std::size_t n, float* sink) {
  float s = 0.0f;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    s += p[i].x;
  if (s == 1234.5678f) *sink = s;
}

// Holds the stream for `ns` nanoseconds, so the host has queued the timed run before the
// start event is reached: the interval is the GPU's time, not the launch's.
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}

struct ColdCache {
  Buffer<float4, Cuda> lines;
  Buffer<float, Cuda> sink{1};
  int blocks;
  explicit ColdCache(const cudaDeviceProp& prop)
      : lines(4 * static_cast<std::size_t>(prop.l2CacheSize) / sizeof(float4)), blocks(prop.multiProcessorCount * 4) {}
  void before_run(cudaStream_t s) {
    flush_kernel<<<blocks, 512, 0, s>>>(lines.data(), lines.size(), sink.data());
    FIVED_CUDA_CHECK_LAUNCH("flush_kernel");
    spin_kernel<<<1, 1, 0, s>>>(200'000);
    FIVED_CUDA_CHECK_LAUNCH("spin_kernel");
  }
};
ColdCache* cold = nullptr;  // null with --plain: no flush, no spin (the timing before 2026-11-27)

// Median milliseconds of fn over `iters` runs (after 2 warm-up runs).
double time_ms(cudaStream_t s, const std::function<void()>& fn) {
  fived::cuda::Event a, b;
  for (int i = 0; i < 2; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    if (cold != nullptr) cold->before_run(s);
    a.record(s);
    fn();
    b.record(s);
    ms.push_back(fived::cuda::Event::elapsed_ms(a, b));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double hbm_gbs = 0, gemm_tflops = 0;

void row(const char* name, double ms, double bytes, double flops) {
  if (flops > 0) {
    const double tf = flops / (ms * 1e-3) / 1e12;
    std::printf("%-34s %10.3f %12s %10.1f %9.0f%%  of GEMM peak\n", name, ms, "", tf, 100.0 * tf / gemm_tflops);
  } else {
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    std::printf("%-34s %10.3f %12.0f %10s %9.0f%%  of HBM\n", name, ms, gbs, "", 100.0 * gbs / hbm_gbs);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool plain = false;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
      iters = std::max(1, std::atoi(argv[++i]));
    else if (std::strcmp(argv[i], "--plain") == 0)
      plain = true;
  if (fived::cuda::device_count() == 0) {
    std::puts("bench/kernels: no CUDA device");
    return 1;
  }
  cudaDeviceProp prop{};
  FIVED_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  fived::cuda::Stream stream;
  cudaStream_t s = stream;
  ck::CublasLt lt(s);
  // As in training (Ops does this): the kernels' stream-ordered scratch stays in the pool
  // between calls. Without it every timed call that takes scratch (column reductions,
  // embedding backward) also timed the driver mapping the memory again after each sync.
  ck::keep_scratch_pool();
  std::optional<ColdCache> cold_cache;
  if (!plain) cold = &cold_cache.emplace(prop);

  constexpr int B = 8, T = 1024, C = 768, NH = 12, V = 50257, Vp = 50304;
  constexpr std::size_t BT = static_cast<std::size_t>(B) * T;
  constexpr double e = sizeof(bf16);
  const std::size_t params = 124475904;  // GPT-2 124M with Vp (tied embeddings)

  std::printf("fived kernel benchmark on %s (%d SMs), bf16, B=%d T=%d C=%d NH=%d Vp=%d, median of %d runs, %s\n",
              prop.name, prop.multiProcessorCount, B, T, C, NH, Vp, iters,
              plain ? "plain (L2 warm, launch latency included)" : "L2 flushed and launch queued before each run");

  {  // ceilings
    const std::size_t n4 = (std::size_t{1} << 30) / sizeof(float4);
    Buffer<float4, Cuda> src(n4), dst(n4);
    const double ms = time_ms(s, [&] { copy_bytes(s, prop, dst.data(), src.data(), n4 * sizeof(float4)); });
    hbm_gbs = 2.0 * n4 * sizeof(float4) / (ms * 1e-3) / 1e9;
    const int n = 8192;
    Buffer<bf16, Cuda> a(static_cast<std::size_t>(n) * n), b(a.size()), c(a.size());
    fill(a, 1, 1.0f, s);
    fill(b, 2, 1.0f, s);
    const double gms = time_ms(s, [&] { ck::matmul(lt, c.data(), a.data(), b.data(), nullptr, n, n, n, false, true); });
    gemm_tflops = 2.0 * n * n * static_cast<double>(n) / (gms * 1e-3) / 1e12;
    std::printf("measured ceilings: HBM copy %.0f GB/s, cuBLASLt bf16 GEMM 8192^3 %.1f TFLOP/s\n\n", hbm_gbs,
                gemm_tflops);
  }
  std::printf("%-34s %10s %12s %10s %10s\n", "kernel", "ms", "GB/s", "TFLOP/s", "fraction");

  Buffer<bf16, Cuda> x(BT * C), y(BT * C), dx(BT * C), w(static_cast<std::size_t>(4) * C * C), bias(4 * C),
      dw(static_cast<std::size_t>(4) * C * C), dbias(4 * C), qkv(BT * 3 * C), dqkv(BT * 3 * C), h(BT * 4 * C),
      hpre(BT * 4 * C), dh(BT * 4 * C), lnw(C), lnb(C), dlnw(C), dlnb(C), wte(static_cast<std::size_t>(Vp) * C),
      wpe(static_cast<std::size_t>(T) * C), dwte(static_cast<std::size_t>(Vp) * C), dwpe(static_cast<std::size_t>(T) * C);
  Buffer<float, Cuda> mean(BT), rstd(BT), lse(static_cast<std::size_t>(B) * NH * T), losses(BT), total(1);
  Buffer<int, Cuda> tokens(BT);
  for (auto* b : {&x, &y, &dx, &w, &bias, &h, &hpre, &dh, &lnw, &lnb, &wte, &wpe}) fill(*b, 3, 1.0f, s);
  fill(qkv, 4, 1.0f, s);
  fill(dqkv, 5, 0.1f, s);
  tokens_kernel<<<64, 256, 0, s>>>(tokens.data(), BT, V);
  FIVED_CUDA_CHECK_LAUNCH("tokens_kernel");
  const int M = static_cast<int>(BT);

  // GEMMs of one block and the LM head (forward, and the two backward products of the MLP up-projection).
  row("matmul qkv  [8192,768]x[768,2304]+b", time_ms(s, [&] {
        ck::matmul(lt, qkv.data(), x.data(), w.data(), bias.data(), M, 3 * C, C, false, true);
      }), 0, 2.0 * M * 3 * C * C);
  row("matmul fc+gelu [..,768]x[768,3072]", time_ms(s, [&] {
        ck::matmul(lt, h.data(), x.data(), w.data(), bias.data(), M, 4 * C, C, false, true, false, ck::Epilogue::gelu,
                   hpre.data());
      }), 0, 2.0 * M * 4 * C * C);
  row("matmul proj [..,3072]x[3072,768]+b", time_ms(s, [&] {
        ck::matmul(lt, y.data(), h.data(), w.data(), bias.data(), M, C, 4 * C, false, true);
      }), 0, 2.0 * M * 4 * C * C);
  row("matmul fc dinp (dout*W)", time_ms(s, [&] {
        ck::matmul(lt, dx.data(), dh.data(), w.data(), nullptr, M, C, 4 * C, false, false);
      }), 0, 2.0 * M * 4 * C * C);
  row("matmul fc dW += dout^T*inp", time_ms(s, [&] {
        ck::matmul(lt, dw.data(), dh.data(), x.data(), nullptr, 4 * C, C, M, true, false, true);
      }), 0, 2.0 * M * 4 * C * C);
  // A linear layer's weight half as a step runs it: dW and the bias gradient, summed by the
  // GEMM's epilogue where cuBLASLt has it (the row says which ran), against the GEMM and then
  // bias_backward's pass over dy. fc (Conv1D [768,3072]) and attn's c_proj ([768,768]).
  for (const int out : {4 * C, C}) {
    bf16* dy = out == C ? dx.data() : dh.data();
    bool fused = false;
    const double with_epilogue = time_ms(s, [&] {
      fused = ck::matmul_weight_grad(lt, dw.data(), dbias.data(), dy, x.data(), M, C, out, false);
    });
    const double apart = time_ms(s, [&] {
      ck::matmul(lt, dw.data(), x.data(), dy, nullptr, C, out, M, true, false, true);
      ck::bias_backward(s, dbias.data(), dy, M, out);
    });
    const double flops = 2.0 * M * static_cast<double>(out) * C;
    row(out == C ? (fused ? "dW+db [768,768], db in epilogue" : "dW+db [768,768], no epilogue algo")
                 : (fused ? "dW+db [768,3072], db in epilogue" : "dW+db [768,3072], no epilogue algo"),
        with_epilogue, 0, flops);
    row(out == C ? "dW [768,768], then bias_backward" : "dW [768,3072], then bias_backward", apart, 0, flops);
  }
  // A mixture of experts padded to capacity (nn/moe.hpp): the 8192 rows split evenly over E
  // experts, each its own fc+GELU [768,3072], as a GEMM per expert (a loop, as before) and as
  // one strided batch. Fine-grained experts (E 32: 256 rows each) are where the loop's small
  // GEMMs leave the GPU idle.
  for (const int E : {8, 32}) {
    const int n = M / E;
    const std::int64_t in_rows = std::int64_t{n} * C, out_rows = std::int64_t{n} * 4 * C, wsize = std::int64_t{C} * 4 * C;
    Buffer<bf16, Cuda> we(static_cast<std::size_t>(E) * wsize), be(static_cast<std::size_t>(E) * 4 * C);
    fill(we, 7, 1.0f, s);
    fill(be, 8, 1.0f, s);
    const double loop = time_ms(s, [&] {
      for (int j = 0; j < E; ++j)
        ck::matmul(lt, h.data() + j * out_rows, x.data() + j * in_rows, we.data() + j * wsize, be.data() + j * 4 * C, n,
                   4 * C, C, false, false, false, ck::Epilogue::gelu, hpre.data() + j * out_rows);
    });
    const double batched = time_ms(s, [&] {
      ck::matmul(lt, h.data(), x.data(), we.data(), be.data(), n, 4 * C, C, false, false, false, ck::Epilogue::gelu,
                 hpre.data(), {.count = E, .out = out_rows, .a = in_rows, .b = wsize, .bias = 4 * C, .pre_act = out_rows});
    });
    const double flops = 2.0 * M * 4 * C * C;
    row(E == 8 ? "experts fc+gelu 8x1024, a GEMM each" : "experts fc+gelu 32x256, a GEMM each", loop, 0, flops);
    row(E == 8 ? "experts fc+gelu 8x1024, one batch" : "experts fc+gelu 32x256, one batch", batched, 0, flops);
  }
  // c_proj's dx, the gradient at the hidden units [8192,3072]: plainly (then "gelu bwd" below
  // takes it through the GELU), and with GELU's backward in the GEMM as the MLP runs it now.
  row("matmul proj dinp [..,768]x[768,3072]", time_ms(s, [&] {
        ck::matmul(lt, dh.data(), y.data(), w.data(), nullptr, M, 4 * C, C, false, true);
      }), 0, 2.0 * M * 4 * C * C);
  row("matmul proj dinp + GELU bwd (DGELU)", time_ms(s, [&] {
        ck::matmul_dgelu(lt, dh.data(), y.data(), w.data(), hpre.data(), M, 4 * C, C, false, true);
      }), 0, 2.0 * M * 4 * C * C);
  {
    Buffer<bf16, Cuda> logits(BT * Vp);
    fill(logits, 6, 1.0f, s);
    row("matmul lm head [..,768]x[768,50304]", time_ms(s, [&] {
          ck::matmul(lt, logits.data(), x.data(), wte.data(), nullptr, M, Vp, C, false, true);
        }), 0, 2.0 * M * static_cast<double>(Vp) * C);
    // in place over the logits: the values stay finite (dlogits are small), each run reads and writes N*Vp
    row("crossentropy fused fwd+bwd", time_ms(s, [&] {
          ck::crossentropy_forward_backward(s, losses.data(), logits.data(), logits.data(), tokens.data(), M, Vp, V,
                                            1.0f / M);
        }), 2.0 * e * BT * Vp, 0);
    // The kernel that reads each row twice (what ran before the row was staged in shared
    // memory; still what rows too wide for two blocks an SM run), timed the same way.
    const bool staged = ck::detail::staged_row_bytes<__nv_bfloat16>(static_cast<int>(Vp)) > 0;
    row(staged ? "crossentropy, row read twice (before)" : "crossentropy, row read twice (no stage)", time_ms(s, [&] {
          ck::detail::crossentropy_rows_kernel<__nv_bfloat16, ck::detail::ce_block>
              <<<static_cast<unsigned>(M), ck::detail::ce_block, 0, s>>>(
                  losses.data(), ck::dev(logits.data()), nullptr, nullptr, nullptr, ck::dev(logits.data()),
                  tokens.data(), static_cast<int>(Vp), V, 1.0f / M);
          FIVED_CUDA_CHECK_LAUNCH("crossentropy_rows_kernel");
        }), 2.0 * e * BT * Vp, 0);
  }
  row("bias_backward [8192,3072]", time_ms(s, [&] { ck::bias_backward(s, dbias.data(), dh.data(), M, 4 * C); }),
      e * BT * 4 * C, 0);
  // What a plain copy of the same bytes reaches: the small kernels' ceiling at their size (the
  // launch and the first and last waves weigh more at 25 MB than at the 2 GB of the HBM row above).
  row("copy [8192,768] bf16 (reference)",
      time_ms(s, [&] { copy_bytes(s, prop, y.data(), x.data(), BT * C * sizeof(bf16)); }), 2.0 * e * BT * C, 0);
  row("layernorm fwd", time_ms(s, [&] {
        ck::layernorm_forward(s, y.data(), mean.data(), rstd.data(), x.data(), lnw.data(), lnb.data(), M, C);
      }), 2.0 * e * BT * C, 0);
  {
    // The residual add a block makes before ln_2, fused into it (as a step runs it), against the
    // two kernels it replaced: both read a and b and write res and out (4 x [8192,768]).
    Buffer<bf16, Cuda> res(BT * C);
    row("residual + layernorm fwd, fused", time_ms(s, [&] {
          ck::residual_layernorm_forward(s, res.data(), y.data(), mean.data(), rstd.data(), x.data(), dx.data(),
                                         lnw.data(), lnb.data(), M, C);
        }), 4.0 * e * BT * C, 0);
    row("residual, then layernorm fwd (before)", time_ms(s, [&] {
          ck::residual_forward(s, res.data(), x.data(), dx.data(), BT * C);
          ck::layernorm_forward(s, y.data(), mean.data(), rstd.data(), res.data(), lnw.data(), lnb.data(), M, C);
        }), 4.0 * e * BT * C, 0);
  }
  // One pass for dinp and the weight gradients, as a step runs it; then the split backward's
  // two calls (dinp now, the weight half later), which read dout and inp twice: what a step
  // ran before.
  row("layernorm bwd", time_ms(s, [&] {
        ck::layernorm_backward(s, dx.data(), dlnw.data(), dlnb.data(), y.data(), x.data(), lnw.data(), mean.data(),
                               rstd.data(), M, C);
      }), 4.0 * e * BT * C, 0);  // read dout, inp, dinp; write dinp
  row("layernorm bwd, dinp then dw/db (split)", time_ms(s, [&] {
        ck::layernorm_backward(s, dx.data(), static_cast<bf16*>(nullptr), static_cast<bf16*>(nullptr), y.data(),
                               x.data(), lnw.data(), mean.data(), rstd.data(), M, C);
        ck::layernorm_backward(s, static_cast<bf16*>(nullptr), dlnw.data(), dlnb.data(), y.data(), x.data(),
                               static_cast<const bf16*>(nullptr), mean.data(), rstd.data(), M, C);
      }), 4.0 * e * BT * C, 0);  // the same bytes as above: its rate against the one pass's
  {
    // The row kernels again over 8x the rows (100 MB a tensor), where the launch and the first
    // and last waves weigh little: what they stream when their size does not hold them back.
    constexpr std::size_t R = 8 * BT;
    const int MR = static_cast<int>(R);
    Buffer<bf16, Cuda> a(R * C), b(R * C), o(R * C), g(R * C);
    Buffer<float, Cuda> rm(R), rr(R);
    for (auto* t : {&a, &b, &g}) fill(*t, 8, 1.0f, s);
    std::printf("# at 8x the rows, [65536,768]:\n");
    row("copy (reference)", time_ms(s, [&] { copy_bytes(s, prop, o.data(), a.data(), R * C * sizeof(bf16)); }),
        2.0 * e * R * C, 0);
    row("layernorm fwd", time_ms(s, [&] {
          ck::layernorm_forward(s, o.data(), rm.data(), rr.data(), a.data(), lnw.data(), lnb.data(), MR, C);
        }), 2.0 * e * R * C, 0);
    row("residual + layernorm fwd, fused", time_ms(s, [&] {
          ck::residual_layernorm_forward(s, b.data(), o.data(), rm.data(), rr.data(), a.data(), g.data(), lnw.data(),
                                         lnb.data(), MR, C);
        }), 4.0 * e * R * C, 0);
    row("layernorm bwd", time_ms(s, [&] {
          ck::layernorm_backward(s, g.data(), dlnw.data(), dlnb.data(), o.data(), a.data(), lnw.data(), rm.data(),
                                 rr.data(), MR, C);
        }), 4.0 * e * R * C, 0);
    row("residual", time_ms(s, [&] { ck::residual_forward(s, o.data(), a.data(), g.data(), R * C); }),
        3.0 * e * R * C, 0);
    std::printf("# back at [8192,768] and the step's other shapes:\n");
  }
  row("gelu fwd [8192,3072]", time_ms(s, [&] { ck::gelu_forward(s, h.data(), hpre.data(), BT * 4 * C); }),
      2.0 * e * BT * 4 * C, 0);
  row("gelu bwd [8192,3072]", time_ms(s, [&] { ck::gelu_backward(s, dh.data(), hpre.data(), dh.data(), BT * 4 * C); }),
      3.0 * e * BT * 4 * C, 0);
  row("residual [8192,768]", time_ms(s, [&] { ck::residual_forward(s, y.data(), x.data(), dx.data(), BT * C); }),
      3.0 * e * BT * C, 0);
  row("embedding fwd", time_ms(s, [&] {
        ck::embedding_forward(s, x.data(), tokens.data(), wte.data(), 0, Vp, wpe.data(), B, T, C);
      }), 3.0 * e * BT * C, 0);
  row("embedding bwd (sorted, deterministic)", time_ms(s, [&] {
        ck::embedding_backward(s, dwte.data(), dwpe.data(), y.data(), tokens.data(), B, T, C, 0, Vp);
      }), 3.0 * e * BT * C, 0);  // read dout; read+write the touched dwte rows (~BT rows)
  {  // Ids as in text: a few ids take a large share of the positions (the ids above are all distinct)
    const TextLikeIds ids = text_like_ids(BT, V);
    Buffer<int, Cuda> text(std::span<const int>(ids.ids), s);
    std::printf("# text-like ids: %d distinct among %zu, the most frequent %d times\n", ids.distinct, BT, ids.most);
    row("embedding bwd, text-like ids", time_ms(s, [&] {
          ck::embedding_backward(s, dwte.data(), dwpe.data(), y.data(), text.data(), B, T, C, 0, Vp);
        }), e * C * (BT + 2.0 * ids.distinct), 0);  // read dout; read+write the distinct rows
  }
  {
    const double attn_fwd_flops = 4.0 * B * NH * static_cast<double>(T) * T * (C / NH) / 2;  // causal half
    Buffer<bf16, Cuda> out(BT * C), dout(BT * C);
    fill(dout, 7, 1.0f, s);
    const double own_fwd = time_ms(s, [&] {
      ck::attention_forward(s, out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
    });
    const double own_bwd = time_ms(s, [&] {
      ck::attention_backward(s, dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH, NH);
    });
    const bool tc = ck::attention_on_tensor_cores<bf16>(C, NH, NH);
    row(tc ? "attention fwd (fived's, tensor cores)" : "attention fwd (fived's, scalar)", own_fwd, 0, attn_fwd_flops);
    row(tc ? "attention bwd (fived's, tensor cores)" : "attention bwd (fived's, scalar)", own_bwd, 0,
        2.5 * attn_fwd_flops);
    {  // Packed documents (context/documents.hpp): 4 of 256 tokens a row, a quarter of the causal work
      constexpr int doc = 256;
      std::vector<int> starts(BT);
      for (std::size_t i = 0; i < BT; ++i) starts[i] = static_cast<int>(i % T) / doc * doc;
      Buffer<int, Cuda> first(std::span<const int>(starts), s);
      const double packed_fwd = time_ms(s, [&] {
        ck::attention_forward(s, out.data(), lse.data(), qkv.data(), B, T, C, NH, NH, first.data());
      });
      const double packed_bwd = time_ms(s, [&] {
        ck::attention_backward(s, dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH, NH,
                               first.data());
      });
      const double packed_flops = attn_fwd_flops * doc / T;  // T/doc documents of doc^2/2 each
      row("attention fwd, 4 documents a row", packed_fwd, 0, packed_flops);
      row("attention bwd, 4 documents a row", packed_bwd, 0, 2.5 * packed_flops);
    }
#if defined(FIVED_WITH_CUDNN)
    ck::CudnnAttention cudnn(s);
    const double cudnn_fwd = time_ms(s, [&] { cudnn.forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NH); });
    const double cudnn_bwd = time_ms(s, [&] {
      cudnn.backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH, NH);
    });
    row("attention fwd (cuDNN)", cudnn_fwd, 0, attn_fwd_flops);
    row(cudnn.deterministic() ? "attention bwd (cuDNN, deterministic)" : "attention bwd (cuDNN)", cudnn_bwd, 0,
        2.5 * attn_fwd_flops);
    std::printf("%-34s %10s %12s %10s %9.0f%%  of cuDNN's rate (fwd+bwd)\n", "fived's attention kernel", "", "", "",
                100.0 * (cudnn_fwd + cudnn_bwd) / (own_fwd + own_bwd));
#else
    std::puts("attention through cuDNN: not built (cuDNN or the cudnn-frontend headers not found)");
#endif
  }
  {
    Buffer<bf16, Cuda> p(params), g(params);
    Buffer<float, Cuda> master(params), m(params), v(params);
    fill(g, 8, 0.01f, s);
    fill(master, 9, 0.1f, s);
    row("adamw 124M params (bf16 + fp32 master)", time_ms(s, [&] {
          ck::adamw_update(s, p.data(), master.data(), g.data(), m.data(), v.data(), params, 6e-4f, 0.9f, 0.95f, 1e-8f,
                           0.1f, 1);
        }), (2 + 4 + 4 + 4 + 2 + 4 + 4 + 4) * static_cast<double>(params), 0);
    // As a training step runs it over GPT-2's 148 tensors (weight decay on the 2-D ones, the
    // clip factor applied): the launch per tensor it used to make, then the one launch over
    // chunks (optim/adamw.hpp) it makes now.
    using Layout = fived::GPT<fived::gpt_config>::layout;
    static_assert(Layout::size == 124475904, "the bench's GPT-2 has 124,475,904 parameters");
    const std::vector<fived::AdamWChunk> chunks = fived::adamw_chunks(Layout::tensors, {0, Layout::size});
    Buffer<fived::AdamWChunk, Cuda> dchunks(std::span<const fived::AdamWChunk>(chunks), s);
    const double adamw_bytes = (2 + 4 + 4 + 4 + 2 + 4 + 4 + 4) * static_cast<double>(params);
    // The clip as a step gives it: a squared norm of 4 in device memory, max_norm 1 (factor ~0.5).
    Buffer<double, Cuda> norm_total(std::span<const double>(std::vector<double>{4.0}), s);
    const fived::GradClip clip{norm_total.data(), 1.0};
    // Step 1's learning rate and bias corrections, in device memory as AdamW uploads them.
    const Buffer<fived::AdamWStep, Cuda> step1(
        std::span<const fived::AdamWStep>(std::vector<fived::AdamWStep>{fived::AdamWStep::at(1, 6e-4, 0.9, 0.95)}), s);
    row("adamw GPT-2, a launch per tensor", time_ms(s, [&] {
          for (const auto& t : Layout::tensors)
            ck::adamw_update(s, p.data() + t.offset, master.data() + t.offset, g.data() + t.offset,
                             m.data() + t.offset, v.data() + t.offset, t.size(), 6e-4, 0.9, 0.95, 1e-8,
                             t.decays() ? 0.1 : 0.0, 1, 0.5);
        }), adamw_bytes, 0);
    row("adamw GPT-2, one launch (chunks)", time_ms(s, [&] {
          ck::adamw_update_chunks(s, p.data(), master.data(), g.data(), m.data(), v.data(), dchunks.data(),
                                  chunks.size(), step1.data(), 0.9, 0.95, 1e-8, 0.1, clip);
        }), adamw_bytes, 0);
    // As a step makes them: a launch per bucket (DataParallel's default 4 MiB of bf16), each
    // over that bucket's chunks. A launch lasts as long as its slowest block, so this row is
    // the one that shows chunks too long (32Ki elements cost a GPT-2 step 4 ms on an H200).
    using Plan = fived::BucketPlan<Layout, 1, sizeof(bf16), std::size_t{4} << 20>;
    std::vector<Buffer<fived::AdamWChunk, Cuda>> bucket_chunks;  // bucket i's, as AdamW cuts them
    for (std::size_t i = 0; i < Plan::count; ++i)
      bucket_chunks.emplace_back(std::span<const fived::AdamWChunk>(
                                     fived::adamw_chunks(Layout::tensors, Plan::bucket(i).range)), s);
    row("adamw GPT-2, a launch per bucket", time_ms(s, [&] {
          for (std::size_t i = 0; i < Plan::count; ++i) {
            const std::size_t o = Plan::bucket(i).range.begin;
            ck::adamw_update_chunks(s, p.data() + o, master.data() + o, g.data() + o, m.data() + o, v.data() + o,
                                    bucket_chunks[i].data(), bucket_chunks[i].size(), step1.data(), 0.9, 0.95, 1e-8,
                                    0.1, clip);
          }
        }), adamw_bytes, 0);
    row("grad sum_of_squares 124M", time_ms(s, [&] { ck::sum_of_squares(s, total.data(), g.data(), params); }),
        e * params, 0);
    // The norm as a step takes it now: the gradient in SquaresChunk pieces, one launch and
    // the sum in order (train/bucket_trainer.hpp); before, two launches for each bucket.
    std::vector<fived::SquaresChunk> norm_chunks;
    for (std::size_t b = 0; b < params; b += fived::SquaresChunk::max_elements)
      norm_chunks.push_back({b, std::min<std::size_t>(params, b + fived::SquaresChunk::max_elements)});
    Buffer<fived::SquaresChunk, Cuda> dnorm_chunks(std::span<const fived::SquaresChunk>(norm_chunks), s);
    Buffer<double, Cuda> norm_partials(norm_chunks.size()), norm_out(1);
    Buffer<float, Cuda> partials(ck::sum_of_squares_partials);  // what Ops kept for the pair per bucket
    row("grad norm GPT-2, chunks (as a step)", time_ms(s, [&] {
          ck::sum_of_squares_chunks(s, norm_out.data(), norm_partials.data(), g.data(), dnorm_chunks.data(),
                                    norm_chunks.size());
        }), e * params, 0);
    row("grad norm GPT-2, a pair per bucket (before)", time_ms(s, [&] {
          for (std::size_t i = 0; i < Plan::count; ++i)
            ck::sum_of_squares(s, total.data(), g.data() + Plan::bucket(i).range.begin, Plan::bucket(i).range.size(),
                               partials.data());
        }), e * params, 0);
    row("grad scale 124M", time_ms(s, [&] { ck::scale(s, g.data(), params, 0.999f); }), 2.0 * e * params, 0);
  }
  FIVED_CUDA_CHECK(cudaStreamSynchronize(s));
  return 0;
}
