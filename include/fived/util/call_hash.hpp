#pragma once
// call_hash(args...): the FNV-1a hash of the bytes of a call's arguments (pointers, sizes,
// scalars, small structs without padding). A step captured as a graph (nn/step_graph.hpp)
// knows each of its calls by it, and a replayed call with other arguments is refused.

#include <cstdint>
#include <span>
#include <type_traits>

#include "fived/util/fnv.hpp"

namespace fived {

template <class... A>
std::uint64_t call_hash(const A&... args) {
  util::Fnv1a64 h;
  [[maybe_unused]] auto add = [&h]<class X>(const X& x) {
    static_assert(std::is_trivially_copyable_v<X>, "fived::call_hash: an Ops call's arguments are trivially copyable");
    h.add(std::as_bytes(std::span<const X, 1>(&x, 1)));
  };
  (add(args), ...);
  return h.value();
}

}  // namespace fived
