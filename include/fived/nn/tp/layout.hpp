#pragma once
// The parameter layout of ONE tensor-parallel rank of a GPT, computed at compile
// time from the serial layout (nn/layout.hpp) and the TP extent.
//
// Each tensor keeps its place in the order of GptLayout; its local piece is
// what the TP layers hold (Megatron's split):
//
//   wte, lm_head [Vp, C]           rows        vocabulary split (Vp % TP == 0)
//   attn.c_attn.weight [C, 3C]     fused cols  q, k and v each split by heads:
//   attn.c_attn.bias [3C]          fused rows  [q_r | k_r | v_r], 3C/TP wide
//   mlp.c_fc.weight [C, F]         cols        F/TP hidden units
//   mlp.c_fc.bias [F]              rows
//   attn/mlp.c_proj.weight [in, C] rows        input features split
//   wpe, LayerNorms, c_proj biases replicate   the whole tensor on every rank
//
// TpSplit{dim, groups}: dimension `dim` (-1: none) is `groups` equal blocks
// side by side, each cut into TP pieces; rank r holds piece r of every block,
// in block order. groups = 3 is the fused [q|k|v] projection: the slice of
// each block a rank holds covers the same heads, so its local output is the
// [q|k|v] of its heads, the layout the attention kernel reads.
//
// The local buffer has the same interface as GptLayout (tensors with local
// shapes and offsets, size, index, offset), so AdamW<TpGptLayout<...>> steps a
// rank's shard, and the serial flat buffer maps to and from it element by
// element (global_index).

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "fived/nn/config.hpp"
#include "fived/nn/layout.hpp"

namespace fived::nn::tp {

struct TpSplit {
  int dim = -1;    // 0: rows, 1: columns, -1: replicated
  int groups = 1;  // equal blocks along dim, each split over TP (3 for fused q|k|v)
  constexpr bool replicated() const { return dim < 0; }
};

constexpr TpSplit tp_split(ParamKind k) {
  switch (k) {
    case ParamKind::wte:
    case ParamKind::lm_head:
    case ParamKind::mlp_c_fc_bias:
    case ParamKind::attn_c_proj_weight:
    case ParamKind::mlp_c_proj_weight: return {0, 1};
    case ParamKind::mlp_c_fc_weight: return {1, 1};
    case ParamKind::attn_c_attn_weight: return {1, 3};
    case ParamKind::attn_c_attn_bias: return {0, 3};
    default: return {};
  }
}

// Index along a split dimension of global size n: local index j of rank r.
constexpr std::int64_t split_global_index(std::int64_t n, int groups, int tp, int r, std::int64_t j) {
  const std::int64_t piece = n / groups / tp;
  return (j / piece) * (n / groups) + static_cast<std::int64_t>(r) * piece + j % piece;
}

template <class Cfg, int TP>
struct TpGptLayout {
  using dims = gpt_dims<Cfg>;
  using global = GptLayout<Cfg>;
  static constexpr int tp = TP;
  static constexpr int L = global::L;
  static constexpr std::int64_t C = global::C, V = global::V, Vp = global::Vp, F = global::F;
  static constexpr bool tied = global::tied;
  static constexpr int count = global::count;
  static constexpr ParamKind head_kind = global::head_kind;

  static_assert(TP >= 1, "TpGptLayout: the TP extent must be at least 1");
  static_assert(dims::heads % TP == 0,
                "tensor parallelism splits the attention heads over TP: the number of heads must be a multiple of "
                "the TP extent (change heads in the config, or use a TP that divides it)");
  static_assert(dims::d_ff % TP == 0,
                "tensor parallelism splits the MLP hidden width (mlp_ratio * d_model) over TP: make it a multiple of "
                "the TP extent");
  static_assert(dims::padded_vocab % TP == 0,
                "the vocabulary is split over TP: the padded vocabulary must be a multiple of the TP extent (make "
                "vocab_multiple in the config a multiple of TP)");

 private:
  static constexpr std::array<ParamInfo, count> build() {
    std::array<ParamInfo, count> t = global::tensors;
    std::size_t off = 0;
    for (ParamInfo& p : t) {
      const TpSplit s = tp_split(p.kind);
      if (s.dim == 0) p.rows /= TP;
      if (s.dim == 1) p.cols /= TP;
      if (!s.replicated()) p.file_rows = p.rows;  // a piece has no padded rows of its own to drop
      p.offset = off;
      off += p.size();
    }
    return t;
  }

 public:
  static constexpr std::array<ParamInfo, count> tensors = build();
  static constexpr std::size_t size = tensors[count - 1].end();

  // The replicated tensors (wpe, LayerNorms, c_proj biases) packed back to back,
  // in layout order: under sequence parallelism their gradients are partial
  // sums over TP, reduced together once per backward.
  static constexpr std::array<std::size_t, count> packed_offset = [] {
    std::array<std::size_t, count> o{};
    std::size_t off = 0;
    for (int i = 0; i < count; ++i)
      if (tp_split(tensors[static_cast<std::size_t>(i)].kind).replicated())
        o[static_cast<std::size_t>(i)] = off, off += tensors[static_cast<std::size_t>(i)].size();
    return o;
  }();
  static constexpr std::size_t replicated_size = [] {
    std::size_t n = 0;
    for (const ParamInfo& t : tensors)
      if (tp_split(t.kind).replicated()) n += t.size();
    return n;
  }();

  static constexpr int index(ParamKind k, int layer = -1) { return global::index(k, layer); }
  static constexpr const ParamInfo& info(ParamKind k, int layer = -1) { return tensors[index(k, layer)]; }
  static constexpr std::size_t offset(ParamKind k, int layer = -1) { return info(k, layer).offset; }
  static constexpr TpSplit split(int i) { return tp_split(tensors[static_cast<std::size_t>(i)].kind); }

  // Element `local` of tensor i on TP rank r, as an element index of the serial tensor.
  static constexpr std::int64_t global_index(int i, int r, std::int64_t local) {
    const ParamInfo& lt = tensors[static_cast<std::size_t>(i)];
    const ParamInfo& gt = global::tensors[static_cast<std::size_t>(i)];
    const TpSplit s = split(i);
    std::int64_t row = local / lt.cols, col = local % lt.cols;
    if (s.dim == 0) row = split_global_index(gt.rows, s.groups, TP, r, row);
    if (s.dim == 1) col = split_global_index(gt.cols, s.groups, TP, r, col);
    return row * gt.cols + col;
  }

  // Rank r's local buffer from the serial flat buffer (both whole).
  template <class T>
  static void slice(std::span<const T> serial, std::span<T> local, int r) {
    check_sizes(serial.size(), local.size(), "slice");
    for (int i = 0; i < count; ++i) {
      const ParamInfo& lt = tensors[static_cast<std::size_t>(i)];
      const std::size_t g0 = global::tensors[static_cast<std::size_t>(i)].offset;
      for (std::size_t j = 0; j < lt.size(); ++j)
        local[lt.offset + j] = serial[g0 + static_cast<std::size_t>(global_index(i, r, static_cast<std::int64_t>(j)))];
    }
  }

  // The serial flat buffer from every rank's local buffer (all_locals: TP
  // buffers of `size` elements back to back, rank order; replicated tensors are
  // taken from rank 0).
  template <class T>
  static void assemble(std::span<const T> all_locals, std::span<T> serial) {
    if (all_locals.size() % TP != 0)
      throw std::invalid_argument("TpGptLayout::assemble: " + std::to_string(all_locals.size()) +
                                  " elements do not split into TP = " + std::to_string(TP) + " local buffers");
    check_sizes(serial.size(), all_locals.size() / TP, "assemble");
    for (int r = TP; r-- > 0;) {
      const std::span<const T> local = all_locals.subspan(static_cast<std::size_t>(r) * size, size);
      for (int i = 0; i < count; ++i) {
        const ParamInfo& lt = tensors[static_cast<std::size_t>(i)];
        const std::size_t g0 = global::tensors[static_cast<std::size_t>(i)].offset;
        for (std::size_t j = 0; j < lt.size(); ++j)
          serial[g0 + static_cast<std::size_t>(global_index(i, r, static_cast<std::int64_t>(j)))] = local[lt.offset + j];
      }
    }
  }

 private:
  static void check_sizes(std::size_t serial, std::size_t local, const char* fn) {
    if (serial != global::size || local != size)
      throw std::invalid_argument(std::string("TpGptLayout::") + fn + ": buffers of " + std::to_string(serial) +
                                  " (serial) and " + std::to_string(local) + " (local) elements, expected " +
                                  std::to_string(global::size) + " and " + std::to_string(size));
  }
};

}  // namespace fived::nn::tp
