#pragma once
// The frame of one optimizer step, the same for every schedule: the pipeline executor's
// (pipeline/executor.hpp) and the plain step's (DataParallel::step: the one-stage schedule
// Accumulate<M>, run in place). Over the trainers of a rank's chunks, each a DataParallel
// (train/data_parallel.hpp, the step in pieces):
//
//   StepFrame frame(M, std::tie(trainer0, trainer1));   // M micro-batches a step
//   frame.begin();                                      // each trainer's begin_step
//   ...the schedule's forwards, and each backward that writes chunk c's gradients:
//   frame.gradients(c, trainer_c, [&] { model.backward(trainer_c.hooks(), slot); });
//   frame.end();                                        // each trainer's end_micro_batches
//   double sumsq = frame.sum_of_squares(sum_over_ranks); // the squared global gradient norm
//   ...read the loss (on a device the norm waited for the step's work already)
//   frame.update(sumsq);                                // the clip over every parameter, each AdamW step
//
// gradients() brackets the backward with the trainer's begin_backward and end_backward and
// tells it whether this is the step's last for it (its M-th), where NoZeRO and ZeRO-1 reduce.
// sum_of_squares() sums the trainers' parts of the squared gradient norm and hands the sum
// to sum_over_ranks (the other pipeline stages' parts: an all-reduce over PP; the sum itself
// without a pipeline); update() gives every trainer the total: one clip over every parameter.

#include <array>
#include <cstddef>
#include <tuple>

namespace fived::pipeline {

template <class... Trainers>
class StepFrame {
 public:
  StepFrame(int micro_batches, std::tuple<Trainers&...> trainers) : M_(micro_batches), trainers_(trainers) {}

  void begin() {
    backwards_.fill(0);
    each([](auto& dp) { dp.begin_step(); });
  }
  // A backward that writes chunk c's gradients (a whole backward, or a split one's weight half).
  template <class Trainer, class Backward>
  void gradients(int c, Trainer& dp, Backward&& backward) {
    dp.begin_backward(++backwards_[static_cast<std::size_t>(c)] == M_);
    backward();
    dp.end_backward();
  }
  void end() {
    each([](auto& dp) { dp.end_micro_batches(); });
  }
  // The squared global gradient norm: the trainers' parts (on a device the host waits for
  // them, the step's one wait: read the loss after this, not before, and the norm's kernels
  // are queued behind the backward instead of after an idle wait), summed by sum_over_ranks.
  template <class SumOverRanks>
  double sum_of_squares(SumOverRanks&& sum_over_ranks) {
    double sumsq = 0;
    each([&](auto& dp) { sumsq += dp.grad_sum_of_squares(); });
    return sum_over_ranks(sumsq);
  }
  // Every trainer's clip to the global norm (sqrt of sum_of_squares()) and AdamW step.
  void update(double total_sum_of_squares) {
    each([&](auto& dp) { dp.update(total_sum_of_squares); });
  }

 private:
  template <class F>
  void each(F&& f) {
    std::apply([&](auto&... dp) { (f(dp), ...); }, trainers_);
  }

  int M_;
  std::tuple<Trainers&...> trainers_;
  std::array<int, sizeof...(Trainers)> backwards_{};  // per chunk: backwards that wrote gradients this step
};

}  // namespace fived::pipeline
