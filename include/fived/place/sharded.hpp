#pragma once
// Sharded<T, Layout, Device>: one rank's piece of a distributed tensor, in a
// Buffer<T, Device>, with the layout that says where it belongs.
// ShardedView<T, Layout, Device>: the same over memory it does not own (a piece
// inside a model's flat parameter or gradient buffer, a preallocated output).
//
//   Sharded<float, L> x(layout, host_vector);              // Host (the default): host memory
//   Sharded<bf16, L, Cuda> y(layout);                     // zeroed device memory (include
//                                                         // <fived/device/cuda.hpp> first)
//   redistribute<Axis::tp, Replicate>(x.view(), out.view(), workspace, comm, ops);
//
// The layout is all redistribute needs to pick the collective; the memory is
// where that device's kernels and communicator read and write. On Cuda, local()
// is a span over device memory: it carries pointer and size to kernels and NCCL
// and must never be dereferenced on the host. The host conveniences (building
// from a std::vector, slice_of a global tensor, storage() as a std::vector) read
// and write the elements directly, so they exist for Host only.

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/device/buffer.hpp"
#include "fived/place/layout.hpp"

namespace fived {

namespace detail {
// A rank's piece must have the size its layout gives it.
template <class Layout>
void check_local_size(const Layout& layout, std::size_t have, const char* who, const char* what) {
  if (static_cast<std::int64_t>(have) != layout.local_size())
    throw std::invalid_argument(std::string(who) + ": " + what + " holds " + std::to_string(have) +
                                " elements but the layout's local shape needs " + std::to_string(layout.local_size()));
}

// Buffer<T, Cuda> is defined by device/cuda.hpp, which needs the CUDA runtime;
// a plain C++ translation unit sees only its declaration.
template <class B>
concept complete_buffer = requires { sizeof(B); };
}  // namespace detail

template <class T, class Layout, class Device = Host>
class ShardedView;

template <class T, class Layout, class Device = Host>
class Sharded {
  static_assert(!std::is_const_v<T>, "Sharded owns its elements: use ShardedView<const T, ...> for a read-only piece");
  static_assert(detail::complete_buffer<Buffer<T, Device>>,
                "Sharded<T, Layout, Cuda> keeps its piece in a Buffer<T, Cuda>: include <fived/device/cuda.hpp> first");

 public:
  using value_type = T;
  using layout_type = Layout;
  using device = Device;
  using placements = typename Layout::placements;

  // A zeroed piece of the layout's local shape (an output to redistribute into).
  explicit Sharded(Layout layout)
      : layout_(std::move(layout)), local_(static_cast<std::size_t>(layout_.local_size())) {}

  Sharded(Layout layout, Buffer<T, Device> local) : layout_(std::move(layout)), local_(std::move(local)) {
    detail::check_local_size(layout_, local_.size(), "Sharded", "the local buffer");
  }

  // A host piece holding a copy of `local` (a std::vector converts).
  Sharded(Layout layout, std::span<const T> local)
    requires std::is_same_v<Device, Host>
      : layout_(std::move(layout)) {
    detail::check_local_size(layout_, local.size(), "Sharded", "the local buffer");
    local_ = Buffer<T, Host>(local.size());
    std::copy(local.begin(), local.end(), local_.data());
  }

  // This rank's piece of a global tensor (row-major), on the host. On a Partial
  // axis the rank with coordinate 0 holds the value and the others hold zeros,
  // which is one valid way to write a sum.
  static Sharded slice_of(Layout layout, std::span<const T> global)
    requires std::is_same_v<Device, Host>
  {
    if (static_cast<std::int64_t>(global.size()) != layout.global_size())
      throw std::invalid_argument("Sharded::slice_of: the global buffer holds " + std::to_string(global.size()) +
                                  " elements but the global shape needs " + std::to_string(layout.global_size()));
    Sharded s(std::move(layout));
    const Layout& l = s.layout();
    if (holds_partial_value(l.coord())) {
      const auto g = l.global_shape(), shape = l.local_shape(), o = l.offset();
      T* local = s.local_.data();
      for (std::int64_t i = 0; i < l.local_size(); ++i) {
        std::int64_t rest = i, gi = 0, stride = 1;
        for (std::size_t d = Layout::rank; d-- > 0;) {
          gi += (o[d] + rest % shape[d]) * stride;
          rest /= shape[d];
          stride *= g[d];
        }
        local[i] = global[gi];
      }
    }
    return s;
  }

  const Layout& layout() const { return layout_; }
  // This rank's elements (device memory on Cuda: pointer and size, not for the host to read).
  std::span<T> local() { return local_.span(); }
  std::span<const T> local() const { return local_.span(); }
  T* data() { return local_.data(); }
  const T* data() const { return local_.data(); }
  Buffer<T, Device>& buffer() { return local_; }
  const Buffer<T, Device>& buffer() const { return local_; }

  ShardedView<T, Layout, Device> view() { return {layout_, local()}; }
  ShardedView<const T, Layout, Device> view() const { return {layout_, local()}; }

  // A host copy of the elements, as a std::vector (to compare or return by value).
  std::vector<T> storage() const
    requires std::is_same_v<Device, Host>
  {
    return {local_.data(), local_.data() + local_.size()};
  }

 private:
  static bool holds_partial_value(const Coord& c) {
    for (Axis a : world_axes)
      if (Layout::placements::partial(a) && c[a] != 0) return false;
    return true;
  }

  Layout layout_;
  Buffer<T, Device> local_;
};

// ShardedView<T, Layout, Device>: a pointer and size into memory of `Device`,
// with a layout. The viewed memory must outlive the view; T may be const.
template <class T, class Layout, class Device>
class ShardedView {
 public:
  using value_type = T;
  using layout_type = Layout;
  using device = Device;
  using placements = typename Layout::placements;

  ShardedView(Layout layout, std::span<T> local) : layout_(std::move(layout)), local_(local) {
    detail::check_local_size(layout_, local_.size(), "ShardedView", "the viewed memory");
  }
  // A writable view reads as a read-only one.
  template <class U>
    requires std::is_same_v<T, const U>
  ShardedView(const ShardedView<U, Layout, Device>& v)  // NOLINT(google-explicit-constructor)
      : layout_(v.layout()), local_(v.local()) {}

  const Layout& layout() const { return layout_; }
  std::span<T> local() const { return local_; }
  T* data() const { return local_.data(); }

  // An owning copy, on the host.
  Sharded<std::remove_const_t<T>, Layout, Host> copy() const
    requires std::is_same_v<Device, Host>
  {
    return {layout_, std::span<const T>(local_)};
  }
  // An owning copy on any device, copied by `ops` (an Ops<T, Device>: ops.copy(dst, src, n)).
  template <class Ops>
  Sharded<std::remove_const_t<T>, Layout, Device> copy(Ops&& ops) const {
    Sharded<std::remove_const_t<T>, Layout, Device> out(layout_);
    ops.copy(out.data(), static_cast<const std::remove_const_t<T>*>(local_.data()), local_.size());
    return out;
  }

 private:
  Layout layout_;
  std::span<T> local_;
};

}  // namespace fived
