#pragma once
// A model's weights in one safetensors file, with Hugging Face names and shapes, from and to
// the serial flat buffers of its ParamTables (nn/param_table.hpp): the dense one and, for a
// mixture of experts, the experts' (stacked experts are written as the spec's expert_files
// say: Mixtral's one tensor per expert, or the stack as it is). A parallel model gathers its
// pieces into such buffers to save, and slices them to load, so every mesh reads and writes
// the same file.
//
//   file_tensors<Dense, Experts>()              the file's tensors and where each lives
//   save_weights<Dense, Experts>(path, dense, experts, metadata)
//                                               every tensor in T's dtype (F32, F64 or
//                                               BF16); wte/lm_head without the padded
//                                               vocabulary rows; atomic (a temporary, rename)
//   load_weights<Dense, Experts>(file, dense, experts, what)
//                                               names with or without "transformer.";
//                                               HF's attention-mask buffers and, in a tied
//                                               model, lm_head.weight are ignored; any
//                                               floating dtype is converted. Everything is
//                                               checked before anything is written: a
//                                               missing, mis-shaped or unknown tensor is an
//                                               io::SafetensorsError naming it, and the
//                                               buffers are left unchanged.
// Experts = NoExperts (nn/param_table.hpp) for a dense model.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "fived/io/safetensors.hpp"
#include "fived/io/safetensors_writer.hpp"
#include "fived/nn/param_table.hpp"

namespace fived {

// A model's weights in its serial layouts: the dense buffer and its experts' (empty without).
template <class T>
struct SerialWeights {
  std::vector<T> dense, experts;
};

// One tensor of a weights file and where its values are in the serial buffers.
struct FileTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  bool expert = false;        // in the expert buffer, else the dense one
  std::size_t offset = 0;     // its first element there
  std::size_t size = 0;       // its elements in the file
  std::size_t held = 0;       // the buffer's (more: padded vocabulary rows, zero)
};

namespace checkpoint_detail {

template <class Layout>
void add_file_tensors(std::vector<FileTensor>& out, bool expert) {
  static_assert(Layout::tp == 1 && Layout::ep == 1, "a weights file maps serial buffers (ParamTable<Specs, 1, 1>)");
  for (const ParamInfo& t : Layout::tensors) {
    const TensorSpec& s = t.spec;
    const int parts = s.experts > 0 ? s.expert_files.parts() : 0;
    if (parts == 0) {
      out.push_back({t.name(), t.file_shape(), expert, t.offset, t.file_size(), t.size()});
      continue;
    }
    const std::int64_t rows = s.rows / s.experts / parts;  // one part of one expert
    const std::size_t n = static_cast<std::size_t>(rows * s.cols);
    for (int e = 0; e < s.experts; ++e)
      for (int p = 0; p < parts; ++p) {
        std::string name = s.expert_files.part[p];
        const std::size_t at = name.find("{}");
        if (at == std::string::npos)
          throw std::logic_error("fived::file_tensors: " + t.name() + "'s expert_files pattern '" + name +
                                 "' has no {} for the expert's index");
        name.replace(at, 2, std::to_string(e));
        out.push_back({s.scope + std::to_string(s.layer) + "." + name, {rows, s.cols}, expert,
                       t.offset + static_cast<std::size_t>(e * parts + p) * n, n, n});
      }
  }
}

// HF GPT2Attention's causal-mask buffers: "h.{i}.attn.bias", "h.{i}.attn.masked_bias".
inline bool is_hf_buffer(std::string_view n) {
  if (n.substr(0, 2) != "h.") return false;
  const std::size_t dot = n.find('.', 2);
  if (dot == std::string_view::npos) return false;
  const std::string_view rest = n.substr(dot + 1);
  return rest == "attn.bias" || rest == "attn.masked_bias";
}

inline void check_buffer(std::size_t have, std::size_t want, const char* fn, const char* which) {
  if (have != want)
    throw std::invalid_argument(std::string("fived::") + fn + ": the " + which + " buffer has " + std::to_string(have) +
                                " elements, the layout " + std::to_string(want));
}

}  // namespace checkpoint_detail

// The file's tensors in order: the dense layout's, then the experts'.
template <class Dense, class Experts = NoExperts>
std::vector<FileTensor> file_tensors() {
  std::vector<FileTensor> out;
  checkpoint_detail::add_file_tensors<Dense>(out, false);
  checkpoint_detail::add_file_tensors<Experts>(out, true);
  return out;
}

template <class Dense, class Experts = NoExperts, class T>
void save_weights(const std::filesystem::path& path, std::span<const T> dense, std::span<const T> experts,
                  const std::map<std::string, std::string>& metadata = {}) {
  checkpoint_detail::check_buffer(dense.size(), Dense::size, "save_weights", "dense");
  checkpoint_detail::check_buffer(experts.size(), Experts::size, "save_weights", "expert");
  io::SafetensorsWriter w;
  for (const FileTensor& t : file_tensors<Dense, Experts>())
    w.add(t.name, t.shape, (t.expert ? experts : dense).subspan(t.offset, t.size));
  w.add_metadata("format", "pt");
  for (const auto& [k, v] : metadata) w.add_metadata(k, v);
  w.write(path);
}

// `what` describes the model in error messages ("2 layers, d_model 64, ...").
template <class Dense, class Experts = NoExperts, class T>
void load_weights(const io::SafetensorsFile& f, std::span<T> dense, std::span<T> experts, const std::string& what) {
  checkpoint_detail::check_buffer(dense.size(), Dense::size, "load_weights", "dense");
  checkpoint_detail::check_buffer(experts.size(), Experts::size, "load_weights", "expert");
  const std::vector<FileTensor> want = file_tensors<Dense, Experts>();
  std::map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < want.size(); ++i) index.emplace(want[i].name, i);
  const bool tied = !Dense::find("lm_head.weight") && Dense::find("wte.weight");
  std::vector<const io::TensorEntry*> found(want.size(), nullptr);
  const io::TensorEntry* tied_head = nullptr;
  for (const io::TensorEntry& e : f.tensors()) {
    std::string_view n = e.name;
    if (n.substr(0, 12) == "transformer.") n.remove_prefix(12);
    if (checkpoint_detail::is_hf_buffer(n)) continue;
    if (tied && n == "lm_head.weight") {  // HF may store the tied copy of wte
      tied_head = &e;
      continue;
    }
    const auto it = index.find(n);
    if (it == index.end())
      throw io::SafetensorsError(f.source() + ": tensor '" + e.name + "' is not a parameter of this model (" + what +
                                 ")");
    if (found[it->second])
      throw io::SafetensorsError(f.source() + ": tensors '" + found[it->second]->name + "' and '" + e.name +
                                 "' are the same parameter");
    found[it->second] = &e;
  }
  for (std::size_t i = 0; i < want.size(); ++i) {
    const FileTensor& t = want[i];
    const io::TensorEntry* e = found[i];
    if (!e)
      throw io::SafetensorsError(f.source() + ": tensor '" + t.name + "' is missing (the model expects " +
                                 io::shape_string(t.shape) + ")");
    if (e->shape != t.shape)
      throw io::SafetensorsError(f.source() + ": " + t.name + " has shape " + io::shape_string(e->shape) +
                                 " in the file, the model expects " + io::shape_string(t.shape));
    if (!io::is_floating(e->dtype))
      throw io::SafetensorsError(f.source() + ": " + t.name + " is " + std::string(io::dtype_name(e->dtype)) +
                                 ", the model needs a floating-point dtype");
  }
  // A head stored next to wte in a tied model must be the same tensor; a different one
  // means the checkpoint is untied, and ignoring it would give a wrong model silently.
  if (tied_head) {
    const io::TensorEntry& wte = *found[index.at("wte.weight")];
    const auto a = f.bytes(*tied_head), b = f.bytes(wte);
    if (tied_head->shape != wte.shape || tied_head->dtype != wte.dtype || a.size() != b.size() ||
        !std::equal(a.begin(), a.end(), b.begin()))
      throw io::SafetensorsError(f.source() + ": lm_head.weight differs from wte.weight, so this checkpoint has an "
                                 "untied head; load it into a config with tied = false");
  }
  for (std::size_t i = 0; i < want.size(); ++i) {
    const FileTensor& t = want[i];
    std::span<T> buf = t.expert ? experts : dense;
    f.read_into(*found[i], buf.subspan(t.offset, t.size));
    std::fill(buf.begin() + static_cast<std::ptrdiff_t>(t.offset + t.size),
              buf.begin() + static_cast<std::ptrdiff_t>(t.offset + t.held), T{});  // padded rows
  }
}

}  // namespace fived
