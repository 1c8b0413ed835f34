#pragma once
// GPT weights in safetensors files with Hugging Face GPT-2 names and shapes, from
// and to the serial flat parameter buffer of a ParamTable (nn/param_table.hpp). A
// tensor-parallel model gathers its pieces into such a buffer to save, and slices one
// to load, so every mesh reads and writes the same file.
//
//   save_gpt<Layout>(path, params, metadata)    every tensor in T's dtype (F32, F64 or
//                                               BF16); wte/lm_head without the padded
//                                               vocabulary rows; atomic (a temporary, rename)
//   load_gpt<Layout>(file, params, what)        names with or without "transformer.";
//                                               HF's attention-mask buffers and, in a tied
//                                               model, lm_head.weight are ignored; any
//                                               floating dtype is converted. Everything is
//                                               checked before anything is written: a
//                                               missing, mis-shaped or unknown tensor is an
//                                               io::SafetensorsError naming it, and params
//                                               is left unchanged.

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
#include "fived/nn/param_table.hpp"

namespace fived {

namespace checkpoint_detail {

// HF GPT2Attention's causal-mask buffers: "h.{i}.attn.bias", "h.{i}.attn.masked_bias".
inline bool is_hf_buffer(std::string_view n) {
  if (n.substr(0, 2) != "h.") return false;
  const std::size_t dot = n.find('.', 2);
  if (dot == std::string_view::npos) return false;
  const std::string_view rest = n.substr(dot + 1);
  return rest == "attn.bias" || rest == "attn.masked_bias";
}

inline void check_buffer(std::size_t have, std::size_t want, const char* fn) {
  if (have != want)
    throw std::invalid_argument(std::string("fived::") + fn + ": the parameter buffer has " + std::to_string(have) +
                                " elements, the layout " + std::to_string(want));
}

}  // namespace checkpoint_detail

template <class Layout, class T>
void save_gpt(const std::filesystem::path& path, std::span<const T> params,
              const std::map<std::string, std::string>& metadata = {}) {
  static_assert(Layout::tp == 1, "save_gpt writes the serial buffer (ParamTable<Specs, 1>)");
  checkpoint_detail::check_buffer(params.size(), Layout::size, "save_gpt");
  io::SafetensorsWriter w;
  for (const ParamInfo& t : Layout::tensors) w.add(t.name(), t.file_shape(), params.subspan(t.offset, t.file_size()));
  w.add_metadata("format", "pt");
  for (const auto& [k, v] : metadata) w.add_metadata(k, v);
  w.write(path);
}

// `what` describes the model in error messages ("2 layers, d_model 64, ...").
template <class Layout, class T>
void load_gpt(const io::SafetensorsFile& f, std::span<T> params, const std::string& what) {
  checkpoint_detail::check_buffer(params.size(), Layout::size, "load_gpt");
  static_assert(Layout::tp == 1, "load_gpt reads into the serial buffer (ParamTable<Specs, 1>)");
  const bool tied = !Layout::find("lm_head.weight");
  std::vector<const io::TensorEntry*> found(Layout::count, nullptr);
  const io::TensorEntry* tied_head = nullptr;
  for (const io::TensorEntry& e : f.tensors()) {
    std::string_view n = e.name;
    if (n.substr(0, 12) == "transformer.") n.remove_prefix(12);
    if (checkpoint_detail::is_hf_buffer(n)) continue;
    if (tied && n == "lm_head.weight") {  // HF may store the tied copy of wte
      tied_head = &e;
      continue;
    }
    auto idx = Layout::find(n);
    if (!idx)
      throw io::SafetensorsError(f.source() + ": tensor '" + e.name + "' is not a parameter of this model (" + what +
                                 ")");
    if (found[static_cast<std::size_t>(*idx)])
      throw io::SafetensorsError(f.source() + ": tensors '" + found[static_cast<std::size_t>(*idx)]->name + "' and '" +
                                 e.name + "' are the same parameter");
    found[static_cast<std::size_t>(*idx)] = &e;
  }
  for (int i = 0; i < Layout::count; ++i) {
    const ParamInfo& t = Layout::tensors[static_cast<std::size_t>(i)];
    const std::vector<std::int64_t> want = t.file_shape();
    const io::TensorEntry* e = found[static_cast<std::size_t>(i)];
    if (!e)
      throw io::SafetensorsError(f.source() + ": tensor '" + t.name() + "' is missing (the model expects " +
                                 io::shape_string(want) + ")");
    if (e->shape != want)
      throw io::SafetensorsError(f.source() + ": " + t.name() + " has shape " + io::shape_string(e->shape) +
                                 " in the file, the model expects " + io::shape_string(want));
    if (!io::is_floating(e->dtype))
      throw io::SafetensorsError(f.source() + ": " + t.name() + " is " + std::string(io::dtype_name(e->dtype)) +
                                 ", the model needs a floating-point dtype");
  }
  // A head stored next to wte in a tied model must be the same tensor; a different one
  // means the checkpoint is untied, and ignoring it would give a wrong model silently.
  if (tied_head) {
    const io::TensorEntry& wte = *found[static_cast<std::size_t>(*Layout::find("wte.weight"))];
    const auto a = f.bytes(*tied_head), b = f.bytes(wte);
    if (tied_head->shape != wte.shape || tied_head->dtype != wte.dtype || a.size() != b.size() ||
        !std::equal(a.begin(), a.end(), b.begin()))
      throw io::SafetensorsError(f.source() + ": lm_head.weight differs from wte.weight, so this checkpoint has an "
                                 "untied head; load it into a config with tied = false");
  }
  for (int i = 0; i < Layout::count; ++i) {
    const ParamInfo& t = Layout::tensors[static_cast<std::size_t>(i)];
    f.read_into(*found[static_cast<std::size_t>(i)], params.subspan(t.offset, t.file_size()));
    std::fill(params.begin() + static_cast<std::ptrdiff_t>(t.offset + t.file_size()),
              params.begin() + static_cast<std::ptrdiff_t>(t.end()), T{});  // padded rows
  }
}

}  // namespace fived
