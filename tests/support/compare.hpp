#pragma once
// Helpers the doctest tests share: the error measure every parallel-vs-serial
// and device-vs-host comparison states its bound in, and test inputs.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

namespace fived::test {

// A value as double: arithmetic types directly (double stays exact), anything
// else (bf16) through float.
template <class T>
double as_double(const T& x) {
  if constexpr (std::is_arithmetic_v<T>) return static_cast<double>(x);
  else return static_cast<double>(static_cast<float>(x));
}

// max |got - ref| / max |ref| over [first, first + n) (the absolute error when ref
// is all zero). Infinity on a non-finite value, which a plain max would skip
// (std::max(d, NaN) keeps d) or a range outside either vector.
template <class A, class B>
double max_rel_error(const std::vector<A>& got, const std::vector<B>& ref, std::size_t first, std::size_t n) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  if (first + n > got.size() || first + n > ref.size()) return inf;
  double diff = 0, scale = 0;
  for (std::size_t i = first; i < first + n; ++i) {
    const double g = as_double(got[i]), r = as_double(ref[i]);
    if (!std::isfinite(g) || !std::isfinite(r)) return inf;
    diff = std::max(diff, std::abs(g - r));
    scale = std::max(scale, std::abs(r));
  }
  return scale > 0 ? diff / scale : diff;
}

// The same over whole vectors, which must have the same size (a REQUIRE: a
// mismatch stops the test case).
template <class A, class B>
double max_rel_error(const std::vector<A>& got, const std::vector<B>& ref) {
  REQUIRE(got.size() == ref.size());
  return max_rel_error(got, ref, 0, ref.size());
}

// n values in ±[0.1, 1): never zero, so no gradient or product vanishes by accident.
template <class T>
std::vector<T> random_values(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> mag(0.1, 1.0);
  std::bernoulli_distribution neg(0.5);
  std::vector<T> v(n);
  for (auto& e : v) e = static_cast<T>(neg(gen) ? -mag(gen) : mag(gen));
  return v;
}

}  // namespace fived::test
