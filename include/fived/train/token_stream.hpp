#pragma once
// Token streams: the ids a trainer's batches are cut from (train/token_data.hpp samples them).
//
//   auto one   = TokenStream::map_file("train.bin", /*bytes per token=*/2, vocab);
//   auto shards = TokenStream::map_glob("fineweb10B/fineweb_train_*.bin", 2, vocab);  // in name order, as one
//   auto text  = TokenStream::bytes_of(read_text("README.md"));                       // byte-level, vocab 256
//
// A file of token ids is little-endian unsigned integers of 2 or 4 bytes each: nanoGPT's .bin
// files (nothing else), or llm.c's (dev/data/data_common.py), which begin with a header of 256
// little-endian int32s: a magic (20240520: 2-byte ids, GPT-2's; 20240801: 4-byte, Llama 3's),
// a version (1, 7) and the number of ids after the header. Such a header is read and skipped,
// and must agree with the file's size and with the width asked for: read as ids, its 1024
// bytes would be 512 tokens every model accepts. A file is mapped, never read whole: a rank
// touches only the windows its batches start at. Several files (shards) are one stream, in
// the order given; a window may run from the end of one into the next. Every id must be
// below the vocabulary: checked when a batch reads it, an error naming the file and the
// position in it.

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace fived {

class TokenStream {
 public:
  // Maps `path`, ids of `bytes_per_token` (2 or 4) bytes each (after llm.c's header, where
  // the file has one), each < vocab.
  static TokenStream map_file(const std::filesystem::path& path, int bytes_per_token, int vocab) {
    return map_files(std::span<const std::filesystem::path>(&path, 1), bytes_per_token, vocab);
  }
  // The files, in this order, as one stream.
  static TokenStream map_files(std::span<const std::filesystem::path> paths, int bytes_per_token, int vocab) {
    if (bytes_per_token != 2 && bytes_per_token != 4)
      throw std::invalid_argument("TokenStream: token ids are 2 or 4 bytes wide, not " + std::to_string(bytes_per_token));
    if (paths.empty()) throw std::invalid_argument("TokenStream: no files given");
    TokenStream s;
    s.vocab_ = vocab;
    for (const std::filesystem::path& p : paths) s.add(map_one(p, bytes_per_token));
    s.name_ = paths.size() == 1 ? paths[0].string()
                                : paths[0].string() + " and " + std::to_string(paths.size() - 1) + " more file" +
                                      (paths.size() == 2 ? "" : "s");
    return s;
  }
  // The files a shell pattern names ("dir/train_*.bin"), in name order, as one stream; no
  // match is an error. A path without * ? [ is that one file (map_file's errors).
  static TokenStream map_glob(const std::string& pattern, int bytes_per_token, int vocab) {
    if (pattern.find_first_of("*?[") == std::string::npos) return map_file(pattern, bytes_per_token, vocab);
    glob_t found{};
    const int rc = ::glob(pattern.c_str(), 0, nullptr, &found);  // sorted by name
    std::vector<std::filesystem::path> paths(found.gl_pathv, found.gl_pathv + (rc == 0 ? found.gl_pathc : 0));
    ::globfree(&found);
    if (rc != 0 && rc != GLOB_NOMATCH)
      throw std::runtime_error("TokenStream: " + pattern + ": glob failed (" +
                               (rc == GLOB_NOSPACE ? "out of memory" : rc == GLOB_ABORTED ? "a folder could not be read"
                                                                                          : "error " + std::to_string(rc)) +
                               ")");
    if (paths.empty()) throw std::runtime_error("TokenStream: no file matches " + pattern);
    return map_files(paths, bytes_per_token, vocab);
  }

  // The bytes of a text as ids in [0, 256).
  static TokenStream bytes_of(std::string text, std::string name = "text") {
    auto owned = std::make_shared<std::string>(std::move(text));
    Piece p{nullptr, reinterpret_cast<const unsigned char*>(owned->data()), 0, owned->size(), 1, name};
    p.owner = std::move(owned);
    TokenStream s;
    s.add(std::move(p));
    s.name_ = std::move(name);
    return s;
  }

  std::size_t size() const { return size_; }
  int vocab() const { return vocab_; }
  const std::string& name() const { return name_; }
  std::size_t files() const { return pieces_.size(); }

  // Id i of the stream (checked against the vocabulary: a bad file is an error naming it and
  // the position in it).
  int operator[](std::size_t i) const {
    const Piece& f = piece_of(i);
    const std::size_t k = i - f.first;
    const unsigned char* p = f.base + k * static_cast<std::size_t>(f.width);
    std::uint32_t id = p[0];
    if (f.width >= 2) id |= static_cast<std::uint32_t>(p[1]) << 8;
    if (f.width == 4) id |= static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
    if (id >= static_cast<std::uint32_t>(vocab_))
      throw std::runtime_error("TokenStream: " + f.name + ": token " + std::to_string(k) + " is " + std::to_string(id) +
                               ", outside the vocabulary of " + std::to_string(vocab_));
    return static_cast<int>(id);
  }

  // llm.c's header: 256 int32s (dev/data/data_common.py).
  static constexpr std::size_t llmc_header_bytes = 256 * 4;
  static constexpr std::int32_t llmc_gpt2_magic = 20240520, llmc_llama3_magic = 20240801;

 private:
  struct Piece {
    std::shared_ptr<const void> owner;  // the mapping or the text
    const unsigned char* base = nullptr;  // its first id
    std::size_t first = 0, size = 0;      // where it starts in the stream, and its ids
    int width = 1;
    std::string name;
  };

  void add(Piece p) {
    p.first = size_;
    size_ += p.size;
    pieces_.push_back(std::move(p));
  }
  const Piece& piece_of(std::size_t i) const {
    if (pieces_.size() == 1) return pieces_[0];
    const auto after = std::upper_bound(pieces_.begin(), pieces_.end(), i,
                                        [](std::size_t x, const Piece& p) { return x < p.first; });
    return *(after - 1);
  }

  static std::int32_t le32(const unsigned char* p) {
    return static_cast<std::int32_t>(static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
                                     static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24);
  }

  // One file mapped: its ids after llm.c's header where it has one.
  static Piece map_one(const std::filesystem::path& path, int width) {
    const std::string where = "TokenStream: " + path.string() + ": ";
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw std::runtime_error(where + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw std::runtime_error(where + "not a regular file");
    }
    const std::size_t bytes = static_cast<std::size_t>(st.st_size);
    if (bytes == 0) {
      ::close(fd);
      throw std::runtime_error(where + "empty");
    }
    void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);  // the mapping keeps the file
    if (m == MAP_FAILED) throw std::runtime_error(where + "mmap: " + std::strerror(errno));
    Piece f{std::shared_ptr<void>(m, [bytes](void* q) { ::munmap(q, bytes); }), static_cast<const unsigned char*>(m),
            0, 0, width, path.string()};
    std::size_t body = bytes;
    const std::int32_t magic = bytes >= 4 ? le32(f.base) : 0;
    if (magic == llmc_gpt2_magic || magic == llmc_llama3_magic) {
      const int header_width = magic == llmc_gpt2_magic ? 2 : 4, version = magic == llmc_gpt2_magic ? 1 : 7;
      if (bytes < llmc_header_bytes)
        throw std::runtime_error(where + "begins with llm.c's magic " + std::to_string(magic) + " but is shorter than its " +
                                 std::to_string(llmc_header_bytes) + "-byte header");
      const std::int32_t v = le32(f.base + 4), n = le32(f.base + 8);
      if (v != version)
        throw std::runtime_error(where + "llm.c header of version " + std::to_string(v) + " (magic " +
                                 std::to_string(magic) + " is version " + std::to_string(version) + ")");
      body = bytes - llmc_header_bytes;
      if (n < 0 || static_cast<std::size_t>(n) * static_cast<std::size_t>(header_width) != body)
        throw std::runtime_error(where + "its llm.c header says " + std::to_string(n) + " ids of " +
                                 std::to_string(header_width) + " bytes, but " + std::to_string(body) +
                                 " bytes follow it");
      if (header_width != width)
        throw std::runtime_error(where + "its llm.c header says its ids are " + std::to_string(header_width) +
                                 " bytes wide, not " + std::to_string(width));
      f.base += llmc_header_bytes;
    }
    if (body % static_cast<std::size_t>(width) != 0)
      throw std::runtime_error(where + std::to_string(body) + " bytes is not a whole number of " + std::to_string(width) +
                               "-byte token ids");
    f.size = body / static_cast<std::size_t>(width);
    return f;
  }

  std::vector<Piece> pieces_;  // in stream order
  std::size_t size_ = 0;
  int vocab_ = 256;
  std::string name_;
};

}  // namespace fived
