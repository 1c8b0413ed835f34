#pragma once
// Sharded training checkpoints: each rank writes what it owns, a manifest commits the step.
//
//   <dir>/step-00000042/rank-00000.safetensors ... rank-<W-1>.safetensors
//   <dir>/step-00000042/manifest.json
//
// A rank's file holds, for every bucket piece its DataParallel saves (its share of the
// group: every element once over the group, whatever the ZeRO stage), each tensor's part of
// it as one entry per kind of state: "params/<name>/<a>" in the model's dtype, and
// "master/...", "exp_avg/...", "exp_avg_sq/..." in fp32, a 1-D run of the rank's piece of the
// tensor from element a. The file's metadata names the piece: "tp", "tp_rank", "ep", "ep_rank"
// (nn/param_table.hpp's whole_index maps it to the whole tensor for any extents). No rank
// gathers the model: saving the 405B layout costs each rank its own shard.
//
// Atomic: every file is written under a temporary name, fsynced and renamed (io/safetensors),
// and the manifest, which names every file with its size and FNV-1a 64 hash, is written last
// the same way, after a barrier. A step without a manifest, or whose files do not match it,
// is not a checkpoint; a crash at any moment leaves the previous one whole.
//
// Loading, on any mesh: each rank reads the manifest, the step's index (train/manifest.hpp),
// and then only the tensor entries that hold the elements it needs (Restored<Model>), each
// checked against its hash; no rank assembles whole tensors or reads every file.
//
// The manifest is a small JSON object: format, step, the mesh and model it was saved from,
// AdamW's step count and the files. The data position is the step (the trainer's batches are
// a function of the seed and the step) and the learning rate a function of it; there is no
// other random state in a step.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "fived/io/safetensors.hpp"
#include "fived/train/checkpoint_folder.hpp"
#include "fived/model/contract.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/train/data_parallel.hpp"
#include "fived/util/fnv.hpp"

namespace fived::checkpoint {

// ---- entries of a rank's file -------------------------------------------------------------

inline const char* kind_name(TrainState k) {
  return k == TrainState::params ? "params" : k == TrainState::master ? "master" : k == TrainState::exp_avg ? "exp_avg" : "exp_avg_sq";
}
// A run of a rank's piece of `tensor` from its element `first`: "<kind>/<tensor>/<first>".
inline std::string entry_name(TrainState k, const std::string& tensor, std::size_t first) {
  return std::string(kind_name(k)) + "/" + tensor + "/" + std::to_string(first);
}
// The selection bias of the model's MoE block `block`.
inline std::string bias_entry_name(int block) { return "router_bias/" + std::to_string(block) + "/0"; }

template <class Model>
struct expert_layout_of {
  using type = NoExperts;  // nn/param_table.hpp
};
template <class Model>
  requires requires { typename Model::serial_expert_layout; }
struct expert_layout_of<Model> {
  using type = typename Model::serial_expert_layout;
};
// The MoE blocks of a whole model and the experts of each (0 without).
template <class Model>
constexpr int moe_blocks_of() {
  if constexpr (requires { Model::moe_blocks_before(0); }) return Model::moe_blocks_before(Model::layers);
  else return 0;
}
template <class Model>
constexpr int experts_per_block_of() {
  if constexpr (requires { Model::experts_per_block; }) return Model::experts_per_block;
  else return 0;
}

// The metadata key under which a rank's file records the FNV-1a 64 hash of a tensor's bytes
// (checkpoint::Shard writes it), for the manifest's index (train/manifest.hpp).
inline std::string hash_key(const std::string& tensor) { return "fnv1a64/" + tensor; }

// A rank's file as the manifest indexes it, from its header: its metadata (the hashes taken
// out) and each tensor's bytes in the file, with the hash its Shard recorded (0 in files of
// an older fived, which recorded none; their manifest's file hash checks them instead).
inline void index_file(const io::SafetensorsFile& header, FileEntry& e) {
  e.metadata = header.metadata();
  for (const io::TensorEntry& t : header.tensors()) {
    const auto h = e.metadata.find(hash_key(t.name));
    e.tensors.push_back({t.name, t.dtype, header.data_start() + t.begin, header.data_start() + t.end,
                         h == e.metadata.end() ? 0 : std::stoull(h->second, nullptr, 16)});
  }
  std::erase_if(e.metadata, [](const auto& kv) { return kv.first.rfind("fnv1a64/", 0) == 0; });
}

// A failure to read what a rank needs from a step's files: which file (the number of files
// for none in particular) and why. The ranks that load agree on the first failure of any of
// them (the smallest code()), so all refuse the step with one sentence (Restored::failure).
struct ReadFailure {
  enum Why : int { contents = 0, unreadable = 1, lacking = 2 };
  int file;
  Why why;
  int code() const { return file * 3 + why; }
};

// A model's state as one step's files give it, whatever mesh wrote them, read a rank's share
// at a time: want<L>(kind, range, tp_rank, ep_rank) reads what values<L>() with the same
// arguments then gives, i.e. the elements [range) of a rank's buffer laid out by L (the
// dense or expert layout of a stage, on TP rank tp_rank and EP rank ep_rank). Each element's
// place in the whole tensor (nn/param_table.hpp's global_index) is found in the piece of a
// file that holds it (piece_index, the manifest's index), and only the tensor entries that
// hold wanted elements are read, whole, each checked against its hash in the index (format
// 3; the files of older manifests, which read_manifest has checked whole, through their
// headers). A bf16 model's masters from a checkpoint without them are its parameters.
//
// Or a start from given weights (start_from): no files; fresh AdamW moments.
template <ModelType Model>
class Restored {
 public:
  using dense = typename Model::serial_layout;
  using experts = typename expert_layout_of<Model>::type;

  Restored() = default;
  Restored(const std::filesystem::path& folder, const Manifest& m) {
    for (const FileEntry& f : m.files) {
      if (m.indexed()) {
        add_file(folder / f.name, f.metadata, f.tensors, true);
        continue;
      }
      FileEntry e;  // an older manifest: the file's header says where its tensors are
      index_file(io::SafetensorsFile::read_header(folder / f.name), e);
      add_file(folder / f.name, e.metadata, e.tensors, false);
    }
    for (auto& [key, runs] : runs_) std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.first < b.first; });
  }

  // A start from given weights instead of files: the whole dense model in serial_layout
  // order and its experts in the expert layout's (none without), fresh AdamW moments (zero),
  // no selection bias moved (zero).
  template <class U>
  void start_from(std::span<const U> weights, std::span<const U> expert_weights = {}) {
    if (weights.size() != dense::size || expert_weights.size() != experts::size)
      throw std::invalid_argument("checkpoint::Restored::start_from: " + std::to_string(weights.size()) + " and " +
                                  std::to_string(expert_weights.size()) + " values for a model of " +
                                  std::to_string(dense::size) + " and " + std::to_string(experts::size) +
                                  " (its serial_layout and its experts')");
    given_.resize(weights.size() + expert_weights.size());  // the experts after the dense values, as find() counts
    for (std::size_t i = 0; i < weights.size(); ++i) given_[i] = static_cast<double>(static_cast<acc_t<U>>(weights[i]));
    for (std::size_t i = 0; i < expert_weights.size(); ++i)
      given_[weights.size() + i] = static_cast<double>(static_cast<acc_t<U>>(expert_weights[i]));
    from_given_ = true;
  }

  // Reads what values<L>(k, r, tp_rank, ep_rank) gives; throws ReadFailure.
  template <class L>
  void want(TrainState k, FlatRange r, int tp_rank, int ep_rank) {
    if (from_given_) return;
    std::vector<double>& out = prepared_[key<L>(k, r, tp_rank, ep_rank)];
    out.assign(r.size(), 0.0);
    const std::string kind = k == TrainState::master && !has_master_ ? "params" : kind_name(k);
    for (int i = 0; i < L::count; ++i) {
      const ParamInfo& t = L::tensors[static_cast<std::size_t>(i)];
      const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
      if (b >= e) continue;
      const TensorSpec& whole = find(t.name())->second->spec;
      const std::vector<Run>* runs = nullptr;
      std::pair<int, int> runs_of{-1, -1};  // the (piece, EP rank) `runs` are of
      const Run* run = nullptr;             // the run the last element was in, and its bytes
      const std::byte* bytes = nullptr;
      for (std::size_t j = b; j < e; ++j) {
        const PieceIndex at =
            piece_index(whole, tp_, ep_, L::global_index(i, tp_rank, static_cast<std::int64_t>(j - t.offset), ep_rank));
        if (runs_of != std::pair{at.piece, at.ep_rank}) {
          const auto it = runs_.find({kind, t.name(), at.piece, at.ep_rank});
          runs = it == runs_.end() ? nullptr : &it->second;
          runs_of = {at.piece, at.ep_rank}, run = nullptr;
        }
        if (!run || at.local < run->first || at.local >= run->first + run->count) {
          run = nullptr;
          if (runs) {
            auto next = std::upper_bound(runs->begin(), runs->end(), at.local,
                                         [](std::int64_t x, const Run& q) { return x < q.first; });
            if (next != runs->begin() && at.local < (next - 1)->first + (next - 1)->count) run = &*(next - 1);
          }
          if (!run) throw ReadFailure{static_cast<int>(files_.size()), ReadFailure::lacking};
          bytes = bytes_of(run->file, run->entry).data();
        }
        out[j - r.begin] = io::floating_element(files_[run->file].tensors[run->entry].dtype, bytes,
                                                static_cast<std::size_t>(at.local - run->first));
      }
    }
  }
  // Reads the selection bias of the model's MoE block `block`.
  void want_bias(int block) {
    if (from_given_) return;
    const auto it = bias_at_.find(block);
    if (it == bias_at_.end()) throw ReadFailure{static_cast<int>(files_.size()), ReadFailure::lacking};
    const auto [file, entry] = it->second;
    const std::vector<std::byte>& bytes = bytes_of(file, entry);
    std::vector<float>& v = bias_[block];
    v.resize(static_cast<std::size_t>(experts_per_block_of<Model>()));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>(io::floating_element(files_[file].tensors[entry].dtype, bytes.data(), i));
  }

  // Values [b, e) of a rank's buffer laid out by L, of kind k, as want() read them: for
  // DataParallel::load_state.
  template <class L>
  std::vector<double> values(TrainState k, FlatRange r, int tp_rank, int ep_rank) const {
    if (from_given_) {  // the parameters given (masters too), zero moments
      std::vector<double> out(r.size(), 0.0);
      if (k != TrainState::params && k != TrainState::master) return out;
      for (int i = 0; i < L::count; ++i) {
        const ParamInfo& t = L::tensors[static_cast<std::size_t>(i)];
        const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end), base = find(t.name())->first;
        for (std::size_t j = b; j < e; ++j)
          out[j - r.begin] = given_[base + static_cast<std::size_t>(L::global_index(i, tp_rank, static_cast<std::int64_t>(j - t.offset), ep_rank))];
      }
      return out;
    }
    const auto it = prepared_.find(key<L>(k, r, tp_rank, ep_rank));
    if (it == prepared_.end()) throw std::logic_error("checkpoint::Restored::values: not read by want() first");
    return it->second;
  }

  // The selection bias of the model's MoE block `block`.
  std::vector<float> bias(int block) const {
    if (from_given_) return std::vector<float>(static_cast<std::size_t>(experts_per_block_of<Model>()), 0.0f);
    const auto it = bias_.find(block);
    if (it == bias_.end()) throw std::logic_error("checkpoint::Restored::bias: not read by want_bias() first");
    return it->second;
  }

  // The sentence every rank says of the first failure of any (the smallest code, which the
  // ranks agree on; see Trainer::load).
  std::string failure(int code) const {
    const int file = code / 3;
    const auto why = static_cast<ReadFailure::Why>(code % 3);
    if (why == ReadFailure::lacking || file >= static_cast<int>(files_.size()))
      return "the checkpoint's files do not hold every element of this model (they are not those of one save of it)";
    const std::string path = files_[static_cast<std::size_t>(file)].path.string();
    return why == ReadFailure::contents ? path + ": its contents do not match the manifest's hash"
                                        : path + ": cannot be read where the manifest's index says its tensors are";
  }

 private:
  struct File {
    std::filesystem::path path;
    std::vector<IndexedTensor> tensors;
    bool hashed = false;  // each tensor's hash is known (format 3)
    std::ifstream in{};
  };
  // A run of a piece's elements [first, first + count) in tensor entry `entry` of file `file`.
  struct Run {
    std::int64_t first, count;
    std::size_t file, entry;
  };
  using RunKey = std::tuple<std::string, std::string, int, int>;  // kind, tensor, piece, EP rank
  using Key = std::tuple<int, const void*, std::size_t, std::size_t, int, int>;
  template <class L>
  static Key key(TrainState k, FlatRange r, int tp_rank, int ep_rank) {
    return {static_cast<int>(k), static_cast<const void*>(&L::tensors), r.begin, r.end, tp_rank, ep_rank};
  }

  // Where a tensor starts in the whole model (dense, then experts), with its whole spec.
  static std::optional<std::pair<std::size_t, const ParamInfo*>> find(std::string_view name) {
    if (const auto i = dense::find(name))
      return std::pair{dense::tensors[static_cast<std::size_t>(*i)].offset, &dense::tensors[static_cast<std::size_t>(*i)]};
    if (const auto i = experts::find(name))
      return std::pair{dense::size + experts::tensors[static_cast<std::size_t>(*i)].offset,
                       &experts::tensors[static_cast<std::size_t>(*i)]};
    return std::nullopt;
  }

  // Indexes a file's entries: the placement in its metadata, then each run of a piece.
  void add_file(const std::filesystem::path& path, const std::map<std::string, std::string>& metadata,
                const std::vector<IndexedTensor>& tensors, bool hashed) {
    const std::string source = path.string();
    auto meta = [&](const char* key) {
      const auto it = metadata.find(key);
      if (it == metadata.end()) throw io::SafetensorsError(source + ": lacks the metadata \"" + key + "\"");
      try {
        return std::stoi(it->second);
      } catch (const std::exception&) {
        throw io::SafetensorsError(source + ": metadata \"" + key + "\" is not a number");
      }
    };
    const int tp = meta("tp"), tp_rank = meta("tp_rank"), ep = meta("ep"), ep_rank = meta("ep_rank");
    if (tp < 1 || ep < 1 || tp_rank < 0 || tp_rank >= tp || ep_rank < 0 || ep_rank >= ep)
      throw io::SafetensorsError(source + ": its placement (tp " + std::to_string(tp_rank) + " of " + std::to_string(tp) +
                                 ", ep " + std::to_string(ep_rank) + " of " + std::to_string(ep) + ") is not one");
    if (files_.empty()) tp_ = tp, ep_ = ep;
    if (tp != tp_ || ep != ep_)
      throw io::SafetensorsError(source + ": saved on TP " + std::to_string(tp) + " and EP " + std::to_string(ep) +
                                 ", another file of the step on TP " + std::to_string(tp_) + " and EP " +
                                 std::to_string(ep_) + " (the files are not those of one save)");
    const std::size_t file = files_.size();
    files_.push_back({path, tensors, hashed});
    for (std::size_t n = 0; n < tensors.size(); ++n) {
      const IndexedTensor& e = tensors[n];
      const std::size_t a = e.name.find('/'), b = e.name.rfind('/');
      const std::string kind = e.name.substr(0, a == std::string::npos ? 0 : a);
      const std::string tensor = a == std::string::npos || a == b ? std::string() : e.name.substr(a + 1, b - a - 1);
      const auto count = static_cast<std::int64_t>((e.end - e.begin) / io::dtype_size(e.dtype));
      if (!io::is_floating(e.dtype))
        throw io::SafetensorsError(source + ": entry '" + e.name + "' is " + std::string(io::dtype_name(e.dtype)) +
                                   ", a checkpoint's state is floating-point");
      if (kind == "router_bias") {
        int block = -1;
        try {
          block = std::stoi(tensor);
        } catch (const std::exception&) {
        }
        if (block < 0 || block >= moe_blocks_of<Model>() || count != experts_per_block_of<Model>())
          throw io::SafetensorsError(source + ": entry '" + e.name + "' is no MoE block's selection bias of this model");
        bias_at_[block] = {file, n};
        continue;
      }
      const auto where = find(tensor);
      if (!where) throw io::SafetensorsError(source + ": entry '" + e.name + "' names no tensor of this model");
      const TensorSpec& spec = where->second->spec;
      const std::int64_t piece = piece_extent(spec, 0, tp, ep) * piece_extent(spec, 1, tp, ep);
      std::int64_t first = -1;
      try {
        first = std::stoll(e.name.substr(b + 1));
      } catch (const std::exception&) {
      }
      if (first < 0 || first + count > piece)
        throw io::SafetensorsError(source + ": entry '" + e.name + "' does not fit the tensor's piece of " +
                                   std::to_string(piece) + " elements");
      has_master_ = has_master_ || kind == "master";
      const int piece_of_rank = spec.tp.dim < 0 ? 0 : tp_rank / spec.tp.replicas(tp);
      runs_[RunKey{kind, tensor, piece_of_rank, spec.experts > 0 ? ep_rank : 0}].push_back({first, count, file, n});
    }
  }

  // A tensor entry's bytes, read once (and checked against its hash where the index has it).
  const std::vector<std::byte>& bytes_of(std::size_t file, std::size_t entry) {
    std::vector<std::byte>& bytes = read_[{file, entry}];
    File& f = files_[file];
    const IndexedTensor& t = f.tensors[entry];
    if (!bytes.empty() || t.end == t.begin) return bytes;
    try {
      if (!f.in.is_open()) f.in.open(f.path, std::ios::binary);
      bytes = io::read_range(f.in, f.path, t.begin, t.end - t.begin);
    } catch (const std::exception&) {
      throw ReadFailure{static_cast<int>(file), ReadFailure::unreadable};
    }
    util::Fnv1a64 h;
    h.add(std::span<const std::byte>(bytes));
    if (f.hashed && h.value() != t.hash) throw ReadFailure{static_cast<int>(file), ReadFailure::contents};
    return bytes;
  }

  std::vector<File> files_;
  int tp_ = 1, ep_ = 1;  // what the files were saved on
  bool has_master_ = false;
  std::map<RunKey, std::vector<Run>> runs_;
  std::map<int, std::pair<std::size_t, std::size_t>> bias_at_;  // block -> (file, entry)
  std::map<std::pair<std::size_t, std::size_t>, std::vector<std::byte>> read_;
  std::map<Key, std::vector<double>> prepared_;
  std::map<int, std::vector<float>> bias_;
  bool from_given_ = false;
  std::vector<double> given_;
};

}  // namespace fived::checkpoint
