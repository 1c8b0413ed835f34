#pragma once
// The element types of a safetensors file: their names in the header ("F32",
// "BF16", ...), sizes, the type of a C++ element (dtype_of<float>), and IEEE half
// to float (F16 files are read by converting).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "fived/device/bf16.hpp"

namespace fived::io {

enum class Dtype : std::uint8_t { BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64 };

constexpr std::string_view dtype_name(Dtype d) {
  switch (d) {
    case Dtype::BOOL: return "BOOL";
    case Dtype::U8: return "U8";
    case Dtype::I8: return "I8";
    case Dtype::I16: return "I16";
    case Dtype::U16: return "U16";
    case Dtype::F16: return "F16";
    case Dtype::BF16: return "BF16";
    case Dtype::I32: return "I32";
    case Dtype::U32: return "U32";
    case Dtype::F32: return "F32";
    case Dtype::I64: return "I64";
    case Dtype::U64: return "U64";
    case Dtype::F64: return "F64";
  }
  return "?";
}

constexpr std::size_t dtype_size(Dtype d) {
  switch (d) {
    case Dtype::BOOL:
    case Dtype::U8:
    case Dtype::I8: return 1;
    case Dtype::I16:
    case Dtype::U16:
    case Dtype::F16:
    case Dtype::BF16: return 2;
    case Dtype::I32:
    case Dtype::U32:
    case Dtype::F32: return 4;
    case Dtype::I64:
    case Dtype::U64:
    case Dtype::F64: return 8;
  }
  return 0;
}

constexpr bool is_floating(Dtype d) {
  return d == Dtype::F16 || d == Dtype::BF16 || d == Dtype::F32 || d == Dtype::F64;
}

inline std::optional<Dtype> parse_dtype(std::string_view s) {
  for (int i = 0; i <= static_cast<int>(Dtype::F64); ++i)
    if (dtype_name(static_cast<Dtype>(i)) == s) return static_cast<Dtype>(i);
  return std::nullopt;
}

// The safetensors dtype of a C++ element type (no F16: there is no host half type here;
// F16 files are read by converting, see SafetensorsFile::read_into).
template <class T> struct dtype_of_t;
template <> struct dtype_of_t<float> { static constexpr Dtype value = Dtype::F32; };
template <> struct dtype_of_t<double> { static constexpr Dtype value = Dtype::F64; };
template <> struct dtype_of_t<bf16> { static constexpr Dtype value = Dtype::BF16; };
template <> struct dtype_of_t<std::int8_t> { static constexpr Dtype value = Dtype::I8; };
template <> struct dtype_of_t<std::uint8_t> { static constexpr Dtype value = Dtype::U8; };
template <> struct dtype_of_t<std::int16_t> { static constexpr Dtype value = Dtype::I16; };
template <> struct dtype_of_t<std::uint16_t> { static constexpr Dtype value = Dtype::U16; };
template <> struct dtype_of_t<std::int32_t> { static constexpr Dtype value = Dtype::I32; };
template <> struct dtype_of_t<std::uint32_t> { static constexpr Dtype value = Dtype::U32; };
template <> struct dtype_of_t<std::int64_t> { static constexpr Dtype value = Dtype::I64; };
template <> struct dtype_of_t<std::uint64_t> { static constexpr Dtype value = Dtype::U64; };
template <class T> inline constexpr Dtype dtype_of = dtype_of_t<std::remove_cv_t<T>>::value;

// IEEE half (binary16) bits to float, exact.
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {        // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400u) == 0);
    bits = sign | ((112u - static_cast<std::uint32_t>(e)) << 23) | ((man & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

// Element i of floating data of dtype d (F64, F32, BF16, F16; 0 for others), as a double.
inline double floating_element(Dtype d, const std::byte* p, std::size_t i) {
  switch (d) {
    case Dtype::F64: { double x; std::memcpy(&x, p + 8 * i, 8); return x; }
    case Dtype::F32: { float x; std::memcpy(&x, p + 4 * i, 4); return x; }
    case Dtype::BF16: { std::uint16_t b; std::memcpy(&b, p + 2 * i, 2); return float(bf16::from_bits(b)); }
    case Dtype::F16: { std::uint16_t b; std::memcpy(&b, p + 2 * i, 2); return half_to_float(b); }
    default: return 0;
  }
}

inline std::string shape_string(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace fived::io
