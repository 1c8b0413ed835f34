#pragma once
// Block regrouping around one dimension, contract of fived/kernels/host/regroup.hpp:
//   regroup(s, out, in, outer, n, block, Blocks::split)   [outer][n][block] -> [n][outer][block]
//   regroup(s, out, in, outer, n, block, Blocks::join)    [n][outer][block] -> [outer][n][block]
//
// A bandwidth-bound copy: one grid-stride loop over the output elements, each
// reading its source element (consecutive threads read and write consecutive
// elements within a block, so both sides coalesce). Any trivially copyable T
// (redistribute moves whatever the tensor holds); out and in must not overlap.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/host/regroup.hpp>

namespace fived::kernels::cuda {

// One enum for both backends.
using ::fived::kernels::host::Blocks;

namespace detail {

// out[i] for i over all outer * n * block elements; `split` picks the direction.
template <class T>
__global__ void regroup_kernel(T* out, const T* in, std::int64_t outer, int n, std::int64_t block, bool split) {
  const std::int64_t total = outer * n * block;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t b = i % block, row = i / block;  // row: which block this element sits in, in out's order
    std::int64_t o, k;
    if (split) {  // out is [n][outer][block]
      k = row / outer;
      o = row % outer;
    } else {  // out is [outer][n][block]
      o = row / n;
      k = row % n;
    }
    const std::int64_t from = split ? (o * n + k) * block : (k * outer + o) * block;
    out[i] = in[from + b];
  }
}

}  // namespace detail

template <class T>
void regroup(cudaStream_t stream, T* out, const T* in, std::int64_t outer, int n, std::int64_t block, Blocks how) {
  static_assert(std::is_trivially_copyable_v<T>, "regroup moves elements as bytes: T must be trivially copyable");
  ::fived::kernels::host::detail_regroup::check_sizes("cuda", outer, n, block);
  const std::int64_t total = outer * n * block;
  if (total == 0) return;
  detail::regroup_kernel<<<detail::grid_for(static_cast<std::size_t>(total), 256), 256, 0, stream>>>(
      dev(out), dev(in), outer, n, block, how == Blocks::split);
  FIVED_CUDA_CHECK_LAUNCH("regroup_kernel");
}

}  // namespace fived::kernels::cuda
