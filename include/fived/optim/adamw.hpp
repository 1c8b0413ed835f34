#pragma once
// AdamW over ranges of a flat parameter buffer, on any device.
//
//   fived::AdamW<Model::layout, T, Device> opt({.lr = 2e-3f, .beta2 = 0.95f, .weight_decay = 0.1f, .max_norm = 1.0f}, owned);
//   opt.begin_step();                                                         // one step...
//   for (FlatRange r : opt.owned()) opt.update(model.ops(), params, grads, r);  // ...over each owned range
//
// The training step that clips the global norm and calls this (the one optimizer step of
// every path, serial included) is DataParallel's (train/data_parallel.hpp); this class is
// the state and the update. Layout is a parameter table (nn/param_table.hpp) or anything
// with `tensors` whose elements have offset, end() and decays(): weight decay applies to
// the tensors whose spec says so (2-D ones in a GPT, never biases and LayerNorms).
//
// Sharded use (ZeRO): an optimizer made for some ranges of the flat buffer (a rank's pieces
// of every bucket, train/bucket_plan.hpp) holds moments (and master weights) for those
// ranges only, one after the other. `params` and `grads` are indexed by the flat buffer's
// offsets minus `base` (update's last argument, 0 by default): a ZeRO-3 rank passes its
// piece of a bucket with base = the piece's first offset.
//
// Precision: the state (moments, masters) is state_type = adamw_state_t<T>: double for a
// double model (exact to a double's precision, the reference every other run is checked
// against), fp32 otherwise. The hyperparameters are double and each kernel rounds them
// once. For T = float or double the update is done on the parameters themselves (no master
// copy). For any other T (bf16) the optimizer keeps fp32 master weights for its range,
// copied from the parameters on the first step, and writes T(master) back.
//
// Device: the state lives in Buffer<state_type, Device> (device memory on Cuda, allocated once
// here) and the update is the fused adamw_update kernel of the Ops passed to update(), queued
// on its stream; spans and ranges are device memory then (exp_avg() and friends too).

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/device/buffer.hpp"
#include "fived/kernels/host/adamw.hpp"
#include "fived/kernels/host/norm.hpp"
#include "fived/optim/flat_range.hpp"

namespace fived {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // on 2-D tensors only (see decays())
  double max_norm = 0.0;      // global gradient-norm clipping; 0 = off
};

template <class Layout, class T = float, class Device = Host>
class AdamW {
 public:
  using layout = Layout;
  using value_type = T;
  using device = Device;
  using state_type = adamw_state_t<T>;
  // No fp32 master copy for float (it is the master) and double (gradient checks).
  static constexpr bool has_master = !(std::is_same_v<T, float> || std::is_same_v<T, double>);

  AdamWConfig hp;

  // Moments (and master weights) for `owned`, a range of the flat buffer; by default all of it.
  explicit AdamW(const AdamWConfig& config = {}, FlatRange owned = {0, Layout::size})
      : AdamW(config, std::vector<FlatRange>{owned}) {}
  // ... or for several ranges, stored one after the other.
  AdamW(const AdamWConfig& config, std::vector<FlatRange> owned) : hp(config), owned_(std::move(owned)) {
    std::size_t n = 0;
    for (const FlatRange& r : owned_) {
      if (r.end > Layout::size || r.begin > r.end)
        throw std::invalid_argument("fived::AdamW: owned range [" + std::to_string(r.begin) + ", " +
                                    std::to_string(r.end) + ") is not inside the layout's " +
                                    std::to_string(Layout::size) + " elements");
      start_.push_back(n);
      n += r.size();
    }
    m_ = Buffer<state_type, Device>(n);  // zeroed
    v_ = Buffer<state_type, Device>(n);
    if constexpr (has_master) master_ = Buffer<state_type, Device>(n);
    master_ready_.assign(owned_.size(), false);
  }

  std::span<const FlatRange> owned() const { return owned_; }
  std::size_t owned_size() const { return m_.size(); }  // elements, over all owned ranges
  int step_count() const { return step_; }  // steps taken (the next step is step_count() + 1)
  std::span<const state_type> exp_avg() const { return m_.span(); }     // first moments of owned(), in order
  std::span<const state_type> exp_avg_sq() const { return v_.span(); }  // second moments of owned(), in order
  std::span<const state_type> master() const { return master_.span(); } // empty unless has_master
  // Bytes of optimizer state held (moments, master weights).
  std::size_t state_bytes() const { return (m_.size() + v_.size() + master_.size()) * sizeof(state_type); }

  // Where the state of r (inside one owned range) starts in exp_avg(), exp_avg_sq(), master().
  std::size_t state_offset(FlatRange r) const {
    const std::size_t k = range_holding(r);
    return start_[k] + (r.begin - owned_[k].begin);
  }
  // A resumed run's state (train/checkpoint.hpp): the step count and, over owned() in order,
  // the moments and (has_master) the fp32 masters, written with `ops` (an Ops<T, Device>).
  template <class Ops>
  void restore(Ops& ops, int step, std::span<const state_type> m, std::span<const state_type> v,
               std::span<const state_type> master) {
    if (m.size() != m_.size() || v.size() != v_.size() || master.size() != master_.size() || step < 0)
      throw std::invalid_argument("fived::AdamW::restore: the state has " + std::to_string(m.size()) + " moments for " +
                                  std::to_string(m_.size()) + " owned elements (and " + std::to_string(master.size()) +
                                  " masters for " + std::to_string(master_.size()) + ")");
    ops.upload(m_.data(), m.data(), m.size());
    ops.upload(v_.data(), v.data(), v.size());
    if constexpr (has_master) ops.upload(master_.data(), master.data(), master.size());
    master_ready_.assign(owned_.size(), has_master);
    step_ = step;
  }

  // min(1, max_norm / (sqrt(total) + 1e-6)); 1 when clipping is off.
  double clip_factor(double total_sum_of_squares) const {
    return hp.max_norm > 0 ? kernels::host::clip_factor(total_sum_of_squares, hp.max_norm) : 1.0;
  }

  // ---- steps -----------------------------------------------------------------------------

  // Counts one step; update() then applies it range by range.
  void begin_step() { ++step_; }

  // The current step (begin_step) over r, which must lie inside one owned range, with the
  // kernels of `ops` (an Ops<T, Device>). The first update of an owned range must cover it
  // whole, since its fp32 masters (if any) start from the parameters. params[i - base] and
  // grads[i - base] are element i of the flat buffer.
  template <class Ops>
  void update(Ops& ops, std::span<T> params, std::span<const T> grads, FlatRange r, std::size_t base = 0) {
    static_assert(std::is_same_v<typename Ops::device, Device>, "fived::AdamW::update: the Ops' device is not the optimizer's");
    if (step_ == 0) throw std::logic_error("fived::AdamW::update: call begin_step() first");
    const std::size_t k = range_holding(r);
    if (r.begin < base) throw std::invalid_argument("fived::AdamW::update: the range starts before base");
    const FlatRange shifted{r.begin - base, r.end - base};
    check_span("update", "params", params.size(), shifted);
    check_span("update", "grads", grads.size(), shifted);
    if constexpr (has_master) {
      if (!master_ready_[k]) {  // the masters start from the parameters
        if (r != owned_[k])
          throw std::invalid_argument("fived::AdamW::update: the first update of an owned range must cover it whole");
        ops.to_fp32(master_.data() + start_[k], params.data() + shifted.begin, r.size());
      }
    }
    master_ready_[k] = true;
    for (const auto& t : Layout::tensors) {
      const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
      if (b >= e) continue;
      const std::size_t o = start_[k] + (b - owned_[k].begin);
      state_type* master = nullptr;
      if constexpr (has_master) master = master_.data() + o;
      ops.adamw_update(params.data() + (b - base), master, grads.data() + (b - base), m_.data() + o, v_.data() + o,
                       e - b, hp.lr, hp.beta1, hp.beta2, hp.eps, t.decays() ? hp.weight_decay : 0.0, step_);
    }
  }

 private:
  static void check_span(const char* fn, const char* what, std::size_t n, FlatRange r) {
    if (r.begin > r.end || r.end > n)
      throw std::invalid_argument(std::string("fived::AdamW::") + fn + ": range [" + std::to_string(r.begin) + ", " +
                                  std::to_string(r.end) + ") is outside " + what + " (" + std::to_string(n) +
                                  " elements)");
  }

  // The owned range that holds r.
  std::size_t range_holding(FlatRange r) const {
    for (std::size_t k = 0; k < owned_.size(); ++k)
      if (owned_[k].contains(r) && !owned_[k].empty()) return k;
    throw std::invalid_argument("fived::AdamW::update: range [" + std::to_string(r.begin) + ", " +
                                std::to_string(r.end) + ") is not inside any of the optimizer's " +
                                std::to_string(owned_.size()) + " owned ranges");
  }

  std::vector<FlatRange> owned_;
  std::vector<std::size_t> start_;  // where owned_[k]'s state starts in m_, v_, master_
  std::vector<bool> master_ready_;
  int step_ = 0;
  Buffer<state_type, Device> m_, v_, master_;
};

// The optimizer for a model type: AdamW over its layout, element type and device.
template <class Model>
using AdamWFor = AdamW<typename Model::layout, typename Model::value_type, typename Model::device>;

}  // namespace fived
