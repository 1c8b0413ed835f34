#pragma once
// bf16: bfloat16 storage for host code. Same bits and layout as CUDA's
// __nv_bfloat16 (the upper half of an IEEE float), so buffers move between
// host and device unchanged. Arithmetic happens in float: convert, compute,
// convert back (round to nearest even), as the kernels do.

#include <bit>
#include <cstdint>
#include <limits>

namespace fived {

struct bf16 {
  std::uint16_t bits = 0;

  constexpr bf16() = default;
  // Implicit, like float -> double: kernels templated on the element type
  // write `T(x)` and `float(t)` for float and bf16 alike.
  constexpr bf16(float f) : bits(round(f)) {}  // NOLINT(google-explicit-constructor)
  constexpr operator float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

  static constexpr bf16 from_bits(std::uint16_t b) {
    bf16 h;
    h.bits = b;
    return h;
  }
  friend constexpr bool operator==(bf16 a, bf16 b) { return float(a) == float(b); }

 private:
  static constexpr std::uint16_t round(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
    const std::uint32_t lsb = (u >> 16) & 1u;                  // round to nearest, ties to even
    return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
};

static_assert(sizeof(bf16) == 2);
static_assert(float(bf16(1.0f)) == 1.0f && float(bf16(-2.5f)) == -2.5f);
static_assert(float(bf16(1.0f + 1.0f / 256)) == 1.0f, "ties round to even");
static_assert(float(bf16(1.0f + 3.0f / 256)) == 1.0f + 1.0f / 64, "ties round to even (up)");

// Accumulation type for element type T: float for float and bf16, double for double.
template <class T> struct accumulator { using type = float; };
template <> struct accumulator<double> { using type = double; };
template <class T> using acc_t = typename accumulator<T>::type;

}  // namespace fived
