#pragma once
// Writing a file so that a crash leaves either the old file or the whole new one:
// detail::write_atomically writes "<path>.tmp.<pid>.<k>", flushes it to disk,
// renames it over <path> and flushes the folder (atomic on POSIX). A killed
// writer leaves only its temporary file. Safetensors files (io/safetensors.hpp)
// and checkpoint manifests (train/checkpoint.hpp) are written this way.

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

#if __has_include(<unistd.h>)
#include <fcntl.h>
#include <unistd.h>
#define FIVED_IO_HAS_FSYNC 1
#endif

#include "fived/io/error.hpp"

namespace fived::io {

namespace detail {
inline long process_id() {
#ifdef FIVED_IO_HAS_FSYNC
  return static_cast<long>(::getpid());
#else
  return 0;
#endif
}
// Flushes the folder holding `path` (its entry for a renamed file) to disk.
inline void sync_folder(const std::filesystem::path& path) {
#ifdef FIVED_IO_HAS_FSYNC
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // a folder that cannot be opened cannot be flushed either; the rename stands
  (void)::fsync(fd);
  ::close(fd);
#else
  (void)path;
#endif
}
// Writes n bytes to path atomically: "<path>.tmp.<pid>.<k>" (a name no other writer, thread
// or process, uses), flushed to disk, renamed to path, the folder flushed so the new name
// survives a crash. A killed writer leaves its temporary file behind, never a partial path.
inline void write_atomically(const std::filesystem::path& path, const void* data, std::size_t n) {
  static std::atomic<unsigned> counter{0};
  std::filesystem::path tmp = path;
  tmp += ".tmp." + std::to_string(process_id()) + "." + std::to_string(counter++);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw SafetensorsError(tmp.string() + ": cannot open for writing (" + std::strerror(errno) + ")");
  bool ok = n == 0 || std::fwrite(data, 1, n, f) == n;
  ok = ok && std::fflush(f) == 0;
#ifdef FIVED_IO_HAS_FSYNC
  ok = ok && ::fsync(fileno(f)) == 0;
#endif
  const int err = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw SafetensorsError(tmp.string() + ": write failed (" + std::strerror(err) + ")");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();  // before the clean-up's own error code replaces it
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw SafetensorsError(path.string() + ": cannot rename " + tmp.string() + " to it (" + why + ")");
  }
  sync_folder(path);
}
}  // namespace detail

}  // namespace fived::io
