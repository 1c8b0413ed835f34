#pragma once
// Progress lines of a training run, printed by one rank:
//
//     step     loss        lr   grad norm   tokens/s  tok/s/GPU   MFU%   mem/GPU
//       10   4.8312  1.00e-03       1.214      48213      12053      -   12.4 MiB
//
// Each line averages the steps since the last one. MFU is model FLOPs per token (6 per
// parameter a token meets, plus attention's 12·L·C·T) times tokens/s per GPU over the device's
// peak (device/peak.hpp on CUDA; none on the host backend, where the column shows "-").
// Memory is what the library's buffers hold on a GPU (rank); on the host backend, where the
// ranks are threads of one process, the process's buffers over the ranks.

#include <cstddef>
#include <cstdio>
#include <string>

namespace fived {

struct StepReport {
  int step = 0;
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0;
  double tokens = 0;  // in the global batch
};

class ProgressLog {
 public:
  // ranks: GPUs (or host ranks) sharing the work; flops_per_token: the model's; peak: FLOP/s of
  // one device (0: no MFU); every: a line per `every` steps.
  ProgressLog(std::FILE* out, int ranks, double flops_per_token, double peak, int every)
      : out_(out), ranks_(ranks), flops_(flops_per_token), peak_(peak), every_(every < 1 ? 1 : every) {}

  void header() const {
    if (!out_) return;
    std::fprintf(out_, "%6s %8s %9s %10s %10s %10s %6s %11s\n", "step", "loss", "lr", "grad norm", "tokens/s",
                 "tok/s/GPU", "MFU%", "mem/GPU");
    std::fflush(out_);
  }

  // Adds a step; prints a line when `step` is a multiple of `every` or `last`.
  void add(const StepReport& r, std::size_t memory_bytes, bool last = false) {
    loss_ += r.loss, seconds_ += r.seconds, tokens_ += r.tokens, ++n_;
    if (r.step % every_ != 0 && !last) return;
    const double tps = seconds_ > 0 ? tokens_ / seconds_ : 0, per_gpu = tps / ranks_;
    if (out_) {
      char mfu[16] = "-";
      if (peak_ > 0 && flops_ > 0) std::snprintf(mfu, sizeof mfu, "%.1f", 100.0 * flops_ * per_gpu / peak_);
      std::fprintf(out_, "%6d %8.4f %9.2e %10.4g %10.0f %10.0f %6s %11s\n", r.step, loss_ / n_, r.lr, r.grad_norm, tps,
                   per_gpu, mfu, bytes(memory_bytes).c_str());
      std::fflush(out_);
    }
    loss_ = seconds_ = tokens_ = 0, n_ = 0;
  }

  // A held-out evaluation after `step`: "    20   held-out loss 2.3412 (4 batches)".
  void held_out(int step, double loss, int batches) const {
    if (!out_) return;
    std::fprintf(out_, "%6d   held-out loss %.4f (%d batch%s)\n", step, loss, batches, batches == 1 ? "" : "es");
    std::fflush(out_);
  }

  static std::string bytes(std::size_t b) {
    const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = static_cast<double>(b);
    int u = 0;
    while (v >= 1024 && u < 4) v /= 1024, ++u;
    char s[32];
    std::snprintf(s, sizeof s, "%.1f %s", v, unit[u]);
    return s;
  }

 private:
  std::FILE* out_;
  int ranks_;
  double flops_, peak_;
  int every_;
  double loss_ = 0, seconds_ = 0, tokens_ = 0;
  int n_ = 0;
};

// A one-line bar for long loading or evaluation, redrawn in place: "loading   [#####     ]  50%".
inline void progress_bar(std::FILE* out, const char* what, std::size_t done, std::size_t total) {
  if (!out || total == 0) return;
  const int width = 30, filled = static_cast<int>(static_cast<double>(done) / static_cast<double>(total) * width);
  std::fprintf(out, "\r%-12s [%s%s] %3d%%", what, std::string(static_cast<std::size_t>(filled), '#').c_str(),
               std::string(static_cast<std::size_t>(width - filled), ' ').c_str(),
               static_cast<int>(100.0 * static_cast<double>(done) / static_cast<double>(total)));
  if (done >= total) std::fprintf(out, "\n");
  std::fflush(out);
}

}  // namespace fived
