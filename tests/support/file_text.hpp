#pragma once
// What a test wrote to a temporary file (std::tmpfile), read back from its start.

#include <cstdio>
#include <string>

namespace fived::test {

inline std::string file_text(std::FILE* f) {
  std::string s;
  std::rewind(f);
  for (int c; (c = std::fgetc(f)) != EOF;) s += static_cast<char>(c);
  return s;
}

}  // namespace fived::test
