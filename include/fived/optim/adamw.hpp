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
// Sharded use (ZeRO-1): an optimizer made for a sub-range [begin, end) of the flat buffer
// holds moments (and master weights) for that range only. The caller clips:
//
//   AdamW<L> opt(hp, {begin, end});
//   double s = AdamW<L>::sum_of_squares(grads, opt.owned());   // this rank's part
//   comm.all_reduce(std::span<double>(&s, 1));                  // every rank's part, once
//   opt.clip(grads, opt.owned(), s);                            // g *= clip factor (max_norm 0: no-op)
//   opt.step(params, grads, opt.owned());                       // params[begin, end) updated
//
// `params` and `grads` in the range variant are indexed by the FLAT BUFFER's offsets (they
// may be longer than the layout, e.g. a buffer padded for equal DP shards); only elements in
// the range are read or written.
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

namespace fived {

// [begin, end) of a flat buffer.
struct FlatRange {
  std::size_t begin = 0;
  std::size_t end = 0;
  constexpr std::size_t size() const { return end - begin; }
  constexpr bool empty() const { return end <= begin; }
  constexpr bool contains(const FlatRange& r) const { return r.begin >= begin && r.end <= end; }
  friend constexpr bool operator==(const FlatRange&, const FlatRange&) = default;
};

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
  explicit AdamW(const AdamWConfig& config = {}, FlatRange owned = {0, Layout::size}) : hp(config), owned_(owned) {
    if (owned.end > Layout::size || owned.begin > owned.end)
      throw std::invalid_argument("fived::AdamW: owned range [" + std::to_string(owned.begin) + ", " +
                                  std::to_string(owned.end) + ") is not inside the layout's " +
                                  std::to_string(Layout::size) + " elements");
    m_.assign(owned.size(), 0.0f);
    v_.assign(owned.size(), 0.0f);
    if constexpr (has_master) master_.assign(owned.size(), 0.0f);
  }

  // The GPT-2 weight-decay rule: 2-D tensors decay, 1-D ones (biases, LayerNorm) do not.
  static constexpr bool decays(const ParamInfo& t) { return t.rank == 2; }

  FlatRange owned() const { return owned_; }
  int step_count() const { return step_; }  // steps taken (the next step is step_count() + 1)
  std::span<const float> exp_avg() const { return m_; }     // first moments of owned()
  std::span<const float> exp_avg_sq() const { return v_; }  // second moments of owned()
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

  // One AdamW step over r (inside owned()) without clipping; params and grads are indexed by
  // flat-buffer offsets. Counts one step.
  void step(std::span<T> params, std::span<const T> grads, FlatRange r) {
    if (!owned_.contains(r))
      throw std::invalid_argument("fived::AdamW::step: range [" + std::to_string(r.begin) + ", " +
                                  std::to_string(r.end) + ") is not inside the optimizer's range [" +
                                  std::to_string(owned_.begin) + ", " + std::to_string(owned_.end) + ")");
    check_span("step", "params", params.size(), r);
    check_span("step", "grads", grads.size(), r);
    if constexpr (has_master) {
      if (step_ == 0)  // the masters start from the parameters
        for (std::size_t i = owned_.begin; i < owned_.end; ++i)
          master_[i - owned_.begin] = static_cast<float>(params[i]);
    }
    ++step_;
    for (const ParamInfo& t : Layout::tensors) {
      const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
      if (b >= e) continue;
      const std::size_t o = b - owned_.begin;
      float* master = nullptr;
      if constexpr (has_master) master = master_.data() + o;
      kernels::host::adamw_update(params.data() + b, master, grads.data() + b, m_.data() + o, v_.data() + o, e - b,
                                  hp.lr, hp.beta1, hp.beta2, hp.eps, decays(t) ? hp.weight_decay : 0.0f, step_);
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
    if (owned_ != all)
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

  FlatRange owned_;
  int step_ = 0;
  std::vector<float> m_, v_, master_;
};

// The optimizer for a model type: AdamW over its layout and element type.
template <class Model>
using AdamWFor = AdamW<typename Model::layout, typename Model::value_type>;

}  // namespace fived
