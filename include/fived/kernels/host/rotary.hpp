#pragma once
// Host rotary position embedding (Llama), forward and backward, in place on the q|k|v
// projection's output, which is the attention kernels' layout (kernels/host/attention.hpp):
//
//   qkv [N, (H + 2 KV) hd]   H query heads, then KV key heads, then KV value heads, hd
//                            columns each (Llama's q_proj | k_proj | v_proj)
//
// Queries and keys are rotated by their row's position p ("rotate half", as Hugging Face
// Llama): column i < hd/2 pairs with i + hd/2, and with a = p · inv_freq[i]
//   x'_i = x_i cos a - x_{i+hd/2} sin a,   x'_{i+hd/2} = x_{i+hd/2} cos a + x_i sin a.
// Values are left alone. The backward is the transpose, the rotation by -a of the query and
// key gradients.
//
// Positions: RowPositions (context/row_positions.hpp), each row's position in its sequence.
// Angles are in acc_t.

#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/context/row_positions.hpp"
#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

namespace detail_rotary {
inline void check_sizes(const char* what, int N, int H, int KV, int hd, RowPositions pos) {
  if (N < 0 || H < 1 || KV < 1 || H % KV != 0 || hd < 2 || hd % 2 != 0 || pos.rows_per_chunk < 1 ||
      pos.chunk_length < 1 || N > 2 * pos.rows_per_chunk)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what +
                                ": needs N >= 0, KV >= 1 dividing H, an even head size and at most two chunks of rows "
                                "(got N=" + std::to_string(N) + ", H=" + std::to_string(H) + ", KV=" +
                                std::to_string(KV) + ", hd=" + std::to_string(hd) + ", rows per chunk " +
                                std::to_string(pos.rows_per_chunk) + ")");
}

// The first H + KV heads of every row rotated by the angles p · inv_freq (sign +1), or back
// (sign -1).
template <class T, class A>
void rotate_rows(const char* what, T* qkv, const A* inv_freq, int N, int H, int KV, int hd, RowPositions pos, A sign) {
  check_sizes(what, N, H, KV, hd, pos);
  const std::size_t width = static_cast<std::size_t>(H + 2 * KV) * hd, half = static_cast<std::size_t>(hd / 2);
  std::vector<A> c(half), s(half);
  for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r) {
    const int p = pos(r);
    for (std::size_t i = 0; i < half; ++i) {
      const A a = static_cast<A>(p) * inv_freq[i];
      c[i] = std::cos(a), s[i] = sign * std::sin(a);
    }
    for (int h = 0; h < H + KV; ++h) {
      T* x = qkv + r * width + static_cast<std::size_t>(h) * hd;
      for (std::size_t i = 0; i < half; ++i) {
        const A x1 = static_cast<A>(x[i]), x2 = static_cast<A>(x[i + half]);
        x[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
        x[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
      }
    }
  }
}
}  // namespace detail_rotary

// qkv [N, (H + 2 KV) hd]: queries and keys rotated to their positions, in place. inv_freq [hd/2].
template <class T>
void rotary_forward(T* qkv, const acc_t<T>* inv_freq, int N, int H, int KV, int hd, RowPositions pos) {
  detail_rotary::rotate_rows("rotary_forward", qkv, inv_freq, N, H, KV, hd, pos, acc_t<T>(1));
}

// dqkv [N, (H + 2 KV) hd]: the query and key gradients rotated back, in place.
template <class T>
void rotary_backward(T* dqkv, const acc_t<T>* inv_freq, int N, int H, int KV, int hd, RowPositions pos) {
  detail_rotary::rotate_rows("rotary_backward", dqkv, inv_freq, N, H, KV, hd, pos, acc_t<T>(-1));
}

}  // namespace fived::kernels::host
