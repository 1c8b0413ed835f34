#pragma once
// Token streams a trainer draws its batches from, and the sampler that cuts them into the
// global batch of a step.
//
//   auto data = TokenStream::map_file("train.bin", /*bytes per token=*/2, vocab);   // memory-mapped ids
//   auto text = TokenStream::bytes_of(read_text("README.md"));                     // byte-level, vocab 256
//   BatchSampler train{data, 0, data.size() * 9 / 10, /*seed=*/1};
//   train.order = SampleOrder::epochs;                          // optional: each window once an epoch
//   train.fill(step, micro_batches, B, T, tokens, targets);   // the same batch on every rank
//
// A file of token ids is little-endian unsigned integers of 2 or 4 bytes each, nothing else
// (a header-less llm.c / nanoGPT .bin of uint16). It is mapped, never read whole: a rank
// touches only the windows its batches start at. Every rank draws the same global batch of a
// step (a function of the seed and the step, so a resumed run draws the same batches, and the
// sampler has no state a checkpoint must keep): windows at random places, or (epochs) the part
// cut into windows that are each drawn once an epoch, in an order the seed and the epoch shuffle;
// DataParallel and the pipeline executor give each data rank its rows, and the model under
// context parallelism keeps its zig-zag chunks of each sequence.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/util/index_shuffle.hpp"

namespace fived {

class TokenStream {
 public:
  // Maps `path`, ids of `bytes_per_token` (2 or 4) bytes each; every id must be < vocab
  // (checked when a batch reads it).
  static TokenStream map_file(const std::filesystem::path& path, int bytes_per_token, int vocab) {
    if (bytes_per_token != 2 && bytes_per_token != 4)
      throw std::invalid_argument("TokenStream: token ids are 2 or 4 bytes wide, not " + std::to_string(bytes_per_token));
    const std::string where = "TokenStream: " + path.string() + ": ";
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw std::runtime_error(where + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw std::runtime_error(where + "not a regular file");
    }
    const std::size_t bytes = static_cast<std::size_t>(st.st_size);
    if (bytes == 0 || bytes % static_cast<std::size_t>(bytes_per_token) != 0) {
      ::close(fd);
      throw std::runtime_error(where + std::to_string(bytes) + " bytes is not a whole number of " +
                               std::to_string(bytes_per_token) + "-byte token ids");
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);  // the mapping keeps the file
    if (p == MAP_FAILED) throw std::runtime_error(where + "mmap: " + std::strerror(errno));
    TokenStream s;
    s.mapping_ = std::shared_ptr<void>(p, [bytes](void* q) { ::munmap(q, bytes); });
    s.base_ = static_cast<const unsigned char*>(p);
    s.width_ = bytes_per_token;
    s.size_ = bytes / static_cast<std::size_t>(bytes_per_token);
    s.vocab_ = vocab;
    s.name_ = path.string();
    return s;
  }

  // The bytes of a text as ids in [0, 256).
  static TokenStream bytes_of(std::string text, std::string name = "text") {
    TokenStream s;
    auto owned = std::make_shared<std::string>(std::move(text));
    s.base_ = reinterpret_cast<const unsigned char*>(owned->data());
    s.size_ = owned->size();
    s.mapping_ = std::move(owned);
    s.width_ = 1;
    s.vocab_ = 256;
    s.name_ = std::move(name);
    return s;
  }

  std::size_t size() const { return size_; }
  int vocab() const { return vocab_; }
  const std::string& name() const { return name_; }

  // Id i (checked against the vocabulary: a bad file is an error naming the position).
  int operator[](std::size_t i) const {
    const unsigned char* p = base_ + i * static_cast<std::size_t>(width_);
    std::uint32_t id = p[0];
    if (width_ >= 2) id |= static_cast<std::uint32_t>(p[1]) << 8;
    if (width_ == 4) id |= static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
    if (id >= static_cast<std::uint32_t>(vocab_))
      throw std::runtime_error("TokenStream: " + name_ + ": token " + std::to_string(i) + " is " + std::to_string(id) +
                               ", outside the vocabulary of " + std::to_string(vocab_));
    return static_cast<int>(id);
  }

 private:
  std::shared_ptr<const void> mapping_;
  const unsigned char* base_ = nullptr;
  std::size_t size_ = 0;
  int width_ = 1, vocab_ = 256;
  std::string name_;
};

// Where a batch's windows come from.
//   random  each window starts anywhere (at a multiple of align), drawn independently: a
//           window may come again before another has come once (nanoGPT's sampler)
//   epochs  [begin, end) is cut into windows that start `stride(T)` tokens apart (where align
//           divides T, each token but the part's first and its last few, fewer than a stride,
//           is then a target once); they are drawn each once an epoch, in an order shuffled by
//           the seed and the epoch (IndexShuffle). The rows of the steps are one sequence:
//           step s's global batch is positions [s·rows, (s+1)·rows) of it, epoch after epoch,
//           and a batch may straddle two epochs. A run whose steps count from 1 (the Trainer's)
//           leaves out one batch of windows in its first epoch only.
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
    std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + step);
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
  // The first token of the window at `position` of the epochs' sequence.
  std::size_t epoch_window(std::uint64_t position, std::uint64_t windows, int T) const {
    const IndexShuffle shuffled(windows, seed * 0x9E3779B97F4A7C15ull ^ (position / windows));
    return begin + static_cast<std::size_t>(shuffled(position % windows)) * stride(T);
  }
};

}  // namespace fived
