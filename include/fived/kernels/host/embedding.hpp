#pragma once
// Host token + position embedding over a range of the vocabulary, forward and backward.
// The table holds rows [vocab_begin, vocab_begin + vocab_rows) of the (padded)
// vocabulary: all of it on one rank, this rank's shard under tensor parallelism.
//   forward:  out[b,t,:] = (wte[tokens[b,t] - vocab_begin, :] if the id is in the range, else 0)
//                          + wpe[t, :] (when wpe is given)                            ("=")
//   backward: dwte[tokens[b,t] - vocab_begin, :] += dout[b,t,:] for in-range ids,
//             dwpe[t, :] += dout[b,t,:] (when dwpe is given)                          ("+=")
// wpe is [maxT,C] with maxT >= T. A vocab-parallel embedding adds the positions on one
// rank only, so the sum over ranks holds them once. The backward is a scatter-add: a
// token that occurs several times gets the sum of its rows. Both sums run in acc_t<T>
// before a single "+=" per row (a token's occurrences in position order, so the result is
// deterministic and matches the CUDA version's sort). Negative ids throw; ids past the
// range are another rank's (the model checks them against the vocabulary).

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/device/bf16.hpp"

namespace fived::kernels::host {

namespace detail_embedding {
inline void check_sizes(const char* what, int B, int T, int C) {
  if (B < 0 || T < 0 || C <= 0)
    throw std::invalid_argument(std::string("fived::kernels::host::") + what + ": needs B >= 0, T >= 0, C >= 1 (got B=" +
                                std::to_string(B) + ", T=" + std::to_string(T) + ", C=" + std::to_string(C) + ")");
}
}  // namespace detail_embedding

template <class T>
void embedding_forward(T* out, const int* tokens, const T* wte, int vocab_begin, int vocab_rows, const T* wpe, int B,
                       int T_, int C) {
  using A = acc_t<T>;
  detail_embedding::check_sizes("embedding_forward", B, T_, C);
  const std::size_t sT = static_cast<std::size_t>(T_), sC = static_cast<std::size_t>(C);
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
    for (std::size_t t = 0; t < sT; ++t) {
      const int tok = tokens[b * sT + t];
      if (tok < 0)
        throw std::invalid_argument("fived::kernels::host::embedding_forward: token " + std::to_string(tok) +
                                    " at (b=" + std::to_string(b) + ", t=" + std::to_string(t) + ") is negative");
      const int row = tok - vocab_begin;
      const T* e = row >= 0 && row < vocab_rows ? wte + static_cast<std::size_t>(row) * sC : nullptr;
      const T* p = wpe ? wpe + t * sC : nullptr;
      T* o = out + (b * sT + t) * sC;
      for (std::size_t c = 0; c < sC; ++c)
        o[c] = e && p ? static_cast<T>(static_cast<A>(e[c]) + static_cast<A>(p[c])) : e ? e[c] : p ? p[c] : T{};
    }
}

template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int* tokens, int B, int T_, int C, int vocab_begin,
                        int vocab_rows) {
  using A = acc_t<T>;
  detail_embedding::check_sizes("embedding_backward", B, T_, C);
  const std::size_t sT = static_cast<std::size_t>(T_), sC = static_cast<std::size_t>(C);
  const std::size_t n = static_cast<std::size_t>(B) * sT;
  for (std::size_t i = 0; i < n; ++i)
    if (tokens[i] < 0)
      throw std::invalid_argument("fived::kernels::host::embedding_backward: token " + std::to_string(tokens[i]) +
                                  " at (b=" + std::to_string(i / sT) + ", t=" + std::to_string(i % sT) +
                                  ") is negative");
  // Positions grouped by token (stable: in position order), each group summed in
  // acc_t and added to dwte once. Adding per occurrence in T would lose most of
  // a frequent token's gradient in bf16 (1000 x 1.0 stops growing at 256).
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return tokens[a] < tokens[b]; });
  std::vector<A> sum(sC), dp(dwpe ? sT * sC : 0, A(0));
  for (std::size_t k = 0; k < n;) {
    const int tok = tokens[order[k]];
    const bool mine = tok - vocab_begin >= 0 && tok - vocab_begin < vocab_rows;
    std::fill(sum.begin(), sum.end(), A(0));
    for (; k < n && tokens[order[k]] == tok; ++k) {
      const std::size_t i = order[k];
      const T* g = dout + i * sC;
      A* p = dwpe ? dp.data() + (i % sT) * sC : nullptr;
      for (std::size_t c = 0; c < sC; ++c) {
        sum[c] += static_cast<A>(g[c]);
        if (p) p[c] += static_cast<A>(g[c]);
      }
    }
    if (!mine) continue;
    T* e = dwte + static_cast<std::size_t>(tok - vocab_begin) * sC;
    for (std::size_t c = 0; c < sC; ++c) e[c] = static_cast<T>(static_cast<A>(e[c]) + sum[c]);
  }
  if (dwpe)
    for (std::size_t i = 0; i < sT * sC; ++i) dwpe[i] = static_cast<T>(static_cast<A>(dwpe[i]) + dp[i]);
}

}  // namespace fived::kernels::host
