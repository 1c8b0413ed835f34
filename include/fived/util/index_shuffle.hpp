#pragma once
// IndexShuffle(n, key): a permutation of [0, n) chosen by the key, evaluated one index at a
// time. A sampler that walks a data set in a shuffled order asks it for the k-th window of
// an epoch and needs neither the epoch's whole order in memory (a Fisher-Yates order of a
// 10-billion-token set cut into 1024-token windows is 80 MB on every rank) nor any state
// beyond the key: the same key gives the same order on every rank and after a resume.
//
//   IndexShuffle order(windows, key);
//   std::uint64_t w = order(k);          // the k-th window, each of [0, windows) once
//
// How: a balanced Feistel network on the 2h-bit numbers, 4^h the smallest power of four
// not under n, is a bijection on [0, 4^h) whatever its round function; an index it sends
// at or past n is sent through it again until it lands below n (cycle walking). Each cycle
// of the bijection that passes through [0, n) is then walked to the next of its members
// there, which is a bijection of [0, n). 4^h < 4n, so fewer than four passes through the
// network on average.

#include <bit>
#include <cstdint>
#include <stdexcept>

namespace fived {

class IndexShuffle {
 public:
  IndexShuffle(std::uint64_t n, std::uint64_t key) : n_(n) {
    if (n == 0) throw std::invalid_argument("fived::IndexShuffle: there is no order of nothing (n is 0)");
    const int bits = n > 1 ? std::bit_width(n - 1) : 1;  // [0, n) in `bits` bits
    half_ = (bits + 1) / 2;
    mask_ = (std::uint64_t{1} << half_) - 1;
    // The key mixed first: keys k and k + 1 (seeds next to each other) share no round key.
    const std::uint64_t k = mix(key);
    for (int r = 0; r < rounds; ++r) keys_[r] = mix(k + 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(r + 1));
  }

  std::uint64_t size() const { return n_; }

  // The index at position i of the order (i < size()).
  std::uint64_t operator()(std::uint64_t i) const {
    do i = feistel(i);
    while (i >= n_);
    return i;
  }

 private:
  static constexpr int rounds = 6;  // 4 already pass for a pseudo-random permutation; 6 mix small halves better

  // splitmix64's finaliser: every input bit moves every output bit.
  static std::uint64_t mix(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  std::uint64_t feistel(std::uint64_t x) const {
    std::uint64_t left = x >> half_, right = x & mask_;
    for (int r = 0; r < rounds; ++r) {
      const std::uint64_t next = left ^ (mix(right ^ keys_[r]) & mask_);
      left = right;
      right = next;
    }
    return left << half_ | right;
  }

  std::uint64_t n_;
  int half_ = 1;
  std::uint64_t mask_ = 1;
  std::uint64_t keys_[rounds] = {};
};

}  // namespace fived
