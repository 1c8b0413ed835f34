#pragma once
// Deterministic GPT-2 initialisation, element by element.
//
// Every element's value is a pure function of (seed, tensor, element index): a counter-based
// generator (splitmix64 hashes of the three, then Box-Muller) instead of a sequential RNG.
// So any piece of a tensor — a row range for data or pipeline parallelism, a column block for
// tensor parallelism — is initialised alone by asking for its indices, and equals the same
// piece of the whole tensor: sharded runs start from exactly the serial run's weights.
//
// The GPT-2 scheme (as nanoGPT / llm.c):
//   weights and embeddings (wte, wpe, c_attn, c_fc, lm_head)   normal(0, 0.02)
//   attn.c_proj.weight, mlp.c_proj.weight                       normal(0, 0.02 / sqrt(2 * layers))
//   biases                                                      0
//   LayerNorm weight / bias                                     1 / 0
//   padded vocabulary rows of wte / lm_head                     0
//
// Element indices are row-major in the whole tensor's buffer shape ([Vp, C] for wte), so
// the index of (r, c) is r * cols + c. The tensor's stream is its spec's (nn/param_table.hpp):
// it does not depend on the number of layers or on tying. Values are computed in double (log, cos, sqrt)
// and rounded once to the element type.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <span>
#include <stdexcept>
#include <string>

#include "fived/nn/param_table.hpp"

namespace fived {

namespace init_detail {

constexpr std::uint64_t mix(std::uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace init_detail

// Two independent 64-bit hashes of (seed, stream, index).
constexpr std::uint64_t counter_hash(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
  using init_detail::mix;
  const std::uint64_t key = mix(mix(seed + 0x9e3779b97f4a7c15ull) ^ (stream * 0xd1b54a32d192ed03ull));
  return mix(key ^ mix(counter + 0x632be59bd9b4e019ull));
}

// A standard normal value for (seed, stream, index): Box-Muller on two 53-bit uniforms.
inline double standard_normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const std::uint64_t h1 = counter_hash(seed, stream, 2 * index);
  const std::uint64_t h2 = counter_hash(seed, stream, 2 * index + 1);
  const double u1 = (static_cast<double>(h1 >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(h2 >> 11) * 0x1.0p-53;          // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

struct GptInit {
  std::uint64_t seed = 1337;
  double std = 0.02;  // of weights and embeddings; c_proj weights get std / sqrt(2 * layers)
  // The parameters are not written when the model is made: its trainer writes the elements
  // this rank keeps (DataParallel: under ZeRO-3 only its owned pieces, computed for those
  // elements alone), with the same values. A forward before that is an error.
  bool deferred = false;
};

// The initial value of element `index` (row-major, whole-tensor shape) of a tensor in a
// model of `layers` layers. Rows past the spec's file_rows (the padded vocabulary) are zero.
inline double init_value(const TensorSpec& t, int layers, const GptInit& how, std::size_t index) {
  if (index >= t.size())
    throw std::out_of_range("init_value: element " + std::to_string(index) + " of " + t.full_name() + ", which has " +
                            std::to_string(t.size()));
  if (static_cast<std::int64_t>(index) / t.cols >= t.file_rows) return 0.0;
  switch (t.init) {
    case Init::zeros: return 0.0;
    case Init::ones: return 1.0;
    case Init::normal: return how.std * standard_normal(how.seed, t.stream, index);
    case Init::normal_residual:
      return how.std / std::sqrt(2.0 * layers) * standard_normal(how.seed, t.stream, index);
  }
  return 0.0;
}

// Elements [r.begin, r.end) of the flat buffer of TP rank tp_rank (and EP rank ep_rank) of a
// ParamTable, into out (r.size() elements; padding between tensors zero): every element
// equals the same element of the serial model's tensors, computed for the range alone.
template <class Table, class T>
void init_range(FlatRange r, std::span<T> out, int tp_rank, const GptInit& how = {}, int ep_rank = 0) {
  if (r.end > Table::size || out.size() != r.size())
    throw std::invalid_argument("init_range: [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                ") into " + std::to_string(out.size()) + " elements, in a layout of " +
                                std::to_string(Table::size));
  std::fill(out.begin(), out.end(), T{});
  for (int i = 0; i < Table::count; ++i) {
    const ParamInfo& t = Table::tensors[static_cast<std::size_t>(i)];
    const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
    for (std::size_t k = b; k < e; ++k)
      out[k - r.begin] = static_cast<T>(init_value(
          t.spec, Table::layers, how,
          static_cast<std::size_t>(Table::global_index(i, tp_rank, static_cast<std::int64_t>(k - t.offset), ep_rank))));
  }
}

// The whole flat buffer the same way.
template <class Table, class T>
void init_params(std::span<T> params, int tp_rank, const GptInit& how = {}, int ep_rank = 0) {
  if (params.size() != Table::size)
    throw std::invalid_argument("init_params: the buffer has " + std::to_string(params.size()) +
                                " elements, the layout needs " + std::to_string(Table::size));
  init_range<Table>(FlatRange{0, Table::size}, params, tp_rank, how, ep_rank);
}

}  // namespace fived
