#pragma once
// The parameter layout of a GPT, computed at compile time from its configuration.
//
// All parameters live in ONE contiguous buffer (and the gradients in a second one with the
// same layout). The order is
//
//   wte.weight [Vp, C]   wpe.weight [max_seq, C]
//   h.0.*  (12 tensors, below)   h.1.*  ...   h.{L-1}.*     <- each layer one contiguous block
//   ln_f.weight [C]   ln_f.bias [C]   (lm_head.weight [Vp, C] when the model is untied)
//
// with, per layer (Hugging Face GPT-2 names; Conv1D weights are stored [in, out], y = x W):
//
//   ln_1.weight [C]  ln_1.bias [C]
//   attn.c_attn.weight [C, 3C]  attn.c_attn.bias [3C]
//   attn.c_proj.weight [C, C]   attn.c_proj.bias [C]
//   ln_2.weight [C]  ln_2.bias [C]
//   mlp.c_fc.weight [C, 4C]     mlp.c_fc.bias [4C]
//   mlp.c_proj.weight [4C, C]   mlp.c_proj.bias [C]
//
// so a pipeline stage owns a contiguous range (`layer_begin(l)`, `layer_end(l)`).
//
// Padding: the buffer holds the PADDED vocabulary, wte (and lm_head) are [Vp, C] with
// Vp = gpt_dims<Cfg>::padded_vocab; rows [V, Vp) are zero. `size` counts buffer elements
// (padding included); `num_parameters` counts real parameters, the number Hugging Face
// reports and the files hold (wte [V, C]): GPT-2 124M has num_parameters == 124,439,808
// and size == 124,475,904 (vocab 50257 padded to 50304).
//
// Every tensor's size is a multiple of C, so with C a multiple of 8 every offset is
// 16-byte aligned for fp16/bf16 and 32-byte aligned for fp32.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "fived/nn/config.hpp"

namespace fived {

enum class ParamKind : std::uint8_t {
  // global, before the layers
  wte,
  wpe,
  // per layer, in this order
  ln_1_weight,
  ln_1_bias,
  attn_c_attn_weight,
  attn_c_attn_bias,
  attn_c_proj_weight,
  attn_c_proj_bias,
  ln_2_weight,
  ln_2_bias,
  mlp_c_fc_weight,
  mlp_c_fc_bias,
  mlp_c_proj_weight,
  mlp_c_proj_bias,
  // global, after the layers
  ln_f_weight,
  ln_f_bias,
  lm_head,  // only in untied models
};

inline constexpr int params_per_layer = 12;

constexpr bool is_layer_kind(ParamKind k) {
  return k >= ParamKind::ln_1_weight && k <= ParamKind::mlp_c_proj_bias;
}

// The Hugging Face name without the "h.{i}." prefix of layer tensors.
constexpr std::string_view hf_suffix(ParamKind k) {
  switch (k) {
    case ParamKind::wte: return "wte.weight";
    case ParamKind::wpe: return "wpe.weight";
    case ParamKind::ln_1_weight: return "ln_1.weight";
    case ParamKind::ln_1_bias: return "ln_1.bias";
    case ParamKind::attn_c_attn_weight: return "attn.c_attn.weight";
    case ParamKind::attn_c_attn_bias: return "attn.c_attn.bias";
    case ParamKind::attn_c_proj_weight: return "attn.c_proj.weight";
    case ParamKind::attn_c_proj_bias: return "attn.c_proj.bias";
    case ParamKind::ln_2_weight: return "ln_2.weight";
    case ParamKind::ln_2_bias: return "ln_2.bias";
    case ParamKind::mlp_c_fc_weight: return "mlp.c_fc.weight";
    case ParamKind::mlp_c_fc_bias: return "mlp.c_fc.bias";
    case ParamKind::mlp_c_proj_weight: return "mlp.c_proj.weight";
    case ParamKind::mlp_c_proj_bias: return "mlp.c_proj.bias";
    case ParamKind::ln_f_weight: return "ln_f.weight";
    case ParamKind::ln_f_bias: return "ln_f.bias";
    case ParamKind::lm_head: return "lm_head.weight";
  }
  return "?";
}

// One tensor of the layout. Shapes are row-major; 1-D tensors have rank 1 and cols == 1.
struct ParamInfo {
  ParamKind kind{};
  int layer = -1;            // -1 for global tensors
  std::size_t offset = 0;    // first element in the flat buffer
  int rank = 1;              // 1 or 2
  std::int64_t rows = 0;     // shape in the buffer: [rows] or [rows, cols]
  std::int64_t cols = 1;
  std::int64_t file_rows = 0;  // rows in a Hugging Face file (unpadded vocabulary for wte/lm_head)

  constexpr std::size_t size() const { return static_cast<std::size_t>(rows * cols); }
  constexpr std::size_t file_size() const { return static_cast<std::size_t>(file_rows * cols); }
  // The shape in a Hugging Face file (no padded vocabulary rows).
  std::vector<std::int64_t> file_shape() const {
    return rank == 2 ? std::vector<std::int64_t>{file_rows, cols} : std::vector<std::int64_t>{file_rows};
  }
  constexpr std::size_t end() const { return offset + size(); }
  // A stable id for the initialiser's random stream: independent of the layer count and of
  // tying, so adding layers or untying does not change the other tensors' initial values.
  constexpr std::uint64_t stream_id() const {
    return static_cast<std::uint64_t>(layer + 1) * 64u + static_cast<std::uint64_t>(kind);
  }
  // "h.3.mlp.c_fc.weight", "wte.weight", ...
  std::string name() const {
    std::string s;
    if (layer >= 0) s = "h." + std::to_string(layer) + ".";
    s += hf_suffix(kind);
    return s;
  }
};

template <class Cfg>
struct GptLayout {
  using dims = gpt_dims<Cfg>;
  static constexpr int L = dims::layers;
  static constexpr std::int64_t C = dims::d_model;
  static constexpr std::int64_t V = dims::vocab;
  static constexpr std::int64_t Vp = dims::padded_vocab;
  static constexpr std::int64_t F = dims::d_ff;
  static constexpr bool tied = dims::tied;

  static constexpr int count = 2 + params_per_layer * L + 2 + (tied ? 0 : 1);  // number of tensors

 private:
  static constexpr std::array<ParamInfo, count> build() {
    std::array<ParamInfo, count> t{};
    std::size_t off = 0;
    int i = 0;
    auto add = [&](ParamKind k, int layer, int rank, std::int64_t rows, std::int64_t cols, std::int64_t file_rows) {
      t[i] = ParamInfo{k, layer, off, rank, rows, cols, file_rows};
      off += t[i].size();
      ++i;
    };
    add(ParamKind::wte, -1, 2, Vp, C, V);
    add(ParamKind::wpe, -1, 2, dims::max_seq, C, dims::max_seq);
    for (int l = 0; l < L; ++l) {
      add(ParamKind::ln_1_weight, l, 1, C, 1, C);
      add(ParamKind::ln_1_bias, l, 1, C, 1, C);
      add(ParamKind::attn_c_attn_weight, l, 2, C, 3 * C, C);
      add(ParamKind::attn_c_attn_bias, l, 1, 3 * C, 1, 3 * C);
      add(ParamKind::attn_c_proj_weight, l, 2, C, C, C);
      add(ParamKind::attn_c_proj_bias, l, 1, C, 1, C);
      add(ParamKind::ln_2_weight, l, 1, C, 1, C);
      add(ParamKind::ln_2_bias, l, 1, C, 1, C);
      add(ParamKind::mlp_c_fc_weight, l, 2, C, F, C);
      add(ParamKind::mlp_c_fc_bias, l, 1, F, 1, F);
      add(ParamKind::mlp_c_proj_weight, l, 2, F, C, F);
      add(ParamKind::mlp_c_proj_bias, l, 1, C, 1, C);
    }
    add(ParamKind::ln_f_weight, -1, 1, C, 1, C);
    add(ParamKind::ln_f_bias, -1, 1, C, 1, C);
    if constexpr (!tied) add(ParamKind::lm_head, -1, 2, Vp, C, V);
    return t;
  }

 public:
  static constexpr std::array<ParamInfo, count> tensors = build();

  // Elements in the flat buffer (padding rows included).
  static constexpr std::size_t size = tensors[count - 1].end();
  // Real parameters, as Hugging Face counts them (padding rows excluded).
  static constexpr std::size_t num_parameters =
      size - static_cast<std::size_t>((Vp - V) * C) * (tied ? 1u : 2u);

  // Position of (kind, layer) in `tensors`; layer is ignored (pass -1) for global kinds.
  // In a constant expression a kind/layer that does not exist fails to compile.
  static constexpr int index(ParamKind k, int layer = -1) {
    if (is_layer_kind(k)) {
      if (layer < 0 || layer >= L) throw std::out_of_range("GptLayout::index: layer " + std::to_string(layer) + " does not exist (the model has " + std::to_string(L) + " layers)");
      return 2 + layer * params_per_layer + (static_cast<int>(k) - static_cast<int>(ParamKind::ln_1_weight));
    }
    switch (k) {
      case ParamKind::wte: return 0;
      case ParamKind::wpe: return 1;
      case ParamKind::ln_f_weight: return 2 + params_per_layer * L;
      case ParamKind::ln_f_bias: return 3 + params_per_layer * L;
      case ParamKind::lm_head:
        if (tied) throw std::invalid_argument("GptLayout::index: a tied model has no lm_head.weight (it uses wte.weight)");
        return 4 + params_per_layer * L;
      default: break;
    }
    throw std::invalid_argument("GptLayout::index: unknown parameter kind");
  }
  static constexpr const ParamInfo& info(ParamKind k, int layer = -1) { return tensors[index(k, layer)]; }
  static constexpr std::size_t offset(ParamKind k, int layer = -1) { return info(k, layer).offset; }

  // The contiguous block of layer l: [layer_begin(l), layer_end(l)).
  static constexpr std::size_t layer_begin(int l) { return offset(ParamKind::ln_1_weight, l); }
  static constexpr std::size_t layer_end(int l) { return info(ParamKind::mlp_c_proj_bias, l).end(); }
  static constexpr std::size_t layer_size = layer_end(0) - layer_begin(0);

  // Units: the ranges a trainer gathers, reduces and frees together (ZeRO-3 gathers a unit's
  // parameters just before it runs). Unit 0 holds the embeddings, units 1..L the layers, and
  // unit L+1 holds ln_f (and lm_head). Unit u is [unit_begin(u), unit_begin(u + 1)).
  static constexpr int units = L + 2;
  static constexpr std::size_t unit_begin(int u) {
    return u <= 0 ? 0 : u <= L ? layer_begin(u - 1) : u == L + 1 ? offset(ParamKind::ln_f_weight) : size;
  }

  // The tensor that the output projection multiplies with: wte when tied, else lm_head.
  static constexpr ParamKind head_kind = tied ? ParamKind::wte : ParamKind::lm_head;

  // Look a tensor up by its Hugging Face name ("h.3.attn.c_proj.bias", "wte.weight"). The
  // name must be exact: prefixes such as "transformer." are the loader's business.
  static std::optional<int> find(std::string_view name) {
    int layer = -1;
    std::string_view rest = name;
    if (rest.substr(0, 2) == "h.") {
      rest.remove_prefix(2);
      std::size_t dot = rest.find('.');
      if (dot == 0 || dot == std::string_view::npos || dot > 9) return std::nullopt;
      layer = 0;
      for (std::size_t j = 0; j < dot; ++j) {
        if (rest[j] < '0' || rest[j] > '9') return std::nullopt;
        layer = layer * 10 + (rest[j] - '0');
      }
      if (dot > 1 && rest[0] == '0') return std::nullopt;  // "h.03" is not a name we write
      if (layer >= L) return std::nullopt;
      rest.remove_prefix(dot + 1);
    }
    for (int k = 0; k <= static_cast<int>(ParamKind::lm_head); ++k) {
      auto kind = static_cast<ParamKind>(k);
      if (hf_suffix(kind) != rest || is_layer_kind(kind) != (layer >= 0)) continue;
      if (kind == ParamKind::lm_head && tied) return std::nullopt;
      return index(kind, layer);
    }
    return std::nullopt;
  }
};

}  // namespace fived
