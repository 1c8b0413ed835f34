#pragma once
// FNV-1a, 64 bits: a fast hash of bytes for telling whether two copies are the same (a
// checkpoint file against its manifest, the replicas of a data-parallel group), not a
// cryptographic one.
//
//   util::Fnv1a64 h;  h.add(std::as_bytes(span));  h.value()

#include <cstddef>
#include <cstdint>
#include <span>

namespace fived::util {

class Fnv1a64 {
 public:
  void add(std::span<const std::byte> bytes) {
    for (const std::byte b : bytes) h_ = (h_ ^ static_cast<std::uint64_t>(b)) * 1099511628211ull;
  }
  std::uint64_t value() const { return h_; }

 private:
  std::uint64_t h_ = 1469598103934665603ull;
};

}  // namespace fived::util
