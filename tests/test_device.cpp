// bf16 conversions and the host buffer.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "fived/device/bf16.hpp"
#include "fived/device/buffer.hpp"

using fived::bf16;

TEST_CASE("every bf16 survives float and back with the same bits") {
  int checked = 0;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const bf16 h = bf16::from_bits(static_cast<std::uint16_t>(b));
    const float f = float(h);
    if (std::isnan(f)) {
      CHECK(std::isnan(float(bf16(f))));
      continue;
    }
    CHECK(bf16(f).bits == b);
    ++checked;
  }
  CHECK(checked == 65536 - 254);  // 2 x 127 NaN patterns
}

TEST_CASE("float to bf16 rounds to nearest, ties to even") {
  // every float halfway between two neighbouring bf16 values, in a range of exponents
  for (std::uint32_t hi = 0x3f80; hi < 0x3f90; ++hi) {
    const float lo = std::bit_cast<float>(hi << 16), up = std::bit_cast<float>((hi + 1) << 16);
    const float mid = std::bit_cast<float>((hi << 16) | 0x8000u);
    CHECK(float(bf16(mid)) == ((hi & 1u) ? up : lo));                               // tie: to even
    CHECK(float(bf16(std::bit_cast<float>((hi << 16) | 0x8001u))) == up);           // above: up
    CHECK(float(bf16(std::bit_cast<float>((hi << 16) | 0x7fffu))) == lo);           // below: down
  }
  CHECK(std::isinf(float(bf16(std::numeric_limits<float>::infinity()))));
  CHECK(std::isinf(float(bf16(std::numeric_limits<float>::max()))));  // rounds past the largest bf16
}

TEST_CASE("host buffer: zero-initialised, owning, movable") {
  fived::Buffer<float> a(5);
  for (float v : a.span()) CHECK(v == 0.f);
  a[2] = 3.f;
  fived::Buffer<float> b = std::move(a);
  CHECK(b.size() == 5);
  CHECK(b[2] == 3.f);
  b.zero();
  CHECK(b[2] == 0.f);
}
