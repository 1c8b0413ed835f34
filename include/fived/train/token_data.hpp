#pragma once
// The sampler that cuts a token stream (train/token_stream.hpp: files of ids, mapped, or a
// text's bytes) into the global batch of a step.
//
//   auto data = TokenStream::map_glob("fineweb_train_*.bin", /*bytes per token=*/2, vocab);  // shards, mapped
//   BatchSampler train{data, 0, data.size() * 9 / 10, /*seed=*/1};
//   train.order = SampleOrder::epochs;                          // optional: each window once an epoch
//   train.fill(step, micro_batches, B, T, tokens, targets);   // the same batch on every rank
//
// Every rank draws the same global batch of a step (a function of the seed and the step, so
// a resumed run draws the same batches, and the sampler has no state a checkpoint must keep):
// windows at random places, or (epochs) the part cut into windows that are each drawn once an
// epoch, in an order the seed and the epoch shuffle; DataParallel and the pipeline executor
// give each data rank its rows, and the model under context parallelism keeps its zig-zag
// chunks of each sequence.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/train/token_stream.hpp"
#include "fived/util/index_shuffle.hpp"

namespace fived {

// Where a batch's windows come from.
//   random  each window starts anywhere (at a multiple of align), drawn independently: a
//           window may come again before another has come once (nanoGPT's sampler)
//   epochs  [begin, end) is cut into windows that start `stride(T)` tokens apart (where align
//           divides T, each token but the part's first and its last few, fewer than a stride,
//           is then a target once); they are drawn each once an epoch, in an order shuffled by
//           the seed and the epoch (IndexShuffle). The rows of the steps are one sequence:
//           step s's global batch is positions [s·rows, (s+1)·rows) of it, epoch after epoch,
//           and a batch may straddle two epochs. A run whose steps count from 1 (the Trainer's)
//           leaves out one batch of windows in its first epoch only. A run resumed with
//           another batch (rows a step) or T finds itself elsewhere in that sequence: in the
//           epoch it is in, some windows come twice and some not at all.
enum class SampleOrder { random, epochs };

// Windows of T + 1 tokens from [begin, end) of a stream: tokens and next-token targets.
struct BatchSampler {
  const TokenStream* data;
  std::size_t begin = 0, end = 0;
  std::uint64_t seed = 0;
  // Windows start at begin + a multiple of `align`: for data made of samples of one length
  // (a corpus of fixed-width lines), every window then starts at a sample's first token.
  std::size_t align = 1;
  SampleOrder order = SampleOrder::random;

  BatchSampler(const TokenStream& d, std::size_t b, std::size_t e, std::uint64_t s) : data(&d), begin(b), end(e), seed(s) {
    if (e > d.size() || b >= e) throw std::invalid_argument("BatchSampler: [" + std::to_string(b) + ", " +
                                                            std::to_string(e) + ") is not a part of " + d.name());
  }

  // Whether windows of T + 1 tokens fit.
  bool fits(int T) const { return end - begin >= static_cast<std::size_t>(T) + 1; }

  // Under SampleOrder::epochs: how far apart windows start (T rounded up to a multiple of
  // align: each window's last token, a target only, is the next one's first), and how many
  // windows an epoch has.
  std::size_t stride(int T) const {
    const std::size_t a = std::max<std::size_t>(align, 1);
    return (static_cast<std::size_t>(T) + a - 1) / a * a;
  }
  std::size_t windows_per_epoch(int T) const {
    return fits(T) ? (end - begin - static_cast<std::size_t>(T) - 1) / stride(T) + 1 : 0;
  }

  // The global batch of `step`: micro_batches x [B, T], micro-batch k in rows [kB, (k+1)B).
  void fill(std::uint64_t step, int micro_batches, int B, int T, std::vector<int>& tok, std::vector<int>& tgt) const {
    if (!fits(T))
      throw std::invalid_argument("BatchSampler: " + data->name() + " has " + std::to_string(end - begin) +
                                  " tokens in this part, fewer than a window of T + 1 = " + std::to_string(T + 1));
    const std::size_t rows = static_cast<std::size_t>(micro_batches) * static_cast<std::size_t>(B);
    tok.resize(rows * static_cast<std::size_t>(T));
    tgt.resize(tok.size());
    std::mt19937_64 rng(seed_key() + step);
    const std::size_t a = std::max<std::size_t>(align, 1);
    std::uniform_int_distribution<std::size_t> start(0, (end - begin - static_cast<std::size_t>(T) - 1) / a);
    const std::uint64_t windows = windows_per_epoch(T);
    for (std::size_t r = 0; r < rows; ++r) {
      const std::size_t s = order == SampleOrder::epochs ? epoch_window(step * rows + r, windows, T)
                                                         : begin + start(rng) * a;
      for (int t = 0; t < T; ++t) {
        const std::size_t i = r * static_cast<std::size_t>(T) + static_cast<std::size_t>(t);
        tok[i] = (*data)[s + static_cast<std::size_t>(t)];
        tgt[i] = (*data)[s + static_cast<std::size_t>(t) + 1];
      }
    }
  }

 private:
  std::uint64_t seed_key() const { return seed * 0x9E3779B97F4A7C15ull; }  // the seed spread over 64 bits
  // The first token of the window at `position` of the epochs' sequence.
  std::size_t epoch_window(std::uint64_t position, std::uint64_t windows, int T) const {
    const IndexShuffle shuffled(windows, seed_key() ^ (position / windows));
    return begin + static_cast<std::size_t>(shuffled(position % windows)) * stride(T);
  }
};

}  // namespace fived
