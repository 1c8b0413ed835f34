#pragma once
// AdamW over the flat parameter buffer of a GptLayout, on the host.
//
//   fived::AdamW<GPT<cfg>::layout> opt({.lr = 2e-3f, .beta2 = 0.95f, .weight_decay = 0.1f, .max_norm = 1.0f});
//   model.zero_grad(); model.forward(...); model.backward();
//   opt.step(model);                       // clip the global norm, then one AdamW step
//
// Hyper-parameters live in `opt.hp` (change `opt.hp.lr` between steps for a schedule).
// Weight decay is applied to 2-D tensors only (every ParamInfo with rank == 2: the linear
// weights, wte, wpe and lm_head), never to biases and LayerNorm parameters; this is the rule
// examples/train_gpt.cpp has always used (`t.rank == 2 ? 0.1f : 0.0f`). `decays(t)` says it.
//
// Sharded use (ZeRO): an optimizer made for some ranges of the flat buffer (a rank's pieces
// of every bucket, train/bucket_plan.hpp) holds moments (and master weights) for those
// ranges only, one after the other. The caller clips and steps range by range:
//
//   AdamW<L> opt(hp, {{b0, e0}, {b1, e1}});
//   double s = ...;                                             // sum of squares of every rank's part
//   const float f = opt.clip_factor(s);                         // scale the gradients by f if f < 1
//   opt.begin_step();                                           // one step...
//   for (FlatRange r : opt.owned()) opt.update(params, grads, r);  // ...over each owned range
//
// `params` and `grads` are indexed by the flat buffer's offsets minus `base` (update's last
// argument, 0 by default): a ZeRO-3 rank passes its piece of a bucket with base = the
// piece's first offset. Only elements in the range are read or written.
//
// Precision: moments are fp32. For T = float or double the update is done on the parameters
// themselves (kernels::host::adamw_update with no master copy). For any other T (bf16) the
// optimizer keeps fp32 master weights for its range, copied from the parameters on the first
// step, and writes T(master) back each step.
//
// Host only for now: the CUDA path of train_gpt keeps its own per-tensor loop over
// Ops<T, Cuda>::adamw_update.

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/kernels/host/adamw.hpp"
#include "fived/kernels/host/norm.hpp"
#include "fived/nn/layout.hpp"
#include "fived/optim/flat_range.hpp"

namespace fived {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // on 2-D tensors only (see decays())
  float max_norm = 0.0f;      // global gradient-norm clipping; 0 = off
};

template <class Layout, class T = float>
class AdamW {
 public:
  using layout = Layout;
  using value_type = T;
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
    m_.assign(n, 0.0f);
    v_.assign(n, 0.0f);
    if constexpr (has_master) master_.assign(n, 0.0f);
    master_ready_.assign(owned_.size(), false);
  }

  // The GPT-2 weight-decay rule: 2-D tensors decay, 1-D ones (biases, LayerNorm) do not.
  static constexpr bool decays(const ParamInfo& t) { return t.rank == 2; }

  std::span<const FlatRange> owned() const { return owned_; }
  std::size_t owned_size() const { return m_.size(); }  // elements, over all owned ranges
  int step_count() const { return step_; }  // steps taken (the next step is step_count() + 1)
  std::span<const float> exp_avg() const { return m_; }     // first moments of owned(), in order
  std::span<const float> exp_avg_sq() const { return v_; }  // second moments of owned(), in order
  std::span<const float> master() const { return master_; } // empty unless has_master
  // Bytes of optimizer state held (moments, master weights).
  std::size_t state_bytes() const { return (m_.size() + v_.size() + master_.size()) * sizeof(float); }

  // ---- clipping pieces -----------------------------------------------------------------

  // Sum of squares of grads[r] (flat-buffer offsets), in double.
  static double sum_of_squares(std::span<const T> grads, FlatRange r) {
    check_span("sum_of_squares", "grads", grads.size(), r);
    return kernels::host::sum_of_squares(grads.data() + r.begin, r.size());
  }
  // min(1, max_norm / (sqrt(total) + 1e-6)); 1 when clipping is off.
  float clip_factor(double total_sum_of_squares) const {
    return hp.max_norm > 0 ? kernels::host::clip_factor(total_sum_of_squares, hp.max_norm) : 1.0f;
  }
  // grads[r] *= clip_factor(total) when that is below 1. Returns the factor.
  float clip(std::span<T> grads, FlatRange r, double total_sum_of_squares) const {
    check_span("clip", "grads", grads.size(), r);
    const float f = clip_factor(total_sum_of_squares);
    if (f < 1.0f) kernels::host::scale(grads.data() + r.begin, r.size(), f);
    return f;
  }

  // ---- steps -----------------------------------------------------------------------------

  // One AdamW step over r (inside an owned range) without clipping; params and grads are
  // indexed by flat-buffer offsets. Counts one step.
  void step(std::span<T> params, std::span<const T> grads, FlatRange r) {
    begin_step();
    update(params, grads, r);
  }

  // Counts one step; update() then applies it range by range.
  void begin_step() { ++step_; }

  // The current step (begin_step) over r, which must lie inside one owned range; the first
  // update of an owned range must cover it whole, since its fp32 masters (if any) start from
  // the parameters. params[i - base] and grads[i - base] are element i of the flat buffer.
  void update(std::span<T> params, std::span<const T> grads, FlatRange r, std::size_t base = 0) {
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
        for (std::size_t i = r.begin; i < r.end; ++i) master_[start_[k] + i - r.begin] = static_cast<float>(params[i - base]);
      }
    }
    master_ready_[k] = true;
    for (const ParamInfo& t : Layout::tensors) {
      const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
      if (b >= e) continue;
      const std::size_t o = start_[k] + (b - owned_[k].begin);
      float* master = nullptr;
      if constexpr (has_master) master = master_.data() + o;
      kernels::host::adamw_update(params.data() + (b - base), master, grads.data() + (b - base), m_.data() + o,
                                  v_.data() + o, e - b, hp.lr, hp.beta1, hp.beta2, hp.eps,
                                  decays(t) ? hp.weight_decay : 0.0f, step_);
    }
  }

  // The whole model on one rank: clip model.grads() in place (global norm), then step.
  // Returns the clip factor (1 when not clipped).
  template <class Model>
  float step(Model& model) {
    static_assert(std::is_same_v<typename Model::layout, Layout> && std::is_same_v<typename Model::value_type, T>,
                  "fived::AdamW::step(model): the model's layout and element type must be the optimizer's");
    static_assert(Model::on_host, "fived::AdamW is host-only for now: on Cuda use Ops<T, Cuda>::adamw_update");
    const FlatRange all{0, Layout::size};
    if (owned_.size() != 1 || owned_[0] != all)
      throw std::logic_error("fived::AdamW::step(model): this optimizer owns a sub-range; use step(params, grads, range)");
    float f = 1.0f;
    if (hp.max_norm > 0) f = clip(model.grads(), all, sum_of_squares(model.grads(), all));
    step(model.params(), std::span<const T>(model.grads()), all);
    return f;
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
  std::vector<float> m_, v_, master_;
};

// The optimizer for a model type: AdamW over its layout and element type.
template <class Model>
using AdamWFor = AdamW<typename Model::layout, typename Model::value_type>;

}  // namespace fived
