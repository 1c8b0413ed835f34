#pragma once
// The learning rate of a step. The Trainer takes any callable `double(int step)`
// (LrSchedule); three shapes come with fived:
//
//   WarmupCosine lr{.peak = 3e-4, .warmup = 100, .total = 5000, .floor = 0.1};
//   lr(1) == 3e-6 ... lr(100) == 3e-4 ... lr(5000) == 3e-5
//   ConstantLr{3e-4}                                        // the same rate at every step
//   WarmupStableDecay{.peak = 3e-4, .warmup = 100, .total = 5000, .decay = 1000, .floor = 0}
//                                                           // warmup, flat, then linear to the floor
//
// Steps count from 1. Pure functions of the step, so a resumed run continues the same curve.

#include <algorithm>
#include <cmath>
#include <functional>
#include <numbers>

namespace fived {

using LrSchedule = std::function<double(int step)>;

struct WarmupCosine {
  double peak = 1e-3;  // the learning rate at the end of the warmup
  int warmup = 0;      // steps of linear warmup (0: start at the peak)
  int total = 1;       // the step the cosine ends at; later steps stay at the floor
  double floor = 0.1;  // the final rate as a fraction of the peak

  constexpr double operator()(int step) const {
    if (step <= warmup) return peak * static_cast<double>(std::max(step, 1)) / std::max(warmup, 1);
    const double progress = std::min(1.0, static_cast<double>(step - warmup) / std::max(1, total - warmup));
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
  }
};

struct ConstantLr {
  double rate = 1e-3;
  constexpr double operator()(int) const { return rate; }
};

// Warmup-stable-decay (MiniCPM's WSD): linear warmup to the peak, the peak until `decay`
// steps before `total`, then linear down to floor·peak at `total` (and after).
struct WarmupStableDecay {
  double peak = 1e-3;
  int warmup = 0;
  int total = 1;
  int decay = 1;       // the steps of the final decay
  double floor = 0.0;  // the final rate as a fraction of the peak

  constexpr double operator()(int step) const {
    if (step <= warmup) return peak * static_cast<double>(std::max(step, 1)) / std::max(warmup, 1);
    const int start = total - decay;
    if (step <= start) return peak;
    const double progress = std::min(1.0, static_cast<double>(step - start) / std::max(1, decay));
    return peak * (1.0 - (1.0 - floor) * progress);
  }
};

}  // namespace fived
