#pragma once
// A checkpoint step's manifest: the commit of a save, and the index its loaders read.
//
//   <dir>/step-00000042/rank-00000.safetensors ... rank-<W-1>.safetensors
//   <dir>/step-00000042/manifest.json
//
// The manifest is written last, atomically (io/atomic_file.hpp), and names every file with
// its size and FNV-1a 64 hash. From format 3 on it is also the index of the step: for each
// file its metadata (the placement of the pieces it holds) and every tensor entry's dtype,
// byte range and hash, so a rank that loads reads this one file and then only the byte ranges
// it needs (train/checkpoint.hpp), each checked against its hash. It ends with its own hash
// (formats 2 and 3), so an edited manifest is refused. Formats 1 and 2 (no index) still read.

#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fived/io/atomic_file.hpp"
#include "fived/io/dtype.hpp"
#include "fived/io/error.hpp"
#include "fived/io/json.hpp"
#include "fived/io/read_count.hpp"
#include "fived/util/fnv.hpp"

namespace fived::checkpoint {

inline std::filesystem::path step_folder(const std::filesystem::path& dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d", step);
  return dir / name;
}
inline std::string rank_file(int rank) {
  char name[40];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", rank);
  return name;
}
// The step a folder named by step_folder holds ("step-00000020": 20), or none for another name.
inline std::optional<int> step_of_folder(const std::filesystem::path& folder) {
  const std::string n = folder.filename().string();
  if (n.size() != 13 || n.rfind("step-", 0) != 0) return std::nullopt;
  int step = 0;
  for (std::size_t i = 5; i < n.size(); ++i) {
    if (n[i] < '0' || n[i] > '9') return std::nullopt;
    step = step * 10 + (n[i] - '0');
  }
  return step;
}

// FNV-1a 64 over a file's bytes.
inline std::uint64_t file_hash(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw io::SafetensorsError(path.string() + ": cannot open for reading");
  util::Fnv1a64 h;
  std::array<char, 1 << 16> buf{};
  while (in) {
    in.read(buf.data(), buf.size());
    io::count_read(static_cast<std::uint64_t>(in.gcount()));
    h.add(std::as_bytes(std::span<const char>(buf.data(), static_cast<std::size_t>(in.gcount()))));
  }
  return h.value();
}

// One tensor entry of a rank's file as the manifest indexes it: its bytes [begin, end) from
// the start of the file, and their FNV-1a 64 hash.
struct IndexedTensor {
  std::string name;
  io::Dtype dtype = io::Dtype::F32;
  std::uint64_t begin = 0, end = 0, hash = 0;
  friend bool operator==(const IndexedTensor&, const IndexedTensor&) = default;
};
struct FileEntry {
  std::string name;
  std::uint64_t bytes = 0, hash = 0;
  // Format 3, the index: the file's metadata (what piece of the model it holds) and its
  // tensors; empty in a manifest of an older format.
  std::map<std::string, std::string> metadata{};
  std::vector<IndexedTensor> tensors{};
};
inline constexpr int manifest_format = 3;  // what write_manifest writes
struct Manifest {
  int step = 0, adam_step = 0, world = 0;
  std::string mesh, model;
  std::vector<FileEntry> files;
  // What made the run, as the program that trains says it (seed, data, steps, ...): a later
  // run can tell whether it is the same one. Free-form strings.
  std::map<std::string, std::string> run;
  int format = manifest_format;  // 1 and 2: no index (read, never written)
  bool indexed() const { return format >= 3; }
};

namespace detail {
inline std::string hex(std::uint64_t v) {
  char s[20];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}
// An object of strings' members: each "key": "value" after `first` (the first) or `next`.
inline void json_members(std::string& j, const std::map<std::string, std::string>& strings, const char* first,
                         const char* next) {
  bool at_first = true;
  for (const auto& [k, v] : strings) {
    j += at_first ? first : next;
    io::json_string(j, k);
    j += ": ";
    io::json_string(j, v);
    at_first = false;
  }
}
// A file's index in the manifest: its metadata, then one array per tensor entry
// [name, dtype, begin, end, hash].
inline void index_body(std::string& j, const FileEntry& f) {
  j += ",\n     \"metadata\": {";
  json_members(j, f.metadata, "", ", ");
  j += "},\n     \"tensors\": [";
  for (std::size_t t = 0; t < f.tensors.size(); ++t) {
    const IndexedTensor& e = f.tensors[t];
    j += t ? ",\n      [" : "\n      [";
    io::json_string(j, e.name);
    j += ", \"" + std::string(io::dtype_name(e.dtype)) + "\", " + std::to_string(e.begin) + ", " + std::to_string(e.end) +
         ", \"" + hex(e.hash) + "\"]";
  }
  j += "]";
}
}  // namespace detail

// The manifest's text up to its own hash, in one canonical form: what write_manifest writes,
// and what read_manifest hashes again to tell an edited manifest.
inline std::string manifest_body(const Manifest& m) {
  std::string j = "{\n  \"format\": \"fived-checkpoint-" + std::to_string(m.format) +
                  "\",\n  \"step\": " + std::to_string(m.step) +
                  ",\n  \"adam_step\": " + std::to_string(m.adam_step) + ",\n  \"world\": " + std::to_string(m.world) +
                  ",\n  \"mesh\": ";
  io::json_string(j, m.mesh);
  j += ",\n  \"model\": ";
  io::json_string(j, m.model);
  j += ",\n  \"files\": [";
  for (std::size_t i = 0; i < m.files.size(); ++i) {
    j += i ? ",\n    {\"name\": " : "\n    {\"name\": ";
    io::json_string(j, m.files[i].name);
    j += ", \"bytes\": " + std::to_string(m.files[i].bytes) + ", \"fnv1a64\": \"" + detail::hex(m.files[i].hash) + "\"";
    if (m.indexed()) detail::index_body(j, m.files[i]);
    j += "}";
  }
  j += "\n  ],\n  \"run\": {";
  detail::json_members(j, m.run, "\n    ", ",\n    ");
  j += "\n  }";
  return j;
}
inline std::uint64_t text_hash(const std::string& text) {
  util::Fnv1a64 h;
  h.add(std::as_bytes(std::span<const char>(text.data(), text.size())));
  return h.value();
}

// Writes <folder>/manifest.json atomically (a temporary name, fsync, rename, the folder
// fsynced), ending with the FNV-1a hash of everything before it ("manifest_fnv1a64").
inline void write_manifest(const std::filesystem::path& folder, const Manifest& m) {
  std::string j = manifest_body(m);
  j += ",\n  \"manifest_fnv1a64\": \"" + detail::hex(text_hash(j)) + "\"\n}\n";
  io::detail::write_atomically(folder / "manifest.json", j.data(), j.size());
}

// Reads and checks a manifest: every field, its index (format 3), its own hash (formats 2
// and 3; format 1, written before it had one, is read without), and (check_files) every file
// it names against its size, and in the formats without an index also against its hash
// (with an index, a loader checks each tensor entry it reads against the entry's hash
// instead: train/checkpoint.hpp). Errors are io::SafetensorsError naming the manifest and
// what is wrong.
inline Manifest read_manifest(const std::filesystem::path& folder, bool check_files = true) {
  const std::filesystem::path path = folder / "manifest.json";
  if (std::filesystem::is_directory(path)) throw io::SafetensorsError(path.string() + ": is a folder, not a manifest");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw io::SafetensorsError(path.string() + ": no manifest (the step was not completed, or is not a checkpoint)");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  io::count_read(text.size());
  io::JsonReader<io::SafetensorsError> P(text, path.string(), 0, "checkpoint manifest");
  Manifest m;
  bool format = false, step = false, adam = false, world = false, mesh = false, model = false, files = false;
  bool run = false, own = false, hashed = false;  // hashed: format 2, which carries its own hash
  std::uint64_t own_hash = 0;
  auto hex64 = [&](std::size_t at, const char* what) {
    const std::string x = P.string(what);
    std::size_t used = 0;
    std::uint64_t v = 0;
    try {
      v = std::stoull(x, &used, 16);
    } catch (const std::exception&) {
      used = 0;
    }
    if (x.size() != 16 || used != 16) P.fail_at(at, std::string(what) + " must be 16 hexadecimal digits");
    return v;
  };
  auto once = [&](bool& seen, const std::string& key, std::size_t at) {
    if (seen) P.fail_at(at, "\"" + key + "\" appears twice");
    seen = true;
  };
  auto small_int = [&](const char* what) {
    const std::uint64_t v = P.uint(what);
    if (v > 1'000'000'000) P.fail(std::string(what) + " is out of range");
    return static_cast<int>(v);
  };
  // An object of strings: the run, a file's metadata.
  auto read_strings = [&](const std::string& what) {
    std::map<std::string, std::string> out;
    P.expect('{', "'{' (" + what + ": an object of strings)");
    for (bool f1 = true; !P.peek('}'); f1 = false) {
      if (!f1) P.expect(',', "',' or '}'");
      const std::size_t at2 = (P.ws(), P.pos());
      std::string k = P.string("a field of " + what);
      P.expect(':', "':'");
      if (out.count(k)) P.fail_at(at2, "\"" + k + "\" appears twice in " + what);
      out[std::move(k)] = P.string("a value of " + what + " (a string)");
    }
    P.expect('}', "'}'");
    return out;
  };
  // A file's tensors: [name, dtype, begin, end, hash] each, in the file's bytes.
  auto read_index = [&](const FileEntry& file) {
    std::vector<IndexedTensor> out;
    P.expect('[', "'[' (the file's tensors)");
    for (bool f1 = true; !P.peek(']'); f1 = false) {
      if (!f1) P.expect(',', "',' or ']'");
      const std::size_t at2 = (P.ws(), P.pos());
      IndexedTensor t;
      P.expect('[', "'[' (a tensor: [name, dtype, begin, end, hash])");
      t.name = P.string("the tensor's name");
      P.expect(',', "','");
      const std::string d = P.string("the tensor's dtype");
      const std::optional<io::Dtype> dtype = io::parse_dtype(d);
      if (!dtype) P.fail_at(at2, "tensor \"" + t.name + "\" has unknown dtype \"" + d + "\"");
      t.dtype = *dtype;
      P.expect(',', "','");
      t.begin = P.uint("the tensor's first byte");
      P.expect(',', "','");
      t.end = P.uint("the tensor's end");
      P.expect(',', "','");
      const std::size_t at3 = (P.ws(), P.pos());
      t.hash = hex64(at3, "the tensor's hash");
      P.expect(']', "']'");
      if (t.begin > t.end || (t.end - t.begin) % io::dtype_size(t.dtype) != 0 || (file.bytes && t.end > file.bytes))
        P.fail_at(at2, "tensor \"" + t.name + "\" has bytes [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                           "), which are no whole " + std::string(io::dtype_name(t.dtype)) + " elements of its file");
      out.push_back(std::move(t));
    }
    P.expect(']', "']'");
    return out;
  };
  P.expect('{', "'{' (a manifest is a JSON object)");
  for (bool first = true; !P.peek('}'); first = false) {
    if (!first) P.expect(',', "',' or '}'");
    const std::size_t at = (P.ws(), P.pos());
    const std::string key = P.string("a field name");
    P.expect(':', "':'");
    if (key == "format") {
      once(format, key, at);
      const std::string f = P.string("the format");
      if (f != "fived-checkpoint-1" && f != "fived-checkpoint-2" && f != "fived-checkpoint-3")
        P.fail_at(at, "unknown format (expected \"fived-checkpoint-3\", or 1 or 2 from an older fived)");
      m.format = f.back() - '0';
      hashed = m.format >= 2;
    } else if (key == "step") once(step, key, at), m.step = small_int("the step");
    else if (key == "adam_step") once(adam, key, at), m.adam_step = small_int("the AdamW step");
    else if (key == "world") once(world, key, at), m.world = small_int("the world size");
    else if (key == "mesh") once(mesh, key, at), m.mesh = P.string("the mesh");
    else if (key == "model") once(model, key, at), m.model = P.string("the model");
    else if (key == "files") {
      once(files, key, at);
      P.expect('[', "'[' (the files)");
      for (bool f1 = true; !P.peek(']'); f1 = false) {
        if (!f1) P.expect(',', "',' or ']'");
        FileEntry e;
        bool n = false, b = false, h = false, meta = false, index = false;
        P.expect('{', "'{' (a file)");
        for (bool f2 = true; !P.peek('}'); f2 = false) {
          if (!f2) P.expect(',', "',' or '}'");
          const std::size_t at2 = (P.ws(), P.pos());
          const std::string k = P.string("a file field");
          P.expect(':', "':'");
          if (k == "name") once(n, k, at2), e.name = P.string("the file name");
          else if (k == "bytes") once(b, k, at2), e.bytes = P.uint("the file size");
          else if (k == "fnv1a64") once(h, k, at2), e.hash = hex64(at2, "the hash");
          else if (k == "metadata") once(meta, k, at2), e.metadata = read_strings("the file's metadata");
          else if (k == "tensors") once(index, k, at2), e.tensors = read_index(e);
          else P.fail_at(at2, "unknown file field \"" + k + "\"");
        }
        P.expect('}', "'}'");
        if (!n || !b || !h) P.fail("a file entry lacks its name, bytes or fnv1a64");
        if (m.format >= 3 && (!meta || !index)) P.fail("a file entry of format 3 lacks its metadata or tensors");
        if (e.name.empty() || e.name.find('/') != std::string::npos || e.name.find("..") != std::string::npos)
          P.fail("file name \"" + e.name + "\" is not a plain file name in the step's folder");
        m.files.push_back(std::move(e));
      }
      P.expect(']', "']'");
    } else if (key == "run") {
      once(run, key, at);
      m.run = read_strings("the run");
    } else if (key == "manifest_fnv1a64") once(own, key, at), own_hash = hex64(at, "the manifest's own hash");
    else P.fail_at(at, "unknown field \"" + key + "\"");
  }
  P.expect('}', "'}'");
  P.ws();
  if (!P.at_end()) P.fail("trailing characters after the manifest");
  if (!(format && step && adam && world && mesh && model && files))
    throw io::SafetensorsError(path.string() + ": the manifest lacks a field (format, step, adam_step, world, mesh, "
                               "model and files are required)");
  if (const std::optional<int> named = step_of_folder(folder); named && *named != m.step)
    throw io::SafetensorsError(path.string() + ": its \"step\" is " + std::to_string(m.step) + " in the folder of step " +
                               std::to_string(*named) + " (an edited manifest, or a folder renamed)");
  if (hashed && !own) throw io::SafetensorsError(path.string() + ": lacks its own hash (\"manifest_fnv1a64\")");
  if (own && text_hash(manifest_body(m)) != own_hash)
    throw io::SafetensorsError(path.string() + ": edited after it was written (its fields do not match its own "
                               "\"manifest_fnv1a64\")");
  if (m.adam_step > m.step)
    throw io::SafetensorsError(path.string() + ": its \"adam_step\" " + std::to_string(m.adam_step) +
                               " is more than its step " + std::to_string(m.step) +
                               " (AdamW steps once per training step at most)");
  if (static_cast<int>(m.files.size()) != m.world)
    throw io::SafetensorsError(path.string() + ": names " + std::to_string(m.files.size()) + " files for a world of " +
                               std::to_string(m.world));
  for (const FileEntry& f : m.files) {
    if (!check_files) break;
    // (with an index, the bytes are checked tensor by tensor as they are read)
    const std::filesystem::path p = folder / f.name;
    std::error_code ec;
    const auto size = std::filesystem::file_size(p, ec);
    if (ec || size != f.bytes)
      throw io::SafetensorsError(path.string() + ": names " + f.name + " of " + std::to_string(f.bytes) + " bytes, which " +
                                 (ec ? std::string("is missing") : "has " + std::to_string(size)));
    if (!m.indexed() && file_hash(p) != f.hash) throw io::SafetensorsError(p.string() + ": its contents do not match the manifest's hash");
  }
  return m;
}

}  // namespace fived::checkpoint
