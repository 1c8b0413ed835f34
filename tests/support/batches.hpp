#pragma once
// The global batch a parallel-vs-serial test feeds every rank and the serial model alike:
// a function of the step only, so every rank draws the same one.

#include <cstddef>
#include <random>
#include <vector>

namespace fived::test {

// n micro-batches of [B, T] ids in [0, vocab) for step `step`, with learnable targets
// (a fixed affine map of the token), so the loss falls over a few steps.
inline void global_batch(int step, int n, int B, int T, int vocab, std::vector<int>& tok, std::vector<int>& tgt) {
  std::mt19937 rng(1000u + static_cast<unsigned>(step));
  std::uniform_int_distribution<int> d(0, vocab - 1);
  tok.resize(static_cast<std::size_t>(n) * B * T);
  tgt.resize(tok.size());
  for (int& t : tok) t = d(rng);
  for (std::size_t i = 0; i < tok.size(); ++i) tgt[i] = (tok[i] * 7 + 3) % vocab;
}

}  // namespace fived::test
