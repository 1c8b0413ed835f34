#pragma once
// The vocabulary every communicator shares: element types, reductions,
// point-to-point operations and the error type.

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

#include "fived/device/bf16.hpp"

namespace fived {

enum class ReduceOp { sum, avg, max };

constexpr std::string_view reduce_op_name(ReduceOp op) {
  return op == ReduceOp::sum ? "sum" : op == ReduceOp::avg ? "avg" : "max";
}

enum class DType { f32, f64, bf16, i32, i64, u8 };

template <class T> struct dtype_of_t;
template <> struct dtype_of_t<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of_t<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of_t<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of_t<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of_t<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of_t<std::uint8_t> { static constexpr DType value = DType::u8; };
template <class T> inline constexpr DType dtype_of = dtype_of_t<T>::value;

// Element types the communicators move.
template <class T>
concept CommElement = requires { dtype_of_t<T>::value; };

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
  }
  return "?";
}

// One half of a grouped point-to-point exchange; `peer` is a rank of the
// communicator the exchange is issued on.
template <class T> struct SendOp { std::span<const T> buf; int peer; };
template <class T> struct RecvOp { std::span<T> buf; int peer; };

// Thrown by every backend when a collective cannot complete: mismatched calls,
// a failed peer, a transport error or a timeout. The message names the rank,
// the collective and the group.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace fived
