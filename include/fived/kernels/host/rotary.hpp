#pragma once
// Host rotary position embedding with grouped query heads (Llama), forward and backward:
// from the q|k|v projection's layout to the attention kernels' and back.
//
//   raw [N, (H + 2 KV) hd]   the projection's output: H query heads, then KV key heads, then
//                            KV value heads, hd columns each (Llama's q_proj | k_proj | v_proj)
//   qkv [N, 3 H hd]          what attention reads (kernels/host/attention.hpp): q | k | v with
//                            H heads each; query head h uses key/value head h / (H / KV)
//                            (Hugging Face's repeat_kv), so KV head j is copied G = H / KV times
//
// Queries and keys are rotated by their row's position p ("rotate half", as Hugging Face
// Llama): column i < hd/2 pairs with i + hd/2, and with a = p · inv_freq[i]
//   x'_i = x_i cos a - x_{i+hd/2} sin a,   x'_{i+hd/2} = x_{i+hd/2} cos a + x_i sin a.
// Values are copied. The backward is the transpose: the same rotation by -a, and each key or
// value head's gradient the sum over the G query heads that read it; draw is overwritten.
//
// Positions: RowPositions (context/row_positions.hpp), each row's position in its sequence.
// Angles are in acc_t.

#include <algorithm>
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

// dst = src rotated by the angles p · inv_freq (sign +1), or back (sign -1).
template <class T, class U, class A>
void rotate(T* dst, const U* src, const A* inv_freq, int hd, int p, A sign) {
  const int half = hd / 2;
  for (int i = 0; i < half; ++i) {
    const A a = static_cast<A>(p) * inv_freq[i];
    const A c = std::cos(a), s = sign * std::sin(a);
    const A x1 = static_cast<A>(src[i]), x2 = static_cast<A>(src[i + half]);
    const A y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
    dst[i] = static_cast<T>(y1);
    dst[i + half] = static_cast<T>(y2);
  }
}
}  // namespace detail_rotary

// qkv [N, 3 H hd] from raw [N, (H + 2 KV) hd]. inv_freq [hd/2].
template <class T>
void rotary_forward(T* qkv, const T* raw, const acc_t<T>* inv_freq, int N, int H, int KV, int hd, RowPositions pos) {
  using A = acc_t<T>;
  detail_rotary::check_sizes("rotary_forward", N, H, KV, hd, pos);
  const std::size_t C = static_cast<std::size_t>(H) * hd, K = static_cast<std::size_t>(KV) * hd;
  const std::size_t shd = static_cast<std::size_t>(hd);
  const int G = H / KV;
  for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r) {
    const T* in = raw + r * (C + 2 * K);
    T* out = qkv + r * 3 * C;
    const int p = pos(r);
    for (std::size_t h = 0; h < static_cast<std::size_t>(H); ++h) {
      const std::size_t j = h / static_cast<std::size_t>(G);  // its key/value head
      detail_rotary::rotate(out + h * shd, in + h * shd, inv_freq, hd, p, A(1));
      detail_rotary::rotate(out + C + h * shd, in + C + j * shd, inv_freq, hd, p, A(1));
      for (std::size_t d = 0; d < shd; ++d) out[2 * C + h * shd + d] = in[C + K + j * shd + d];
    }
  }
}

// draw [N, (H + 2 KV) hd] ("=") from dqkv [N, 3 H hd].
template <class T>
void rotary_backward(T* draw, const T* dqkv, const acc_t<T>* inv_freq, int N, int H, int KV, int hd,
                     RowPositions pos) {
  using A = acc_t<T>;
  detail_rotary::check_sizes("rotary_backward", N, H, KV, hd, pos);
  const std::size_t C = static_cast<std::size_t>(H) * hd, K = static_cast<std::size_t>(KV) * hd;
  const std::size_t shd = static_cast<std::size_t>(hd);
  const int G = H / KV;
  std::vector<A> dk(shd), dv(shd);
  for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r) {
    const T* in = dqkv + r * 3 * C;
    T* out = draw + r * (C + 2 * K);
    const int p = pos(r);
    for (std::size_t h = 0; h < static_cast<std::size_t>(H); ++h)
      detail_rotary::rotate(out + h * shd, in + h * shd, inv_freq, hd, p, A(-1));
    for (std::size_t j = 0; j < static_cast<std::size_t>(KV); ++j) {  // sum the G readers, then rotate back
      std::fill(dk.begin(), dk.end(), A(0));
      std::fill(dv.begin(), dv.end(), A(0));
      for (std::size_t h = j * static_cast<std::size_t>(G); h < (j + 1) * static_cast<std::size_t>(G); ++h)
        for (std::size_t d = 0; d < shd; ++d)
          dk[d] += static_cast<A>(in[C + h * shd + d]), dv[d] += static_cast<A>(in[2 * C + h * shd + d]);
      detail_rotary::rotate(out + C + j * shd, dk.data(), inv_freq, hd, p, A(-1));
      for (std::size_t d = 0; d < shd; ++d) out[C + K + j * shd + d] = static_cast<T>(dv[d]);
    }
  }
}

}  // namespace fived::kernels::host
