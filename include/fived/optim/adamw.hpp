#pragma once
// AdamW over ranges of a flat parameter buffer, on any device.
//
//   fived::AdamW<Model::layout, T, Device> opt({.lr = 2e-3f, .beta2 = 0.95f, .weight_decay = 0.1f, .max_norm = 1.0f}, owned);
//   opt.begin_step(total_sum_of_squares);            // one step...
//   opt.update(model.ops(), params, grads);          // ...over every owned range, one launch
//
// The training step that clips the global norm and calls this (the one optimizer step of
// every path, serial included) is DataParallel's (train/data_parallel.hpp); this class is
// the state and the update. Layout is a parameter table (nn/param_table.hpp) or anything
// with `tensors` whose elements have offset, end() and decays(): weight decay applies to
// the tensors whose spec says so (2-D ones in a GPT, never biases and LayerNorms).
//
// Sharded use (ZeRO): an optimizer made for some ranges of the flat buffer (a rank's pieces
// of every bucket, train/bucket_plan.hpp) holds moments (and master weights) for those
// ranges only, one after the other. Each owned range says where update()'s `params` and
// `grads` hold it (OwnedRange: by default at its flat offsets, for the whole flat buffers):
// a ZeRO-2 rank's gradients, a ZeRO-3 rank's parameters too, are its pieces of the buckets,
// packed in a buffer of their own.
//
// Precision: the state (moments, masters) is state_type = adamw_state_t<T>: double for a
// double model (exact to a double's precision, the reference every other run is checked
// against), fp32 otherwise. The hyperparameters are double and each kernel rounds them
// once. For T = float or double the update is done on the parameters themselves (no master
// copy). For any other T (bf16) the optimizer keeps fp32 master weights for its range,
// copied from the parameters on the first step, and writes T(master) back.
//
// Device: the state lives in Buffer<state_type, Device> (device memory on Cuda, allocated once
// here) and the update of every owned range is one adamw_update_chunks of the Ops passed to
// update(), queued on its stream: the ranges cut once into chunks, each inside one tensor and
// with its weight decay (adamw_chunks, below), each chunk saying where its parameters,
// gradients and state are, so that one launch updates them all (a launch per bucket cost a
// GPT-2 step 68 of them on one GPU), the gradients multiplied by the step's clip
// factor as they are read (no pass of their own), the factor computed by the kernel from the
// squared global norm in device memory (kernels/host/adamw.hpp: GradClip): the host never
// reads the norm before the update. The step's learning rate and bias corrections go to the
// device's memory too (AdamWStep, uploaded by update()), so that the launch is the same at
// every step and a step captured as a graph replays it (nn/step_graph.hpp). Spans and
// ranges are device memory then (exp_avg() and friends too).

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
  // A step whose global gradient norm is not finite changes nothing (the kernels read the
  // norm: no parameter, moment or master moves), and once the host has seen that norm the
  // step is not counted either (forget_skipped_step, which Trainer::step calls; a
  // DataParallel used on its own leaves it to its caller): the bias corrections go on as if
  // the step had not been taken. Off: such a step's update is applied, and makes the
  // weights non-finite.
  bool skip_non_finite = false;
};

// The chunks of `range` (kernels/host/adamw.hpp: AdamWChunk), for tensors with offset, end()
// and decays() (nn/param_table.hpp), in order, offsets from range.begin: each inside one
// tensor, with its decay, at most AdamWChunk::max_elements long; elements of no tensor are
// left out. A device then updates a range of many tensors in one launch, a block per chunk,
// where a launch per tensor cost a GPT-2 step 148 launches, most of them for biases and
// norm weights of a few hundred elements.
template <class Tensors>
std::vector<AdamWChunk> adamw_chunks(const Tensors& tensors, FlatRange range) {
  std::vector<AdamWChunk> chunks;
  for (const auto& t : tensors) {
    const std::size_t b = std::max<std::size_t>(t.offset, range.begin), e = std::min<std::size_t>(t.end(), range.end);
    for (std::size_t c = b; c < e; c += AdamWChunk::max_elements)
      chunks.push_back({c - range.begin, std::min(e, c + AdamWChunk::max_elements) - range.begin, t.decays()});
  }
  return chunks;
}

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
      : AdamW(config, std::vector<OwnedRange>{{owned}}) {}
  // ... or for several ranges, stored one after the other, each where update() finds it.
  AdamW(const AdamWConfig& config, std::vector<OwnedRange> owned) : hp(config), places_(std::move(owned)) {
    std::size_t n = 0;
    for (const OwnedRange& o : places_) {
      const FlatRange r = o.range;
      if (r.end > Layout::size || r.begin > r.end)
        throw std::invalid_argument("fived::AdamW: owned range [" + std::to_string(r.begin) + ", " +
                                    std::to_string(r.end) + ") is not inside the layout's " +
                                    std::to_string(Layout::size) + " elements");
      owned_.push_back(r);
      start_.push_back(n);
      // Chunk offsets are state offsets; the parameters and gradients lie param/grad away.
      for (AdamWChunk c : adamw_chunks(Layout::tensors, r)) {
        c.begin += n, c.end += n;
        c.param = static_cast<std::ptrdiff_t>(o.param_at) - static_cast<std::ptrdiff_t>(n);
        c.grad = static_cast<std::ptrdiff_t>(o.grad_at) - static_cast<std::ptrdiff_t>(n);
        host_chunks_.push_back(c);
      }
      n += r.size();
      param_extent_ = std::max(param_extent_, o.param_at + r.size());
      grad_extent_ = std::max(grad_extent_, o.grad_at + r.size());
    }
    m_ = Buffer<state_type, Device>(n);  // zeroed
    v_ = Buffer<state_type, Device>(n);
    if constexpr (has_master) master_ = Buffer<state_type, Device>(n);
    chunks_ = Buffer<AdamWChunk, Device>(host_chunks_.size());
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
    master_ready_ = has_master;
    step_ = step;
  }

  // min(1, max_norm / (sqrt(total) + 1e-6)); 1 when clipping is off.
  double clip_factor(double total_sum_of_squares) const {
    return hp.max_norm > 0 ? kernels::host::clip_factor(total_sum_of_squares, hp.max_norm) : 1.0;
  }

  // ---- steps -----------------------------------------------------------------------------

  // Counts one step; update() then applies it to every owned range, each gradient multiplied as
  // it is read by clip_factor(*total_sum_of_squares), the squared global norm: one double in
  // the device's memory, read by the kernels (null: no clip).
  void begin_step(const double* total_sum_of_squares = nullptr) {
    ++step_;
    clip_ = {total_sum_of_squares, hp.max_norm, hp.skip_non_finite};
  }
  // The last step's update wrote nothing (skip_non_finite, its norm not finite): it is not
  // counted.
  void forget_skipped_step() {
    if (!hp.skip_non_finite || step_ == 0)
      throw std::logic_error("fived::AdamW::forget_skipped_step: only a step that skip_non_finite skipped is forgotten");
    --step_;
  }

  // The current step (begin_step) over every owned range, with the kernels of `ops` (an
  // Ops<T, Device>): one adamw_update_chunks. `params` and `grads` hold the owned ranges
  // where the constructor was told (OwnedRange). The first update starts the fp32 masters
  // (if any) from the parameters.
  template <class Ops>
  void update(Ops& ops, std::span<T> params, std::span<const T> grads) {
    static_assert(std::is_same_v<typename Ops::device, Device>, "fived::AdamW::update: the Ops' device is not the optimizer's");
    if (step_ == 0) throw std::logic_error("fived::AdamW::update: call begin_step() first");
    check_span("params", params.size(), param_extent_);
    check_span("grads", grads.size(), grad_extent_);
    if (!chunks_ready_) {  // the chunks of every owned range, cut in the constructor
      ops.upload(chunks_.data(), host_chunks_.data(), host_chunks_.size());
      chunks_ready_ = true;
    }
    if constexpr (has_master) {
      if (!master_ready_)
        for (std::size_t k = 0; k < places_.size(); ++k)
          ops.to_fp32(master_.data() + start_[k], params.data() + places_[k].param_at, owned_[k].size());
    }
    master_ready_ = true;
    const AdamWStep now = AdamWStep::at(step_, hp.lr, hp.beta1, hp.beta2);
    ops.upload(step_values_.data(), &now, 1);
    ops.adamw_update_chunks(params.data(), has_master ? master_.data() : nullptr, grads.data(), m_.data(), v_.data(),
                            chunks_.data(), host_chunks_.size(), step_values_.data(), hp.beta1, hp.beta2, hp.eps,
                            hp.weight_decay, clip_);
  }

 private:
  static void check_span(const char* what, std::size_t n, std::size_t needed) {
    if (n < needed)
      throw std::invalid_argument(std::string("fived::AdamW::update: ") + what + " holds " + std::to_string(n) +
                                  " elements, but the owned ranges reach element " + std::to_string(needed));
  }

  // The owned range that holds r.
  std::size_t range_holding(FlatRange r) const {
    for (std::size_t k = 0; k < owned_.size(); ++k)
      if (owned_[k].contains(r) && !owned_[k].empty()) return k;
    throw std::invalid_argument("fived::AdamW: range [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                ") is not inside any of the optimizer's " + std::to_string(owned_.size()) +
                                " owned ranges");
  }

  std::vector<OwnedRange> places_;
  std::vector<FlatRange> owned_;    // places_' ranges
  std::vector<std::size_t> start_;  // where owned_[k]'s state starts in m_, v_, master_
  std::vector<AdamWChunk> host_chunks_;  // every owned range's chunks, in order, state offsets
  std::size_t param_extent_ = 0, grad_extent_ = 0;  // the elements update()'s params and grads must hold
  bool master_ready_ = false;
  bool chunks_ready_ = false;  // uploaded into chunks_
  int step_ = 0;
  GradClip clip_;
  Buffer<state_type, Device> m_, v_, master_;
  Buffer<AdamWChunk, Device> chunks_;
  Buffer<AdamWStep, Device> step_values_{1};  // this step's learning rate and bias corrections, uploaded each update
};

// The optimizer for a model type: AdamW over its layout, element type and device.
template <class Model>
using AdamWFor = AdamW<typename Model::layout, typename Model::value_type, typename Model::device>;

}  // namespace fived
