#pragma once
// Scratch<T>: an array sized at run time that a constant expression may use.
//
// The proofs run inside the compiler, whose constexpr interpreter prices every
// operation: a std::vector push_back there costs as much as dozens of plain
// array writes, and filling a large vector element by element is no cheaper.
// So the proofs size each working array once, from the table, write every
// element they later read, and index it directly. Scratch is that array:
// new[] and delete[] (a constant expression may allocate if it frees before it
// ends), elements left uninitialised (reading one never written is an error the
// compiler reports), no growth and no copies. A table type's proofs, whose sizes
// are constants, use arrays of fixed size instead, cheaper still to index inside
// the compiler (table_index.hpp); the same code runs over either.

#include <utility>

namespace fived::pipeline::detail {

template <class T>
class Scratch {
 public:
  constexpr explicit Scratch(int n) : data_(new T[n > 0 ? n : 1]) {}
  constexpr Scratch(int n, const T& fill) : Scratch(n) {
    for (int i = 0; i < n; ++i) data_[i] = fill;
  }
  constexpr Scratch(Scratch&& o) noexcept : data_(std::exchange(o.data_, nullptr)) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  constexpr ~Scratch() { delete[] data_; }

  constexpr T* data() { return data_; }
  constexpr const T* data() const { return data_; }
  constexpr T& operator[](int i) { return data_[i]; }
  constexpr const T& operator[](int i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
};

}  // namespace fived::pipeline::detail
