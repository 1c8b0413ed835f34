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
// compiler reports), no growth and no copies.

#include <utility>

namespace fived::pipeline::detail {

template <class T>
class Scratch {
 public:
  constexpr Scratch() = default;
  constexpr explicit Scratch(int n) : data_(new T[n > 0 ? n : 1]), size_(n) {}
  constexpr Scratch(int n, const T& fill) : Scratch(n) {
    for (int i = 0; i < n; ++i) data_[i] = fill;
  }
  constexpr Scratch(Scratch&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  constexpr Scratch& operator=(Scratch&& o) noexcept {
    std::swap(data_, o.data_), std::swap(size_, o.size_);
    return *this;
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  constexpr ~Scratch() { delete[] data_; }

  constexpr int size() const { return size_; }
  constexpr T* data() { return data_; }
  constexpr const T* data() const { return data_; }
  constexpr T& operator[](int i) { return data_[i]; }
  constexpr const T& operator[](int i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  int size_ = 0;
};

}  // namespace fived::pipeline::detail
