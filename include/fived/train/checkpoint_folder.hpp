#pragma once
// A checkpoint on disk (train/checkpoint.hpp says what is in its files):
//
//   <dir>/step-00000042/rank-00000.safetensors ... rank-<W-1>.safetensors
//   <dir>/step-00000042/manifest.json
//
// The manifest commits the step: written last, atomically (io/atomic_file.hpp), naming
// every file with its size and FNV-1a 64 hash, and ending with its own hash. Here: the
// names, the manifest written and read back (every field checked, and the files against
// it), which step to resume from (the newest that verifies), and the housekeeping of a
// checkpoint folder (what killed saves left; only the newest N steps).

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fived/io/atomic_file.hpp"
#include "fived/io/error.hpp"
#include "fived/io/json.hpp"
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
    h.add(std::as_bytes(std::span<const char>(buf.data(), static_cast<std::size_t>(in.gcount()))));
  }
  return h.value();
}

struct FileEntry {
  std::string name;
  std::uint64_t bytes = 0, hash = 0;
};
struct Manifest {
  int step = 0, adam_step = 0, world = 0;
  std::string mesh, model;
  std::vector<FileEntry> files;
  // What made the run, as the program that trains says it (seed, data, steps, ...): a later
  // run can tell whether it is the same one. Free-form strings.
  std::map<std::string, std::string> run;
};

namespace detail {
inline std::string hex(std::uint64_t v) {
  char s[20];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}
}  // namespace detail

// The manifest's text up to its own hash, in one canonical form: what write_manifest writes,
// and what read_manifest hashes again to tell an edited manifest.
inline std::string manifest_body(const Manifest& m) {
  std::string j = "{\n  \"format\": \"fived-checkpoint-2\",\n  \"step\": " + std::to_string(m.step) +
                  ",\n  \"adam_step\": " + std::to_string(m.adam_step) + ",\n  \"world\": " + std::to_string(m.world) +
                  ",\n  \"mesh\": ";
  io::json_string(j, m.mesh);
  j += ",\n  \"model\": ";
  io::json_string(j, m.model);
  j += ",\n  \"files\": [";
  for (std::size_t i = 0; i < m.files.size(); ++i) {
    j += i ? ",\n    {\"name\": " : "\n    {\"name\": ";
    io::json_string(j, m.files[i].name);
    j += ", \"bytes\": " + std::to_string(m.files[i].bytes) + ", \"fnv1a64\": \"" + detail::hex(m.files[i].hash) + "\"}";
  }
  j += "\n  ],\n  \"run\": {";
  bool first = true;
  for (const auto& [k, v] : m.run) {
    j += first ? "\n    " : ",\n    ";
    io::json_string(j, k);
    j += ": ";
    io::json_string(j, v);
    first = false;
  }
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

// Reads and checks a manifest: every field, its own hash (format 2; format 1, written before
// it had one, is read without), and (check_files) every file it names against its size and
// hash. Errors are io::SafetensorsError naming the manifest and what is wrong.
inline Manifest read_manifest(const std::filesystem::path& folder, bool check_files = true) {
  const std::filesystem::path path = folder / "manifest.json";
  if (std::filesystem::is_directory(path)) throw io::SafetensorsError(path.string() + ": is a folder, not a manifest");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw io::SafetensorsError(path.string() + ": no manifest (the step was not completed, or is not a checkpoint)");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
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
  P.expect('{', "'{' (a manifest is a JSON object)");
  for (bool first = true; !P.peek('}'); first = false) {
    if (!first) P.expect(',', "',' or '}'");
    const std::size_t at = (P.ws(), P.pos());
    const std::string key = P.string("a field name");
    P.expect(':', "':'");
    if (key == "format") {
      once(format, key, at);
      const std::string f = P.string("the format");
      if (f != "fived-checkpoint-1" && f != "fived-checkpoint-2")
        P.fail_at(at, "unknown format (expected \"fived-checkpoint-2\", or 1 from an older fived)");
      hashed = f == "fived-checkpoint-2";
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
        bool n = false, b = false, h = false;
        P.expect('{', "'{' (a file)");
        for (bool f2 = true; !P.peek('}'); f2 = false) {
          if (!f2) P.expect(',', "',' or '}'");
          const std::size_t at2 = (P.ws(), P.pos());
          const std::string k = P.string("a file field");
          P.expect(':', "':'");
          if (k == "name") once(n, k, at2), e.name = P.string("the file name");
          else if (k == "bytes") once(b, k, at2), e.bytes = P.uint("the file size");
          else if (k == "fnv1a64") once(h, k, at2), e.hash = hex64(at2, "the hash");
          else P.fail_at(at2, "unknown file field \"" + k + "\"");
        }
        P.expect('}', "'}'");
        if (!n || !b || !h) P.fail("a file entry lacks its name, bytes or fnv1a64");
        if (e.name.empty() || e.name.find('/') != std::string::npos || e.name.find("..") != std::string::npos)
          P.fail("file name \"" + e.name + "\" is not a plain file name in the step's folder");
        m.files.push_back(std::move(e));
      }
      P.expect(']', "']'");
    } else if (key == "run") {
      once(run, key, at);
      P.expect('{', "'{' (the run: an object of strings)");
      for (bool f1 = true; !P.peek('}'); f1 = false) {
        if (!f1) P.expect(',', "',' or '}'");
        const std::size_t at2 = (P.ws(), P.pos());
        std::string k = P.string("a run field");
        P.expect(':', "':'");
        if (m.run.count(k)) P.fail_at(at2, "run field \"" + k + "\" appears twice");
        m.run[std::move(k)] = P.string("a run value (a string)");
      }
      P.expect('}', "'}'");
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
    const std::filesystem::path p = folder / f.name;
    std::error_code ec;
    const auto size = std::filesystem::file_size(p, ec);
    if (ec || size != f.bytes)
      throw io::SafetensorsError(path.string() + ": names " + f.name + " of " + std::to_string(f.bytes) + " bytes, which " +
                                 (ec ? std::string("is missing") : "has " + std::to_string(size)));
    if (file_hash(p) != f.hash) throw io::SafetensorsError(p.string() + ": its contents do not match the manifest's hash");
  }
  return m;
}

// The steps under `dir` whose folder holds a manifest, newest first.
inline std::vector<int> steps_with_manifest(const std::filesystem::path& dir) {
  std::vector<int> steps;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (const std::optional<int> s = step_of_folder(e.path()); s && std::filesystem::exists(e.path() / "manifest.json"))
      steps.push_back(*s);
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

// The latest step under `dir` whose manifest exists, if any (whether it verifies or not).
inline std::optional<int> latest_step(const std::filesystem::path& dir) {
  const std::vector<int> steps = steps_with_manifest(dir);
  return steps.empty() ? std::nullopt : std::optional<int>(steps.front());
}

// A step passed over on resume, and why (read_manifest's sentence).
struct Refusal {
  int step;
  std::string reason;
};

// The step to resume from: the newest under `dir` that verifies (its manifest reads and agrees
// with its folder, every file has its recorded size and hash). The newer steps that did not
// are added to `refused`. None when no step verifies.
inline std::optional<int> newest_verified_step(const std::filesystem::path& dir, std::vector<Refusal>& refused) {
  for (const int step : steps_with_manifest(dir)) {
    try {
      (void)read_manifest(step_folder(dir, step));
      return step;
    } catch (const std::exception& e) {
      refused.push_back({step, e.what()});
    }
  }
  return std::nullopt;
}

// ---- housekeeping: leftovers of killed saves, and the last N steps ---------------------------

namespace detail {
// Whether `name` is one fived writes in a step folder: a rank's file, the manifest, or a
// temporary of either (io::detail::write_atomically's "<name>.tmp.<pid>.<k>").
inline bool written_by_fived(const std::string& name, bool* temporary = nullptr) {
  const std::size_t tmp = name.find(".tmp.");
  const std::string base = tmp == std::string::npos ? name : name.substr(0, tmp);
  if (temporary) *temporary = tmp != std::string::npos;
  const bool rank = base.size() == 22 && base.rfind("rank-", 0) == 0 &&
                    base.compare(10, 12, ".safetensors") == 0 &&
                    std::all_of(base.begin() + 5, base.begin() + 10, [](char c) { return c >= '0' && c <= '9'; });
  return rank || base == "manifest.json";
}
// Removes the files fived wrote in a step folder (all of them, or only the temporaries), then
// the folder if nothing else is left in it. Other files are never touched.
inline void remove_fived_files(const std::filesystem::path& folder, bool temporaries_only) {
  std::error_code ec;
  std::vector<std::filesystem::path> doomed;
  for (const auto& e : std::filesystem::directory_iterator(folder, ec)) {
    bool temporary = false;
    if (written_by_fived(e.path().filename().string(), &temporary) && (temporary || !temporaries_only))
      doomed.push_back(e.path());
  }
  for (const auto& f : doomed) std::filesystem::remove(f, ec);
  if (!temporaries_only) std::filesystem::remove(folder, ec);  // only when empty
}
}  // namespace detail

// Removes what killed saves left under `dir` (one process, while no save is running): the
// temporary files in every step folder, and step folders without a manifest other than
// `except` (partial saves; only the files fived writes, and the folder once empty).
inline void remove_leftovers(const std::filesystem::path& dir, std::optional<int> except = std::nullopt) {
  std::error_code ec;
  std::vector<std::filesystem::path> folders;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (const std::optional<int> s = step_of_folder(e.path()); s && e.is_directory(ec) && s != except)
      folders.push_back(e.path());
  for (const auto& f : folders)
    detail::remove_fived_files(f, /*temporaries_only=*/std::filesystem::exists(f / "manifest.json", ec));
}

// Keeps the newest `keep` complete steps under `dir` and removes the older ones, once the
// newest verifies (read_manifest); nothing when it does not, so the only step that verifies is
// never removed. Returns the steps removed.
inline std::vector<int> keep_last(const std::filesystem::path& dir, int keep) {
  std::vector<int> steps = steps_with_manifest(dir), removed;
  if (keep < 1 || static_cast<int>(steps.size()) <= keep) return removed;
  try {
    (void)read_manifest(step_folder(dir, steps.front()));
  } catch (const std::exception&) {
    return removed;
  }
  for (std::size_t i = static_cast<std::size_t>(keep); i < steps.size(); ++i) {
    detail::remove_fived_files(step_folder(dir, steps[i]), /*temporaries_only=*/false);
    removed.push_back(steps[i]);
  }
  return removed;
}

}  // namespace fived::checkpoint
