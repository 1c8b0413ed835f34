#pragma once
// A decoder's parameter tables, from its architecture alone (nn/decoder.hpp builds on them;
// the planner, checkpoints and the pipeline read them without a model object): the dense
// table of a part of the layers (the embedding, its blocks, the final norm and the head) and
// the experts' table. What each tensor is and where it lies: nn/param_table.hpp.

#include <array>
#include <cstddef>
#include <cstdint>

#include "fived/model/layers.hpp"
#include "fived/nn/config.hpp"
#include "fived/nn/head.hpp"
#include "fived/nn/param_table.hpp"

namespace fived {

// The part a model object holds (model/layers.hpp): Layers<First, Count> is blocks [First,
// First + Count), with the embedding when First == 0 and the final norm, the head and the
// loss when the part ends at the last block; AllLayers is the whole model.
template <class Cfg, class Part>
struct part_layers {
  using type = Part;
};
template <class Cfg>
struct part_layers<Cfg, AllLayers> {
  using type = Layers<0, Cfg::layers>;
};

// The parameter table of a decoder (or of a part of one): the embedding (unit 0), each block
// (a unit each), the final norm and an untied head (the last unit); a part's units count
// from 0 over what it holds. Block l's random streams start at (l + 1) * 64, so a part starts
// with exactly the values its tensors have in the whole model.
template <class Arch, class Part = AllLayers>
struct DecoderSpecs {
  using config = typename Arch::config;
  using block = typename Arch::block;
  using dims = gpt_dims<config>;
  using part = typename part_layers<config, Part>::type;
  static constexpr int layers = dims::layers;  // the whole model's (residual init)
  static constexpr int first = part::first, blocks = part::count;
  static constexpr bool has_embedding = first == 0, has_head = first + blocks == layers;
  static_assert(first >= 0 && blocks >= 0 && first + blocks <= layers,
                "Layers<First, Count>: the part must lie inside the configuration's layers");
  static_assert(has_embedding || has_head || blocks > 0, "Layers<First, Count>: a part must hold something");
  static constexpr std::uint64_t stream_of(int layer) { return static_cast<std::uint64_t>(layer + 1) * 64; }
  static constexpr int block_specs(int l) { return static_cast<int>(block::specs(l, 0, 0).size); }
  // The architecture's ends: the embedding's tensors (the token embedding first) and the
  // final norm's.
  static constexpr auto embedding = Arch::embedding_specs(dims::vocab, dims::padded_vocab, dims::d_model, dims::max_seq);
  static constexpr int embedding_count = static_cast<int>(embedding.size());
  static constexpr int norm_count = static_cast<int>(Arch::final_norm_specs(0, dims::d_model).size());
  static_assert(embedding_count == 1 || embedding_count == 2,
                "an architecture's embedding_specs: the token embedding [Vp, C], and optionally learned positions");
  static constexpr int block_first(int local) {  // index of the part's block `local`'s first spec
    int i = has_embedding ? embedding_count : 0;
    for (int k = 0; k < local; ++k) i += block_specs(first + k);
    return i;
  }
  // A tied head on a part without the embedding keeps a copy of wte (Megatron's
  // word_embeddings_for_head): the same spec, so the same values; its gradient is summed with
  // the embedding stage's each step (tied_copy, pipeline/executor.hpp).
  static constexpr bool tied_copy = dims::tied && has_head && !has_embedding;
  static constexpr int count = block_first(blocks) + (has_head ? norm_count + (dims::tied && !tied_copy ? 0 : 1) : 0);
  static constexpr int block_unit(int local) { return (has_embedding ? 1 : 0) + local; }
  static constexpr int final_unit = block_unit(blocks);  // the final norm and the head
  static constexpr int units = has_head ? final_unit + 1 : block_unit(blocks);
  static constexpr std::array<TensorSpec, count> specs = [] {
    constexpr int C = dims::d_model, V = dims::vocab, Vp = dims::padded_vocab;
    std::array<TensorSpec, count> t{};
    std::size_t i = 0;
    auto put = [&](const auto& part) {
      for (const TensorSpec& s : part) t[i++] = s;
    };
    if constexpr (has_embedding) put(embedding);
    if constexpr (has_embedding && !has_head) t[0].tied = dims::tied;  // the last stage holds a copy
    for (int k = 0; k < blocks; ++k) put(block::specs(first + k, block_unit(k), stream_of(first + k)));
    if constexpr (has_head) {
      put(Arch::final_norm_specs(final_unit, C));
      if constexpr (!dims::tied) put(head_specs(V, Vp, C, final_unit));
      if constexpr (tied_copy) {
        TensorSpec wte = embedding[0];
        wte.unit = final_unit, wte.tied = wte.tied_copy = true;
        t[i++] = wte;
      }
    }
    return t;
  }();
};

// The experts of a part, in their own table (a second flat buffer: they reduce over the
// expert-data group, not DP x CP), in the model's units.
template <class Arch, class Part = AllLayers>
struct DecoderExpertSpecs {
  using dense = DecoderSpecs<Arch, Part>;
  using dims = typename dense::dims;
  static constexpr int layers = dims::layers, units = dense::units;
  static constexpr int block_specs(int l) {
    if constexpr (dims::experts > 0) return dims::is_moe(l) ? static_cast<int>(Arch::block::expert_specs(l, 0, 0).size()) : 0;
    else return 0;
  }
  static constexpr int block_first(int local) {  // the part's block `local`'s first expert spec
    int i = 0;
    for (int k = 0; k < local; ++k) i += block_specs(dense::first + k);
    return i;
  }
  static constexpr int moe_blocks = [] {
    int n = 0;
    for (int k = 0; k < dense::blocks; ++k) n += dims::is_moe(dense::first + k) ? 1 : 0;
    return n;
  }();
  static constexpr std::array<TensorSpec, block_first(dense::blocks)> specs = [] {
    std::array<TensorSpec, block_first(dense::blocks)> t{};
    if constexpr (dims::experts > 0) {
      std::size_t i = 0;
      for (int k = 0; k < dense::blocks; ++k) {
        const int l = dense::first + k;
        if (!dims::is_moe(l)) continue;
        for (const TensorSpec& x : Arch::block::expert_specs(l, dense::block_unit(k), dense::stream_of(l))) t[i++] = x;
      }
    }
    return t;
  }();
};

}  // namespace fived
