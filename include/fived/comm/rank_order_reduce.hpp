#pragma once
// The host transports' reduction: contributions added in group-rank order, so
// every rank gets bit-identical values, run after run, and processes get the
// same values as threads. bf16 is reduced in float and rounded once (NCCL
// rounds at every step of its ring or tree, so its bf16 sums may differ from
// these in the last bit or two).

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "fived/comm/types.hpp"

namespace fived::detail {

// out[i] = the reduction over r = 0 .. n-1, in that order, of input(r)[i].
template <class T, class Input>
void reduce_in_rank_order(std::span<T> out, int n, Input&& input, ReduceOp op) {
  using A = std::conditional_t<std::is_same_v<T, bf16>, float, T>;
  std::vector<A> acc(out.size());
  std::copy_n(static_cast<const T*>(input(0)), out.size(), acc.begin());
  for (int r = 1; r < n; ++r) {
    const T* in = input(r);
    for (std::size_t i = 0; i < out.size(); ++i)
      acc[i] = op == ReduceOp::max ? std::max(acc[i], static_cast<A>(in[i])) : static_cast<A>(acc[i] + static_cast<A>(in[i]));
  }
  if (op == ReduceOp::avg)
    for (auto& v : acc) v = static_cast<A>(v / static_cast<A>(n));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(acc[i]);
}

}  // namespace fived::detail
