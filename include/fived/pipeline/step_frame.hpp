#pragma once
// The frame of one optimizer step, the same for every schedule: the pipeline executor's
// (pipeline/executor.hpp) and the plain step's (DataParallel::step: the one-stage schedule
// Accumulate<M>, run in place). Over the trainers of a rank's chunks, each a DataParallel
// (train/data_parallel.hpp, the step in pieces):
//
//   StepFrame frame(M, std::tie(trainer0, trainer1), total);  // M micro-batches a step
//   frame.begin();                                      // each trainer's begin_step
//   ...the schedule's forwards, and each backward that writes chunk c's gradients:
//   frame.gradients(c, trainer_c, [&] { model.backward(trainer_c.hooks(), slot); });
//   frame.end();                                        // each trainer's end_micro_batches
//   frame.sum_of_squares(sum_over_ranks);               // the squared global gradient norm, into total
//   frame.update();                                     // the clip over every parameter, each AdamW step
//   ...then read the loss: the host's one wait, after all of the step is queued
//
// A step replayed as a graph (nn/step_graph.hpp: GraphStep) is known by graph_shape(): the
// batch's sizes and every trainer's hyperparameters but the learning rate, which AdamW
// uploads at every step. When one of them changes, the graph is captured again.
//
// gradients() brackets the backward with the trainer's begin_backward and end_backward and
// tells it whether this is the step's last for it (its M-th), where NoZeRO and ZeRO-1 reduce.
// sum_of_squares() adds the trainers' parts of the squared gradient norm into `total` (one
// double in the device's memory, which the caller keeps) and hands it to sum_over_ranks (the
// other pipeline stages' parts: an all-reduce over PP on the device; nothing without a
// pipeline); update() gives every trainer that total: one clip over every parameter, its
// factor computed by the AdamW kernels where they run. On a device the host waits for none
// of it: the norm, its collectives and the updates are queued behind the backward.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <tuple>

#include "fived/nn/step_graph.hpp"

namespace fived::pipeline {

template <class... Trainers>
class StepFrame {
 public:
  StepFrame(int micro_batches, std::tuple<Trainers&...> trainers, std::span<double> total)
      : M_(micro_batches), trainers_(trainers), total_(total) {}

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
  // The squared global gradient norm into total: the trainers' parts, then sum_over_ranks(total).
  template <class SumOverRanks>
  void sum_of_squares(SumOverRanks&& sum_over_ranks) {
    std::get<0>(trainers_).model().ops().zero(total_.data(), total_.size());
    each([&](auto& dp) { dp.add_grad_sum_of_squares(total_.data()); });
    sum_over_ranks(total_);
  }
  // Every trainer's clip to the global norm (sqrt of the total) and AdamW step.
  void update() {
    each([&](auto& dp) { dp.update(total_.data()); });
  }
  // What a step of `ids` token ids in micro-batches of [B, T] is known by as a graph.
  std::uint64_t graph_shape(std::size_t ids, int B, int T) {
    std::uint64_t h = call_hash(ids, B, T, M_);
    each([&](auto& dp) {
      if constexpr (requires { dp.optimizer().hp; }) {  // (a stand-in trainer has none)
        auto hp = dp.optimizer().hp;
        hp.lr = 0;
        h = call_hash(h, hp);
      }
    });
    return h;
  }

 private:
  template <class F>
  void each(F&& f) {
    std::apply([&](auto&... dp) { (f(dp), ...); }, trainers_);
  }

  int M_;
  std::tuple<Trainers&...> trainers_;
  std::span<double> total_;  // one double of device memory
  std::array<int, sizeof...(Trainers)> backwards_{};  // per chunk: backwards that wrote gradients this step
};

}  // namespace fived::pipeline
