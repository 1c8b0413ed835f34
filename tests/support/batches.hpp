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

// The same with documents packed into its rows (context/documents.hpp): row i of the batch
// ends a document at each t with (t + 2i + step) % 5 == 4 (documents of 5, the first and
// last cut short, so they begin anywhere in a context-parallel chunk and cross chunks),
// except every fourth row, which stays one sequence. end_of_document -1: global_batch's.
inline void packed_batch(int step, int n, int B, int T, int vocab, int end_of_document, std::vector<int>& tok,
                         std::vector<int>& tgt) {
  global_batch(step, n, B, T, vocab, tok, tgt);
  if (end_of_document < 0) return;
  for (std::size_t row = 0; row < tok.size() / static_cast<std::size_t>(T); ++row) {
    for (int t = 0; t < T; ++t) {
      int& id = tok[row * static_cast<std::size_t>(T) + static_cast<std::size_t>(t)];
      if (id == end_of_document) id = (id + 1) % vocab;  // the documents are only those placed here
      if (row % 4 != 3 && (t + 2 * static_cast<int>(row) + step) % 5 == 4) id = end_of_document;
    }
  }
}

}  // namespace fived::test
