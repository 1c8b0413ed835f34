#pragma once
// Host token + position embedding, forward and backward.
//   forward:  out[b,t,:] = wte[tokens[b,t], :] + wpe[t, :]      (out [B,T,C], "=")
//   backward: dwte[tokens[b,t], :] += dout[b,t,:],  dwpe[t, :] += dout[b,t,:]   ("+=")
// wte is [V,C] (possibly tied with the LM head, whose gradient is added to the same
// dwte), wpe is [maxT,C] with maxT >= T. The backward is a scatter-add: a token
// that occurs several times gets the sum of its rows. dwpe sums over the batch in
// acc_t<T> before its single "+="; dwte is updated once per occurrence (the host
// version is sequential, so it is deterministic). Token ids out of [0, V) throw in
// the forward; the backward has no V and checks only that ids are not negative.

#include <cstddef>
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
void embedding_forward(T* out, const int* tokens, const T* wte, const T* wpe, int B, int T_, int C, int V) {
  using A = acc_t<T>;
  detail_embedding::check_sizes("embedding_forward", B, T_, C);
  const std::size_t sT = static_cast<std::size_t>(T_), sC = static_cast<std::size_t>(C);
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
    for (std::size_t t = 0; t < sT; ++t) {
      const int tok = tokens[b * sT + t];
      if (tok < 0 || tok >= V)
        throw std::invalid_argument("fived::kernels::host::embedding_forward: token " + std::to_string(tok) +
                                    " at (b=" + std::to_string(b) + ", t=" + std::to_string(t) +
                                    ") is outside the vocabulary [0, " + std::to_string(V) + ")");
      const T* e = wte + static_cast<std::size_t>(tok) * sC;
      const T* p = wpe + t * sC;
      T* o = out + (b * sT + t) * sC;
      for (std::size_t c = 0; c < sC; ++c) o[c] = static_cast<T>(static_cast<A>(e[c]) + static_cast<A>(p[c]));
    }
}

template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int* tokens, int B, int T_, int C) {
  using A = acc_t<T>;
  detail_embedding::check_sizes("embedding_backward", B, T_, C);
  const std::size_t sT = static_cast<std::size_t>(T_), sC = static_cast<std::size_t>(C);
  std::vector<A> dp(sT * sC, A(0));
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
    for (std::size_t t = 0; t < sT; ++t) {
      const int tok = tokens[b * sT + t];
      if (tok < 0)
        throw std::invalid_argument("fived::kernels::host::embedding_backward: token " + std::to_string(tok) +
                                    " at (b=" + std::to_string(b) + ", t=" + std::to_string(t) + ") is negative");
      const T* g = dout + (b * sT + t) * sC;
      T* e = dwte + static_cast<std::size_t>(tok) * sC;
      for (std::size_t c = 0; c < sC; ++c) {
        const A gc = static_cast<A>(g[c]);
        e[c] = static_cast<T>(static_cast<A>(e[c]) + gc);
        dp[t * sC + c] += gc;
      }
    }
  for (std::size_t i = 0; i < sT * sC; ++i) dwpe[i] = static_cast<T>(static_cast<A>(dwpe[i]) + dp[i]);
}

}  // namespace fived::kernels::host
