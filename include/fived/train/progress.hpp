#pragma once
// Progress lines of a training run, printed by one rank:
//
//     step     loss        lr   grad norm   tokens/s  tok/s/GPU   MFU%   mem/GPU
//       10   4.8312  1.00e-03       1.214      48213      12053      -   12.4 MiB
//
// Each line averages the steps since the last one (the loss over those not skipped, their count
// after the line when some were: "  (1 skipped)"). MFU is model FLOPs per token (6 per
// parameter a token meets, plus attention's 12·L·C·T) times tokens/s per GPU over the device's
// peak (device/peak.hpp on CUDA; none on the host backend, where the column shows "-").
// Memory is what the library's buffers hold on a GPU (rank); on the host backend, where the
// ranks are threads of one process, the process's buffers over the ranks.
//
// With a metrics file, every step is also a JSON line of its own (not averaged; full
// precision, so a loss read back is the loss the step returned; null where a value is not
// finite or there is no MFU; mfu a fraction, not a percentage; "skipped":true after the
// rest for a step AdamWConfig::skip_non_finite skipped), and so is every held-out evaluation:
//
//     {"step":10,"loss":4.83120012,"lr":0.001,"grad_norm":1.214,"seconds":0.0213,"tokens":1024,
//      "tokens_per_s":48075.1,"tokens_per_s_per_gpu":12018.8,"mfu":null,"memory_bytes":13002342}
//     {"step":20,"held_out_loss":2.3412,"batches":4}

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>

namespace fived {

struct StepReport {
  int step = 0;
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0;
  double tokens = 0;  // in the global batch
  bool skipped = false;  // nothing updated (AdamWConfig::skip_non_finite)
};

class ProgressLog {
 public:
  // ranks: GPUs (or host ranks) sharing the work; flops_per_token: the model's; peak: FLOP/s of
  // one device (0: no MFU); every: a line per `every` steps; metrics: the JSON lines (null:
  // none).
  ProgressLog(std::FILE* out, int ranks, double flops_per_token, double peak, int every, std::FILE* metrics = nullptr)
      : out_(out), metrics_(metrics), ranks_(ranks), flops_(flops_per_token), peak_(peak), every_(every < 1 ? 1 : every) {}

  void header() const {
    if (!out_) return;
    std::fprintf(out_, "%6s %8s %9s %10s %10s %10s %6s %11s\n", "step", "loss", "lr", "grad norm", "tokens/s",
                 "tok/s/GPU", "MFU%", "mem/GPU");
    std::fflush(out_);
  }

  // Adds a step (its metrics line); prints a line when `step` is a multiple of `every` or `last`.
  void add(const StepReport& r, std::size_t memory_bytes, bool last = false) {
    if (metrics_) {
      const double tps = r.seconds > 0 ? r.tokens / r.seconds : 0;
      std::fprintf(metrics_, "{\"step\":%d,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,\"seconds\":%s,\"tokens\":%.0f,"
                   "\"tokens_per_s\":%s,\"tokens_per_s_per_gpu\":%s,\"mfu\":%s,\"memory_bytes\":%zu%s}\n",
                   r.step, json(r.loss).c_str(), json(r.lr).c_str(), json(r.grad_norm).c_str(), json(r.seconds).c_str(),
                   r.tokens, json(tps).c_str(), json(tps / ranks_).c_str(), json(mfu(tps)).c_str(), memory_bytes,
                   r.skipped ? ",\"skipped\":true" : "");
      std::fflush(metrics_);
    }
    if (r.skipped) ++skipped_;
    else loss_ += r.loss, ++n_;  // a skipped step's loss (nan, mostly) is not averaged
    seconds_ += r.seconds, tokens_ += r.tokens;
    if (r.step % every_ != 0 && !last) return;
    const double tps = seconds_ > 0 ? tokens_ / seconds_ : 0, per_gpu = tps / ranks_;
    if (out_) {
      char percent[16] = "-";
      if (const double m = mfu(tps); std::isfinite(m)) std::snprintf(percent, sizeof percent, "%.1f", 100 * m);
      std::fprintf(out_, "%6d %8.4f %9.2e %10.4g %10.0f %10.0f %6s %11s", r.step, n_ > 0 ? loss_ / n_ : std::nan(""),
                   r.lr, r.grad_norm, tps, per_gpu, percent, bytes(memory_bytes).c_str());
      if (skipped_ > 0) std::fprintf(out_, "  (%d skipped)", skipped_);
      std::fprintf(out_, "\n");
      std::fflush(out_);
    }
    loss_ = seconds_ = tokens_ = 0, n_ = skipped_ = 0;
  }

  // A held-out evaluation after `step`: "    20   held-out loss 2.3412 (4 batches)".
  void held_out(int step, double loss, int batches) const {
    if (metrics_) {
      std::fprintf(metrics_, "{\"step\":%d,\"held_out_loss\":%s,\"batches\":%d}\n", step, json(loss).c_str(), batches);
      std::fflush(metrics_);
    }
    if (!out_) return;
    std::fprintf(out_, "%6d   held-out loss %.4f (%d batch%s)\n", step, loss, batches, batches == 1 ? "" : "es");
    std::fflush(out_);
  }

  // x as a JSON number: the shortest text that reads back as x, in no locale's style
  // (std::to_chars), or null.
  static std::string json(double x) {
    if (!std::isfinite(x)) return "null";
    char s[32];
    return std::string(s, std::to_chars(s, s + sizeof s, x).ptr);
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
  // The fraction of the peak that tokens_per_s over every rank makes of each; NaN without a peak.
  double mfu(double tokens_per_s) const {
    return peak_ > 0 && flops_ > 0 ? flops_ * tokens_per_s / ranks_ / peak_ : std::nan("");
  }

  std::FILE* out_;
  std::FILE* metrics_;
  int ranks_;
  double flops_, peak_;
  int every_;
  double loss_ = 0, seconds_ = 0, tokens_ = 0;
  int n_ = 0, skipped_ = 0;
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
