#pragma once
// Sharded<T, Layout>: one rank's piece of a distributed tensor, in host memory,
// with the layout that says where it belongs.

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

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
}  // namespace detail

template <class T, class Layout>
class Sharded {
 public:
  using value_type = T;
  using layout_type = Layout;
  using placements = typename Layout::placements;

  Sharded(Layout layout, std::vector<T> local) : layout_(std::move(layout)), local_(std::move(local)) {
    detail::check_local_size(layout_, local_.size(), "Sharded", "the local buffer");
  }

  // This rank's piece of a global tensor (row-major). On a Partial axis the
  // rank with coordinate 0 holds the value and the others hold zeros, which is
  // one valid way to write a sum.
  static Sharded slice_of(Layout layout, std::span<const T> global) {
    if (static_cast<std::int64_t>(global.size()) != layout.global_size())
      throw std::invalid_argument("Sharded::slice_of: the global buffer holds " + std::to_string(global.size()) +
                                  " elements but the global shape needs " + std::to_string(layout.global_size()));
    std::vector<T> local(layout.local_size());
    if (holds_partial_value(layout.coord())) {
      const auto g = layout.global_shape(), l = layout.local_shape(), o = layout.offset();
      for (std::int64_t i = 0; i < layout.local_size(); ++i) {
        std::int64_t rest = i, gi = 0, stride = 1;
        for (std::size_t d = Layout::rank; d-- > 0;) {
          gi += (o[d] + rest % l[d]) * stride;
          rest /= l[d];
          stride *= g[d];
        }
        local[i] = global[gi];
      }
    }
    return Sharded(std::move(layout), std::move(local));
  }

  const Layout& layout() const { return layout_; }
  std::span<T> local() { return local_; }
  std::span<const T> local() const { return local_; }
  std::vector<T>& storage() { return local_; }
  const std::vector<T>& storage() const { return local_; }

 private:
  static bool holds_partial_value(const Coord& c) {
    for (Axis a : world_axes)
      if (Layout::placements::partial(a) && c[a] != 0) return false;
    return true;
  }

  Layout layout_;
  std::vector<T> local_;
};

// ShardedView<T, Layout>: the same as Sharded without owning the memory, for
// pieces that live inside a larger buffer (a model's flat parameter and
// gradient buffers). The viewed memory must outlive the view.
template <class T, class Layout>
class ShardedView {
 public:
  using value_type = T;
  using layout_type = Layout;
  using placements = typename Layout::placements;

  ShardedView(Layout layout, std::span<T> local) : layout_(std::move(layout)), local_(local) {
    detail::check_local_size(layout_, local_.size(), "ShardedView", "the viewed memory");
  }

  const Layout& layout() const { return layout_; }
  std::span<T> local() const { return local_; }
  // An owning copy (to hand to redistribute).
  Sharded<std::remove_const_t<T>, Layout> copy() const {
    return {layout_, std::vector<std::remove_const_t<T>>(local_.begin(), local_.end())};
  }

 private:
  Layout layout_;
  std::span<T> local_;
};

}  // namespace fived
