#pragma once
// Reading byte ranges of files, and counting what fived's readers take from files per thread:
// what a test asks of a loader ("each rank reads its share and one index, not every file").
// The host backend's ranks are threads, so the count is a rank's.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fived/io/error.hpp"

namespace fived::io {

// Bytes this thread has read from files through fived's readers since it started.
inline std::uint64_t& bytes_read_by_this_thread() {
  thread_local std::uint64_t n = 0;
  return n;
}
inline void count_read(std::uint64_t n) { bytes_read_by_this_thread() += n; }

// Bytes [offset, offset + n) of an open file, counted; `path` names it in errors.
inline std::vector<std::byte> read_range(std::ifstream& in, const std::filesystem::path& path, std::uint64_t offset,
                                         std::uint64_t n) {
  std::vector<std::byte> out(static_cast<std::size_t>(n));
  in.clear();
  in.seekg(static_cast<std::streamoff>(offset));
  if (n && !in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(n)))
    throw SafetensorsError(path.string() + ": cannot read bytes [" + std::to_string(offset) + ", " +
                           std::to_string(offset + n) + ") (the file is shorter, or unreadable)");
  count_read(n);
  return out;
}

}  // namespace fived::io
