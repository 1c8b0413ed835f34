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
// Loading, on any mesh: Restored<Model> scatters every rank's file into whole tensors (each
// piece placed by the metadata), from which a rank takes the ranges it holds.
//
// The manifest is a small JSON object: format, step, the mesh and model it was saved from,
// AdamW's step count and the files. The data position is the step (the trainer's batches are
// a function of the seed and the step) and the learning rate a function of it; there is no
// other random state in a step.

#include <algorithm>
#include <array>
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

// A model without a mixture of experts: no expert tensors.
struct NoExpertLayout {
  static constexpr std::size_t size = 0;
  static constexpr int count = 0;
  static constexpr std::array<ParamInfo, 0> tensors{};
  static std::optional<int> find(std::string_view) { return std::nullopt; }
};
template <class Model>
struct expert_layout_of {
  using type = NoExpertLayout;
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

// A whole model's state as a checkpoint's files give it, whatever mesh wrote them: every kind
// of state in the serial layouts of Model (the whole model's type: the dense buffer, then the
// experts'), with which elements were given, and each MoE block's selection bias. add()
// scatters a rank's file through its pieces' placement (the file's metadata and
// nn/param_table.hpp's whole_index).
template <ModelType Model>
class Restored {
 public:
  using dense = typename Model::serial_layout;
  using experts = typename expert_layout_of<Model>::type;

  void add(const io::SafetensorsFile& f) {
    auto meta = [&](const char* key) {
      const auto it = f.metadata().find(key);
      if (it == f.metadata().end()) throw io::SafetensorsError(f.source() + ": lacks the metadata \"" + key + "\"");
      try {
        return std::stoi(it->second);
      } catch (const std::exception&) {
        throw io::SafetensorsError(f.source() + ": metadata \"" + key + "\" is not a number");
      }
    };
    const int tp = meta("tp"), tp_rank = meta("tp_rank"), ep = meta("ep"), ep_rank = meta("ep_rank");
    if (tp < 1 || ep < 1 || tp_rank < 0 || tp_rank >= tp || ep_rank < 0 || ep_rank >= ep)
      throw io::SafetensorsError(f.source() + ": its placement (tp " + std::to_string(tp_rank) + " of " +
                                 std::to_string(tp) + ", ep " + std::to_string(ep_rank) + " of " + std::to_string(ep) +
                                 ") is not one");
    for (const io::TensorEntry& e : f.tensors()) {
      const std::size_t a = e.name.find('/'), b = e.name.rfind('/');
      const std::string kind = e.name.substr(0, a == std::string::npos ? 0 : a);
      const std::string tensor = a == std::string::npos || a == b ? std::string() : e.name.substr(a + 1, b - a - 1);
      if (kind == "router_bias") {
        int block = -1;
        try {
          block = std::stoi(tensor);
        } catch (const std::exception&) {
        }
        if (block < 0 || block >= moe_blocks_of<Model>() ||
            e.numel() != static_cast<std::size_t>(experts_per_block_of<Model>()))
          throw io::SafetensorsError(f.source() + ": entry '" + e.name + "' is no MoE block's selection bias of this model");
        std::vector<float>& v = bias_[block];
        v.resize(e.numel());
        f.read_into(e, std::span<float>(v));
        continue;
      }
      const auto where = find(tensor);
      if (!where) throw io::SafetensorsError(f.source() + ": entry '" + e.name + "' names no tensor of this model");
      const auto [base, t] = *where;
      const std::int64_t piece = piece_extent(t->spec, 0, tp, ep) * piece_extent(t->spec, 1, tp, ep);
      std::int64_t first = -1;
      try {
        first = std::stoll(e.name.substr(b + 1));
      } catch (const std::exception&) {
      }
      if (first < 0 || e.shape.size() != 1 || first + e.shape[0] > piece)
        throw io::SafetensorsError(f.source() + ": entry '" + e.name + "' does not fit the tensor's piece of " +
                                   std::to_string(piece) + " elements");
      std::vector<double> v(e.numel());
      f.read_into(e, std::span<double>(v));
      Whole& w = state_[kind];
      if (w.values.empty()) w.values.assign(size, 0.0), w.given.assign(size, false);
      for (std::size_t k = 0; k < v.size(); ++k) {
        const auto at = base + static_cast<std::size_t>(whole_index(t->spec, tp, ep, tp_rank, ep_rank, first + static_cast<std::int64_t>(k)));
        w.values[at] = v[k];
        w.given[at] = true;
      }
    }
  }

  // A start from given weights instead of files: the whole dense model in serial_layout
  // order, fresh AdamW moments (zero), no selection bias moved (zero). Experts are not given:
  // a model with a mixture of experts starts from its own initialisation.
  template <class U>
  void start_from(std::span<const U> dense) {
    if (dense.size() != dense::size)
      throw std::invalid_argument("checkpoint::Restored::start_from: " + std::to_string(dense.size()) +
                                  " values for a model of " + std::to_string(dense::size) + " (its serial_layout)");
    if constexpr (experts::size > 0)
      throw std::invalid_argument("checkpoint::Restored::start_from: a model with a mixture of experts needs its "
                                  "experts given too; start it from its own initialisation or a checkpoint");
    Whole& p = state_["params"];
    p.values.assign(size, 0.0), p.given.assign(size, true);
    for (std::size_t i = 0; i < dense.size(); ++i) p.values[i] = static_cast<double>(static_cast<acc_t<U>>(dense[i]));
    for (const char* k : {"exp_avg", "exp_avg_sq"}) state_[k] = Whole{std::vector<double>(size, 0.0), std::vector<bool>(size, true)};
    for (int b = 0; b < moe_blocks_of<Model>(); ++b) bias_[b].assign(static_cast<std::size_t>(experts_per_block_of<Model>()), 0.0f);
  }

  // Values [b, e) of a rank's buffer laid out by L (its TP rank, EP rank), of kind k: for
  // DataParallel::load_state. A bf16 model's masters from a checkpoint without them are its
  // parameters.
  template <class L>
  std::vector<double> values(TrainState k, FlatRange r, int tp_rank, int ep_rank) const {
    const char* kind = k == TrainState::master && !state_.count("master") ? "params" : kind_name(k);
    const auto it = state_.find(kind);
    if (it == state_.end()) throw io::SafetensorsError(std::string("the checkpoint holds no \"") + kind + "\" state");
    std::vector<double> out(r.size());
    for (int i = 0; i < L::count; ++i) {
      const ParamInfo& t = L::tensors[static_cast<std::size_t>(i)];
      const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
      if (b >= e) continue;
      const std::size_t base = find(t.name())->first;
      for (std::size_t j = b; j < e; ++j) {
        const std::size_t at = base + static_cast<std::size_t>(L::global_index(i, tp_rank, static_cast<std::int64_t>(j - t.offset), ep_rank));
        if (!it->second.given[at])
          throw io::SafetensorsError("the checkpoint lacks element " + std::to_string(at - base) + " of " + t.name() +
                                     " (" + kind + "): none of its files holds it (the files are not those of one "
                                     "save of this model)");
        out[j - r.begin] = it->second.values[at];
      }
    }
    return out;
  }

  // The selection bias of the model's MoE block `block`.
  const std::vector<float>& bias(int block) const {
    const auto it = bias_.find(block);
    if (it == bias_.end())
      throw io::SafetensorsError("the checkpoint holds no selection bias for MoE block " + std::to_string(block));
    return it->second;
  }

 private:
  struct Whole {
    std::vector<double> values;
    std::vector<bool> given;
  };
  static constexpr std::size_t size = dense::size + experts::size;
  // Where a tensor starts in a Whole (dense or expert), with its whole spec.
  static std::optional<std::pair<std::size_t, const ParamInfo*>> find(std::string_view name) {
    if (const auto i = dense::find(name))
      return std::pair{dense::tensors[static_cast<std::size_t>(*i)].offset, &dense::tensors[static_cast<std::size_t>(*i)]};
    if (const auto i = experts::find(name))
      return std::pair{dense::size + experts::tensors[static_cast<std::size_t>(*i)].offset,
                       &experts::tensors[static_cast<std::size_t>(*i)]};
    return std::nullopt;
  }

  std::map<std::string, Whole> state_;  // per kind of state
  std::map<int, std::vector<float>> bias_;
};

}  // namespace fived::checkpoint
