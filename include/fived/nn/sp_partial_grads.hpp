#pragma once
// Sequence parallelism's partial gradients, per unit.
//
// Under SP a rank holds only its rows of the stream, so the gradient of a replicated tensor
// that those rows feed (a norm's weight, a row-parallel layer's bias: specs with sp_partial)
// is only this rank's part of it. Those parts accumulate in one buffer per unit, packed in
// spec order, and are summed over TP once, when the unit's backward ends (finish: one
// all-reduce per unit, then added to the gradient buffer), instead of once per tensor.
//
//   SpPartialGrads<Layout, T, Device, sp> partial(ops);
//   T* g = partial.at(i);              // where tensor i's gradient accumulates, or null: the gradient buffer
//   partial.finish(u, tp_comm, ops, grads);   // unit u's parts summed over TP into grads
//
// Without SP (sp false) it holds nothing and does nothing.

#include <array>
#include <cstddef>

#include "fived/device/buffer.hpp"
#include "fived/nn/param_table.hpp"

namespace fived {

template <class Layout, class T, class Device, bool On>
class SpPartialGrads {
 public:
  template <class Ops>
  explicit SpPartialGrads(Ops& ops) {
    if constexpr (On)
      for (int u = 0; u < Layout::units; ++u) parts_[static_cast<std::size_t>(u)] = ops.template make_buffer<T>(size(u));
  }

  // Where tensor i's gradient accumulates: its unit's buffer when it is a partial one, else null.
  T* at(int i) {
    if constexpr (On) {
      const TensorSpec& s = Layout::specs[static_cast<std::size_t>(i)];
      if (s.sp_partial) return parts_[static_cast<std::size_t>(s.unit)].data() + offset[static_cast<std::size_t>(i)];
    }
    return nullptr;
  }

  // Unit u's backward is done: its parts summed over TP (one all-reduce) and added to the
  // gradient buffer `grads` (the layout's), then zeroed for the next backward.
  template <class Comm, class Ops>
  void finish(int u, Comm& tp_comm, Ops& ops, T* grads) {
    if constexpr (On) {
      Buffer<T, Device>& part = parts_[static_cast<std::size_t>(u)];
      if (part.size() == 0) return;
      tp_comm.all_reduce(part.span());
      for (int i = 0; i < Layout::count; ++i) {
        const ParamInfo& t = Layout::tensors[static_cast<std::size_t>(i)];
        if (!t.spec.sp_partial || t.spec.unit != u) continue;
        ops.residual_forward(grads + t.offset, grads + t.offset, part.data() + offset[static_cast<std::size_t>(i)],
                             t.size());
      }
      ops.zero(part);
    }
  }

 private:
  // Each partial tensor's place in its unit's buffer, and the buffers' sizes.
  static constexpr std::array<std::size_t, Layout::count> offset = [] {
    std::array<std::size_t, Layout::count> o{};
    std::array<std::size_t, Layout::units> next{};
    for (int i = 0; i < Layout::count; ++i) {
      const TensorSpec& s = Layout::specs[static_cast<std::size_t>(i)];
      if (!s.sp_partial) continue;
      o[static_cast<std::size_t>(i)] = next[static_cast<std::size_t>(s.unit)];
      next[static_cast<std::size_t>(s.unit)] += Layout::tensors[static_cast<std::size_t>(i)].size();
    }
    return o;
  }();
  static constexpr std::size_t size(int u) {
    std::size_t n = 0;
    for (int i = 0; i < Layout::count; ++i)
      if (Layout::specs[static_cast<std::size_t>(i)].sp_partial && Layout::specs[static_cast<std::size_t>(i)].unit == u)
        n += Layout::tensors[static_cast<std::size_t>(i)].size();
    return n;
  }

  std::array<Buffer<T, Device>, Layout::units> parts_{};
};

}  // namespace fived
