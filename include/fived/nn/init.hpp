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
// Element indices are row-major in the tensor's buffer shape ([Vp, C] for wte), so the
// index of (r, c) is r * cols + c. The tensor's stream is ParamInfo::stream_id(): it does not
// depend on the number of layers or on tying. Values are computed in double (log, cos, sqrt)
// and rounded once to the element type.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <span>
#include <stdexcept>
#include <string>

#include "fived/nn/layout.hpp"

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
};

// The initial value of element `index` (row-major, buffer shape) of tensor t in a model of
// `layers` layers.
inline double init_value(const ParamInfo& t, int layers, const GptInit& how, std::size_t index) {
  if (index >= t.size())
    throw std::out_of_range("init_value: element " + std::to_string(index) + " of " + t.name() + ", which has " +
                            std::to_string(t.size()));
  switch (t.kind) {
    case ParamKind::ln_1_weight:
    case ParamKind::ln_2_weight:
    case ParamKind::ln_f_weight: return 1.0;
    case ParamKind::ln_1_bias:
    case ParamKind::ln_2_bias:
    case ParamKind::ln_f_bias:
    case ParamKind::attn_c_attn_bias:
    case ParamKind::attn_c_proj_bias:
    case ParamKind::mlp_c_fc_bias:
    case ParamKind::mlp_c_proj_bias: return 0.0;
    case ParamKind::wte:
    case ParamKind::lm_head:
      if (static_cast<std::int64_t>(index) / t.cols >= t.file_rows) return 0.0;  // padded vocabulary row
      break;
    default: break;
  }
  double std = how.std;
  if (t.kind == ParamKind::attn_c_proj_weight || t.kind == ParamKind::mlp_c_proj_weight)
    std /= std::sqrt(2.0 * layers);
  return std * standard_normal(how.seed, t.stream_id(), index);
}

// out[i] = element (first + i) of tensor t: a contiguous range (whole tensor, or rows).
template <class T>
void init_range(const ParamInfo& t, int layers, const GptInit& how, std::size_t first, std::span<T> out) {
  if (first + out.size() > t.size())
    throw std::out_of_range("init_range: elements [" + std::to_string(first) + ", " +
                            std::to_string(first + out.size()) + ") of " + t.name() + ", which has " +
                            std::to_string(t.size()));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(init_value(t, layers, how, first + i));
}

// A 2-D block of a matrix tensor: rows [row0, row0 + rows), columns [col0, col0 + cols),
// written row-major with leading dimension ld (>= cols) — e.g. a tensor-parallel column shard.
template <class T>
void init_block(const ParamInfo& t, int layers, const GptInit& how, std::int64_t row0, std::int64_t rows,
                std::int64_t col0, std::int64_t cols, T* out, std::int64_t ld) {
  if (row0 < 0 || col0 < 0 || rows < 0 || cols < 0 || row0 + rows > t.rows || col0 + cols > t.cols || ld < cols)
    throw std::out_of_range("init_block: block [" + std::to_string(row0) + ":" + std::to_string(row0 + rows) + ", " +
                            std::to_string(col0) + ":" + std::to_string(col0 + cols) + "] does not fit " + t.name() +
                            " [" + std::to_string(t.rows) + ", " + std::to_string(t.cols) + "] (or ld < cols)");
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      out[r * ld + c] = static_cast<T>(
          init_value(t, layers, how, static_cast<std::size_t>((row0 + r) * t.cols + col0 + c)));
}

// The whole flat parameter buffer of a GPT with configuration Cfg.
template <class Cfg, class T>
void init_gpt(std::span<T> params, const GptInit& how = {}) {
  using L = GptLayout<Cfg>;
  if (params.size() != L::size)
    throw std::invalid_argument("init_gpt: the buffer has " + std::to_string(params.size()) +
                                " elements, the layout needs " + std::to_string(L::size));
  for (const ParamInfo& t : L::tensors) init_range(t, L::L, how, 0, params.subspan(t.offset, t.size()));
}

}  // namespace fived
