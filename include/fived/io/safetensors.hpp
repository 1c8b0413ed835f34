#pragma once
// Reading and writing the safetensors format (https://github.com/huggingface/safetensors).
//
//   [8 bytes: N, little-endian u64] [N bytes: JSON header] [data section]
//
// The header is one JSON object: for every tensor  "name": {"dtype": "F32", "shape": [2, 3],
// "data_offsets": [begin, end]}  (byte offsets into the data section), plus an optional
// "__metadata__": {"key": "value", ...} of strings. The data section is row-major and
// little-endian, fully covered by the tensors, without holes or overlaps.
//
// Reading: `SafetensorsFile::read(path)` loads the file, parses the header with the strict
// JSON reader of io/json.hpp (objects, arrays, strings with escapes, unsigned integers;
// other values are skipped where they are unknown keys), and checks every rule above. Errors are `SafetensorsError` with the file, the byte offset in the file and what
// was expected.
//
// Writing (io/safetensors_writer.hpp): `SafetensorsWriter` collects (name, dtype, shape, bytes) views and `write(path)`
// writes "<path>.tmp.<pid>.<n>", flushes it to disk, renames it over <path> and flushes the
// folder (atomic on POSIX; a killed writer leaves only its temporary file). The header is
// padded with spaces to a multiple of 8 bytes, so the data section starts 8-byte aligned,
// and tensors are ordered by decreasing element size (then name), so every tensor
// is aligned to its element size — what the reference implementation does.
//
// Only little-endian hosts are supported (static_assert).

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/device/bf16.hpp"
#include "fived/io/atomic_file.hpp"
#include "fived/io/dtype.hpp"
#include "fived/io/error.hpp"
#include "fived/io/json.hpp"
#include "fived/io/read_count.hpp"
#include "fived/io/safetensors_writer.hpp"

namespace fived::io {

static_assert(std::endian::native == std::endian::little,
              "fived::io::safetensors supports little-endian hosts only (the format is little-endian)");

// One tensor of a file: offsets are into the data section.
struct TensorEntry {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<std::int64_t> shape;
  std::size_t begin = 0, end = 0;

  std::size_t numel() const {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
  std::size_t nbytes() const { return end - begin; }
};

// Largest header accepted (as the reference implementation: 100 MB).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

// A safetensors file read into memory.
class SafetensorsFile {
 public:
  static SafetensorsFile read(const std::filesystem::path& path) {
    // A directory or a pipe opens as a stream too, with no usable size.
    std::error_code ec;
    if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
      throw SafetensorsError(path.string() + ": not a regular file (give the path of a .safetensors file)");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw SafetensorsError(path.string() + ": cannot open for reading (" + std::strerror(errno) + ")");
    in.seekg(0, std::ios::end);
    const auto end = in.tellg();
    if (end < 0) throw SafetensorsError(path.string() + ": cannot determine the file size");
    const auto size = static_cast<std::size_t>(end);
    in.seekg(0);
    std::vector<std::byte> bytes(size);
    if (size && !in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size)))
      throw SafetensorsError(path.string() + ": read error");
    count_read(size);
    return parse(std::move(bytes), path.string());
  }

  // A file's header alone: its tensors (checked against the file's size) and metadata, not
  // its data (bytes() and read_into() are not for such a file). What a checkpoint's manifest
  // indexes.
  static SafetensorsFile read_header(const std::filesystem::path& path) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    std::ifstream in(path, std::ios::binary);
    if (ec || !in || !std::filesystem::is_regular_file(path, ec))
      throw SafetensorsError(path.string() + ": cannot open for reading (give the path of a .safetensors file)");
    std::uint64_t n = 0;
    if (size >= 8) {
      const std::vector<std::byte> length = read_range(in, path, 0, 8);
      std::memcpy(&n, length.data(), 8);
    }
    SafetensorsFile f;
    f.source_ = path.string();
    f.bytes_ = size >= 8 && n <= max_header_bytes && n <= size - 8 ? read_range(in, path, 0, 8 + n)
                                                                    : std::vector<std::byte>(size < 8 ? 0 : 8);
    if (size >= 8) std::memcpy(f.bytes_.data(), &n, 8);
    f.parse_header(static_cast<std::size_t>(size));
    return f;
  }
  // Where the data section starts in the file.
  std::size_t data_start() const { return data_start_; }

  // Parses a whole file held in memory; `source` names it in errors.
  static SafetensorsFile parse(std::vector<std::byte> bytes, std::string source = "<memory>") {
    SafetensorsFile f;
    f.source_ = std::move(source);
    f.bytes_ = std::move(bytes);
    f.parse_header(f.bytes_.size());
    return f;
  }

  const std::string& source() const { return source_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // In data order (increasing offsets).
  const std::vector<TensorEntry>& tensors() const { return tensors_; }

  const TensorEntry* find(std::string_view name) const {
    auto it = index_.find(std::string(name));
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }
  const TensorEntry& at(std::string_view name) const {
    if (const TensorEntry* e = find(name)) return *e;
    std::string list;
    for (std::size_t i = 0; i < tensors_.size() && i < 8; ++i) {
      if (i) list += ", ";
      list += tensors_[i].name;
    }
    if (tensors_.size() > 8) list += ", ...";
    throw SafetensorsError(source_ + ": no tensor named '" + std::string(name) + "' (the file has " +
                           std::to_string(tensors_.size()) + " tensors" + (list.empty() ? "" : ": " + list) + ")");
  }

  std::span<const std::byte> bytes(const TensorEntry& e) const {
    return std::span<const std::byte>(bytes_).subspan(data_start_ + e.begin, e.nbytes());
  }

  // Copies a tensor into `out` (out.size() must equal its element count). Floating
  // element types accept any floating dtype (F64, F32, F16, BF16) and convert with
  // rounding to nearest; other element types need the exact dtype.
  template <class T>
  void read_into(const TensorEntry& e, std::span<T> out) const {
    if (out.size() != e.numel())
      throw SafetensorsError(source_ + ": tensor '" + e.name + "' has " + std::to_string(e.numel()) +
                             " elements, the destination has " + std::to_string(out.size()));
    const std::byte* p = bytes_.data() + data_start_ + e.begin;
    constexpr bool floating = std::is_floating_point_v<T> || std::is_same_v<T, bf16>;
    if (e.dtype == dtype_of<T>) {
      if (!out.empty()) std::memcpy(out.data(), p, e.nbytes());
      return;
    }
    if constexpr (floating) {
      if (is_floating(e.dtype)) {
        for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(floating_element(e.dtype, p, i));
        return;
      }
    }
    throw SafetensorsError(source_ + ": tensor '" + e.name + "' is " + std::string(dtype_name(e.dtype)) +
                           ", cannot read it as " + std::string(dtype_name(dtype_of<T>)));
  }
  template <class T>
  std::vector<T> read(std::string_view name) const {
    const TensorEntry& e = at(name);
    std::vector<T> v(e.numel());
    read_into(e, std::span<T>(v));
    return v;
  }

 private:
  // `file_size`: the whole file's; bytes_ holds at least its first 8 + header-length bytes.
  void parse_header(std::size_t file_size) {
    if (file_size < 8)
      throw SafetensorsError(source_ + ": truncated: the file has " + std::to_string(file_size) +
                             " bytes, a safetensors file starts with an 8-byte header length");
    std::uint64_t n = 0;
    std::memcpy(&n, bytes_.data(), 8);
    if (n > max_header_bytes)
      throw SafetensorsError(source_ + ": the header length is " + std::to_string(n) + " bytes, more than the " +
                             std::to_string(max_header_bytes) + " allowed (not a safetensors file?)");
    if (n > file_size - 8)
      throw SafetensorsError(source_ + ": truncated: the header length is " + std::to_string(n) +
                             " bytes but only " + std::to_string(file_size - 8) + " bytes follow it");
    data_start_ = 8 + static_cast<std::size_t>(n);
    const std::size_t data_size = file_size - data_start_;
    std::string_view text(reinterpret_cast<const char*>(bytes_.data()) + 8, static_cast<std::size_t>(n));
    JsonReader<SafetensorsError> P(text, source_, 8, "safetensors header");

    if (text.empty() || text[0] != '{') P.fail("expected '{' (the header must start with a JSON object), found " + P.found());
    P.expect('{', "'{'");
    bool first = true;
    while (!P.peek('}')) {
      if (!first) P.expect(',', "',' or '}' after a header entry");
      first = false;
      const std::size_t key_pos = (P.ws(), P.pos());
      std::string key = P.string("a tensor name or \"__metadata__\"");
      P.expect(':', "':' after \"" + key + "\"");
      if (key == "__metadata__") {
        if (saw_metadata_) P.fail_at(key_pos, "\"__metadata__\" appears twice");
        saw_metadata_ = true;
        parse_metadata(P);
        continue;
      }
      if (index_.count(key)) P.fail_at(key_pos, "tensor \"" + key + "\" appears twice");
      tensors_.push_back(parse_tensor(P, key, key_pos, data_size));
      index_.emplace(key, tensors_.size() - 1);
    }
    P.expect('}', "'}'");
    P.ws();
    if (!P.at_end()) P.fail("expected only whitespace after the header object, found " + P.found());

    // The data section must be covered exactly: no overlaps, no holes, nothing past the end.
    std::vector<std::size_t> order(tensors_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return std::pair(tensors_[a].begin, tensors_[a].end) < std::pair(tensors_[b].begin, tensors_[b].end);
    });
    std::size_t covered = 0;
    const TensorEntry* prev = nullptr;
    for (std::size_t i : order) {
      const TensorEntry& e = tensors_[i];
      if (e.begin < covered)
        throw SafetensorsError(source_ + ": tensors '" + prev->name + "' (bytes [" + std::to_string(prev->begin) + ", " +
                               std::to_string(prev->end) + ")) and '" + e.name + "' (bytes [" + std::to_string(e.begin) +
                               ", " + std::to_string(e.end) + ")) overlap in the data section");
      if (e.begin > covered)
        throw SafetensorsError(source_ + ": bytes [" + std::to_string(covered) + ", " + std::to_string(e.begin) +
                               ") of the data section belong to no tensor (the format allows no holes)");
      covered = e.end;
      if (e.nbytes() > 0) prev = &e;
    }
    if (covered != data_size)
      throw SafetensorsError(source_ + ": the data section has " + std::to_string(data_size) +
                             " bytes but the tensors cover " + std::to_string(covered) +
                             " (trailing bytes that belong to no tensor)");
    std::vector<TensorEntry> sorted;
    sorted.reserve(tensors_.size());
    for (std::size_t i : order) sorted.push_back(std::move(tensors_[i]));
    tensors_ = std::move(sorted);
    index_.clear();
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  }

  void parse_metadata(JsonReader<SafetensorsError>& P) {
    if (P.literal("null")) return;  // no metadata, as the reference implementation reads it
    P.expect('{', "'{' to start \"__metadata__\" (an object of strings) or null");
    bool first = true;
    while (!P.peek('}')) {
      if (!first) P.expect(',', "',' or '}' in \"__metadata__\"");
      first = false;
      const std::size_t key_pos = (P.ws(), P.pos());
      std::string k = P.string("a metadata key");
      P.expect(':', "':' after a metadata key");
      std::string v = P.string("a metadata value (metadata values must be strings)");
      if (metadata_.count(k)) P.fail_at(key_pos, "metadata key \"" + k + "\" appears twice");
      metadata_[std::move(k)] = std::move(v);
    }
    P.expect('}', "'}'");
  }

  TensorEntry parse_tensor(JsonReader<SafetensorsError>& P, const std::string& name, std::size_t key_pos,
                           std::size_t data_size) {
    TensorEntry e;
    e.name = name;
    bool has_dtype = false, has_shape = false, has_offsets = false;
    std::vector<std::uint64_t> offsets;
    P.expect('{', "'{' to start the entry of tensor \"" + name + "\"");
    bool first = true;
    while (!P.peek('}')) {
      if (!first) P.expect(',', "',' or '}' in the entry of tensor \"" + name + "\"");
      first = false;
      const std::size_t field_pos = (P.ws(), P.pos());
      std::string field = P.string("a field name (\"dtype\", \"shape\" or \"data_offsets\")");
      P.expect(':', "':' after \"" + field + "\"");
      if ((field == "dtype" && has_dtype) || (field == "shape" && has_shape) || (field == "data_offsets" && has_offsets))
        P.fail_at(field_pos, "tensor \"" + name + "\" has \"" + field + "\" twice");
      if (field == "dtype") {
        const std::size_t at = (P.ws(), P.pos());
        std::string d = P.string("the dtype");
        auto dt = parse_dtype(d);
        if (!dt) P.fail_at(at, "tensor \"" + name + "\" has unknown dtype \"" + d + "\"");
        e.dtype = *dt;
        has_dtype = true;
      } else if (field == "shape") {
        for (auto d : P.uint_array("the shape")) {
          if (d > static_cast<std::uint64_t>(INT64_MAX)) P.fail("a dimension of \"" + name + "\" is too large");
          e.shape.push_back(static_cast<std::int64_t>(d));
        }
        has_shape = true;
      } else if (field == "data_offsets") {
        const std::size_t at = (P.ws(), P.pos());
        offsets = P.uint_array("data_offsets");
        if (offsets.size() != 2) P.fail_at(at, "data_offsets of \"" + name + "\" must be [begin, end]");
        has_offsets = true;
      } else {
        P.skip_value();  // unknown fields are ignored, as the reference implementation does
      }
    }
    P.expect('}', "'}'");
    if (!has_dtype || !has_shape || !has_offsets)
      P.fail_at(key_pos, "tensor \"" + name + "\" lacks " +
                             (!has_dtype ? "\"dtype\"" : !has_shape ? "\"shape\"" : "\"data_offsets\""));
    const std::uint64_t b = offsets[0], en = offsets[1];
    if (b > en)
      P.fail_at(key_pos, "tensor \"" + name + "\" has data_offsets [" + std::to_string(b) + ", " + std::to_string(en) +
                             "] with begin > end");
    if (en > data_size)
      throw SafetensorsError(source_ + ": tensor '" + name + "' has data_offsets [" + std::to_string(b) + ", " +
                             std::to_string(en) + "] past the end of the data section (" + std::to_string(data_size) +
                             " bytes; is the file truncated?)");
    // numel * element size must equal the byte range (with overflow checks)
    std::uint64_t bytes = dtype_size(e.dtype);
    bool overflow = false;
    for (auto d : e.shape) {
      const auto u = static_cast<std::uint64_t>(d);
      if (u != 0 && bytes > UINT64_MAX / u) overflow = true;
      bytes *= u;
    }
    if (overflow || bytes != en - b)
      P.fail_at(key_pos, "tensor \"" + name + "\" is " + std::string(dtype_name(e.dtype)) + " " + shape_string(e.shape) +
                             " but its data_offsets [" + std::to_string(b) + ", " + std::to_string(en) + "] span " +
                             std::to_string(en - b) + " bytes");
    e.begin = static_cast<std::size_t>(b);
    e.end = static_cast<std::size_t>(en);
    return e;
  }

  std::string source_;
  std::vector<std::byte> bytes_;
  std::size_t data_start_ = 0;
  std::vector<TensorEntry> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
  bool saw_metadata_ = false;
};

}  // namespace fived::io
