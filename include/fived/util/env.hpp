#pragma once
// Strict parsing of fived's environment variables. A value that cannot be
// what the variable means is an error, never silently a default or zero:
// FIVED_HOST_TIMEOUT_S=abc must not turn into a 0 s timeout.

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace fived::util {

// The value of environment variable `name` as a positive, finite number of
// seconds ("300", "0.5", "1e3"; surrounding blanks are allowed). Unset or
// empty: `default_s`. Anything else (not a number, trailing characters, zero,
// negative, infinite, NaN) throws std::invalid_argument naming the variable,
// its value and what to set instead.
inline std::chrono::duration<double> env_seconds(const char* name, double default_s) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return std::chrono::duration<double>(default_s);
  const std::string value = raw;
  char def[32];
  std::snprintf(def, sizeof def, "%g", default_s);
  const std::string fix = ": set it to a positive number of seconds such as " + std::string(def) +
                          ", or unset it for the default (" + def + " s)";
  const char* p = value.c_str();
  while (*p == ' ' || *p == '\t') ++p;
  char* end = nullptr;
  errno = 0;
  const double s = std::strtod(p, &end);
  const bool parsed = end != p;
  while (parsed && (*end == ' ' || *end == '\t')) ++end;
  if (!parsed || *end != '\0')
    throw std::invalid_argument(std::string(name) + "=" + value + " is not a number of seconds" + fix);
  if (!std::isfinite(s) || !(s > 0) || errno == ERANGE)
    throw std::invalid_argument(std::string(name) + "=" + value + " is not a positive, finite number of seconds" + fix);
  return std::chrono::duration<double>(s);
}

}  // namespace fived::util
