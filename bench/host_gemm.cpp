// The host backend's GEMM (kernels/host/gemm.hpp) on one core: GFLOP/s per shape, type and
// operand layout, as a linear layer calls it forward (x W^T), for d(input) (dy W) and for
// d(weight) (dy^T x). The shapes are the demo's (examples/train_gpt: 320 rows a rank on
// dp2.tp2, d_model 64) and one of GPT-2 small's (1024 rows, 768 wide).
//
//   bench/host_gemm [--ms 300]    (each case repeated for at least that long)

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli.hpp"
#include "fived/device/bf16.hpp"
#include "fived/kernels/host/gemm.hpp"

namespace {

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr, "%s\nusage: host_gemm [--ms 300]\n", msg.c_str());
  std::exit(2);
}

struct Case {
  const char* what;
  int M, N, K;
  bool trans_a, trans_b;
};

template <class T>
double gflops(const Case& c, double ms) {
  std::vector<T> a(static_cast<std::size_t>(c.M) * c.K, T(0.5f)), b(static_cast<std::size_t>(c.K) * c.N, T(0.25f)),
      out(static_cast<std::size_t>(c.M) * c.N);
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  int calls = 0;
  do {
    fived::kernels::host::matmul(out.data(), a.data(), b.data(), nullptr, c.M, c.N, c.K, c.trans_a, c.trans_b);
    ++calls;
  } while (Clock::now() - start < std::chrono::duration<double, std::milli>(ms));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count() / calls;
  return 2.0 * c.M * c.N * c.K / seconds * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  double ms = 300;
  bench::parse_options(argc, argv, usage, [&](std::string_view name, auto value) {
    if (name == "--ms") ms = std::stod(value());
    else return false;
    return true;
  });
  const Case cases[] = {
      {"demo qkv, forward", 320, 96, 64, false, true},  {"demo fc, forward", 320, 128, 64, false, true},
      {"demo proj, d(input)", 320, 128, 64, false, false}, {"demo fc, d(weight)", 128, 64, 320, true, false},
      {"gpt2 fc, forward", 1024, 3072, 768, false, true}, {"gpt2 proj, d(input)", 1024, 768, 3072, false, false},
      {"gpt2 fc, d(weight)", 3072, 768, 1024, true, false},
  };
  std::printf("host GEMM, one core; GFLOP/s (2 M N K per call)\n");
  std::printf("%-22s %5s %5s %5s %4s  %8s %8s %8s\n", "case", "M", "N", "K", "op", "float", "double", "bf16");
  for (const Case& c : cases) {
    const std::string op = std::string(c.trans_a ? "T" : "N") + (c.trans_b ? "T" : "N");
    std::printf("%-22s %5d %5d %5d %4s  %8.2f %8.2f %8.2f\n", c.what, c.M, c.N, c.K, op.c_str(), gflops<float>(c, ms),
                gflops<double>(c, ms), gflops<fived::bf16>(c, ms));
  }
}
