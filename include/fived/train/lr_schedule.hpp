#pragma once
// The learning rate of a step: linear warmup to the peak, then a cosine down to a floor.
//
//   WarmupCosine lr{.peak = 3e-4, .warmup = 100, .total = 5000, .floor = 0.1};
//   lr(1) == 3e-6 ... lr(100) == 3e-4 ... lr(5000) == 3e-5
//
// Steps count from 1. A pure function of the step, so a resumed run continues the same curve.

#include <algorithm>
#include <cmath>
#include <numbers>

namespace fived {

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

}  // namespace fived
