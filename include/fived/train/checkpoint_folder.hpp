#pragma once
// A checkpoint on disk (train/checkpoint.hpp says what is in its files):
//
//   <dir>/step-00000042/rank-00000.safetensors ... rank-<W-1>.safetensors
//   <dir>/step-00000042/manifest.json
//
// The manifest (train/manifest.hpp) commits the step. Here: which step to resume from (the
// newest that loads), and the housekeeping of a checkpoint folder (what killed saves left;
// only the newest N steps).

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

#include "fived/train/manifest.hpp"

namespace fived::checkpoint {

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

// Resuming (Trainer::load): the step asked for, or else the steps under `dir` newest first,
// until one loads. A step's manifest must read (read_manifest) and name `model` (another
// model's is an error, not a step passed over); then try_load(folder, manifest) reads it and
// returns why it refuses it, or nothing once it has loaded. A step asked for is refused
// outright; newer steps passed over are added to `refused` with their reasons, and when none
// loads the error lists them. Returns the step loaded.
template <class TryLoad>
int resume(const std::filesystem::path& dir, std::optional<int> step, const std::string& model,
           std::vector<Refusal>* refused, TryLoad&& try_load) {
  std::vector<Refusal> passed_over;
  auto report = [&] {
    if (refused) refused->insert(refused->end(), passed_over.begin(), passed_over.end());
  };
  for (const int s : step ? std::vector<int>{*step} : steps_with_manifest(dir)) {
    const std::filesystem::path folder = step_folder(dir, s);
    std::string why;
    std::optional<Manifest> m;
    try {
      m = read_manifest(folder);
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (m && m->model != model)
      throw io::SafetensorsError((folder / "manifest.json").string() + ": a checkpoint of " + m->model +
                                 ", not of this model (" + model + ")");
    if (m) {
      try {
        const std::optional<std::string> refusal = try_load(folder, *m);
        if (!refusal) return report(), m->step;
        why = *refusal;
      } catch (const io::SafetensorsError& e) {
        why = e.what();
      }
    }
    if (step) throw io::SafetensorsError(why);
    passed_over.push_back({s, why});
  }
  report();
  std::string why = dir.string() + ": holds no complete checkpoint";
  if (passed_over.empty()) why += " (no step-*/manifest.json)";
  for (const Refusal& r : passed_over) why += "; step " + std::to_string(r.step) + " refused: " + r.reason;
  throw io::SafetensorsError(why);
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
