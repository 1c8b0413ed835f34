#pragma once
// How a model is run, as the planner reads it: a struct of static members like gpt_config,
// derived from plan::layout and hiding what it changes.
//
//   struct llama_run : fived::plan::layout {
//     using mesh = fived::Mesh<fived::DP<128>, fived::TP<8>, fived::PP<16>>;
//     using schedule = fived::pipeline::OneFOneB<16, 16>;   // P = PP ranks, M micro-batches
//     using recompute = fived::FullRecompute;               // nn/recompute.hpp
//     static constexpr bool sequence_parallel = true;
//     static constexpr int zero = 1, element_bytes = 2;     // ZeRO-1, bf16 (+ fp32 masters)
//     static constexpr int micro_batch = 1, sequence = 8192;
//   };
//
// micro_batch is the sequences of one micro-batch on one data-parallel rank (fived's B/DP),
// sequence their length; each CP rank holds sequence/CP tokens of each. The schedule is one
// of pipeline/schedules.hpp's types (its P must be the mesh's PP; plan::accumulate<M> is M
// micro-batches without a pipeline). A layout may give its own cut of the blocks into the
// schedule's P·V parts as `static constexpr std::array<int, P·V + 1> bounds` (e.g.
// StageLayers<cfg, P·V>::bounds, to plan exactly what a Trainer's pipeline builds); otherwise
// Setup::split cuts them as evenly as possible, the first and last parts taking one block
// fewer where they do not divide (they also hold the embedding and the head), as Llama 3
// does with 126 layers on 16 stages: 7, 8, ..., 8, 7.
//
// Setup<Model, Layout> reads a layout once, checks it against the model with a sentence per
// rule (static_assert), and derives the sizes everything else uses.

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "fived/mesh/mesh.hpp"
#include "fived/nn/recompute.hpp"
#include "fived/pipeline/schedules.hpp"
#include "fived/plan/model.hpp"

namespace fived::plan {

// M micro-batches accumulated on a mesh without pipeline parallelism (the same type as the
// trainer's Accumulate<M>, train/trainer.hpp).
template <int M>
using accumulate = pipeline::OneFOneB<1, M>;

struct layout {
  using mesh = Mesh<>;
  using schedule = accumulate<1>;
  using recompute = NoRecompute;
  static constexpr bool sequence_parallel = false;
  static constexpr int zero = 0;           // ZeRO stage: 0 (none), 1, 2, 3 (train/data_parallel.hpp)
  static constexpr int element_bytes = 4;  // 2: bf16 (AdamW adds fp32 masters), 4: fp32, 8: fp64
  static constexpr int micro_batch = 1;
  static constexpr int sequence = 1024;
  static constexpr std::size_t bucket_bytes = std::size_t{4} << 20;  // DataParallel's default
};

// What recomputation keeps (nn/recompute.hpp), as a value.
enum class Recompute : std::uint8_t { none, selective, full };
template <RecomputePolicy R>
inline constexpr Recompute recompute_of =
    R::whole_block ? Recompute::full : R::attention_core ? Recompute::selective : Recompute::none;

// One micro-batch on one rank: what the activation and traffic formulas take.
struct Rows {
  std::int64_t N = 0;  // tokens of the micro-batch on this rank: micro_batch · sequence / CP
  std::int64_t n = 0;  // rows of the residual stream: N / TP with sequence parallelism, else N
  int tp = 1, cp = 1, ep = 1;
  bool sp = false;
  int t = 4;   // bytes of an element
  int st = 4;  // bytes of a statistic (mean, rstd, log-sum-exp, loss terms): float, double for fp64
  Recompute recompute = Recompute::none;
};

namespace detail {
template <class L, std::size_t Parts>
constexpr bool has_bounds() {
  if constexpr (requires { L::bounds; }) return std::tuple_size_v<std::remove_cvref_t<decltype(L::bounds)>> == Parts + 1;
  else return true;
}
}  // namespace detail

template <Transformer Model, class L>
struct Setup {
  using mesh = typename L::mesh;
  using schedule = typename L::schedule;
  using recompute_policy = typename L::recompute;
  static_assert(MeshType<mesh>, "plan layout: `mesh` must be a fived::Mesh<...>");
  static_assert(RecomputePolicy<recompute_policy>,
                "plan layout: `recompute` must be fived::NoRecompute, SelectiveRecompute or FullRecompute");

  static constexpr int tp = mesh::tp, cp = mesh::cp, dp = mesh::dp, pp = mesh::pp, ep = mesh::ep;
  static constexpr int grad = dp * cp;   // dense gradients reduce over DP x CP
  static constexpr int edp = grad / ep;  // experts' gradients over the expert-data group
  static constexpr bool sp = L::sequence_parallel && tp > 1;
  static constexpr int zero = L::zero, t = L::element_bytes, st = t == 8 ? 8 : 4;
  static constexpr int b = L::micro_batch, s = L::sequence;
  static constexpr std::size_t bucket_bytes = L::bucket_bytes;
  static constexpr int P = schedule::ranks, M = schedule::micro_batches, V = schedule::chunks;
  static constexpr pipeline::Shape shape = schedule::shape;
  static constexpr int parts = P * V;
  static constexpr Recompute recompute = recompute_of<recompute_policy>;

  static_assert(P == pp,
                "plan layout: the schedule has a different number of pipeline ranks than the mesh's PP extent; give "
                "the schedule P = PP (plan::accumulate<M> when PP is 1)");
  static_assert(zero >= 0 && zero <= 3, "plan layout: zero is the ZeRO stage, 0 (none), 1, 2 or 3");
  static_assert(zero == 0 || grad > 1,
                "plan layout: ZeRO shards the training state over the data-parallel group, which has one rank on "
                "this mesh; use zero = 0 (or a mesh with DP or CP > 1)");
  static_assert(t == 2 || t == 4 || t == 8, "plan layout: element_bytes is 2 (bf16), 4 (fp32) or 8 (fp64)");
  static_assert(b >= 1 && s >= 1, "plan layout: micro_batch and sequence must be at least 1");
  static_assert(Model.layers >= 1 && Model.d_model >= 1 && Model.heads >= 1 && Model.d_model % Model.heads == 0,
                "plan model: layers, d_model and heads must be at least 1, and heads must divide d_model");
  static_assert(Model.kv_heads >= 1 && Model.heads % Model.kv_heads == 0,
                "plan model: kv_heads must divide heads (grouped-query attention shares each key/value head among "
                "heads / kv_heads query heads)");
  static_assert(Model.heads % tp == 0 && (Model.kv_heads % tp == 0 || tp % Model.kv_heads == 0),
                "plan: tensor parallelism splits the attention heads over TP: heads must be a multiple of the TP "
                "extent, and kv_heads a multiple or a divisor of it");
  static_assert(Model.d_ff % tp == 0 && (Model.experts == 0 || Model.expert_d_ff % tp == 0),
                "plan: tensor parallelism splits the FFN's hidden width over TP: d_ff (and expert_d_ff) must be "
                "multiples of the TP extent");
  static_assert(Model.padded_vocab >= Model.vocab && Model.padded_vocab % tp == 0,
                "plan: the vocabulary is split over TP: padded_vocab must be at least vocab and a multiple of the TP "
                "extent");
  static_assert(Model.experts == 0 || (Model.experts % ep == 0 && Model.top_k >= 1 && Model.top_k <= Model.experts &&
                                       Model.moe_every >= 1 && Model.expert_d_ff >= 1),
                "plan: a mixture of experts needs experts a multiple of the EP extent, 1 <= top_k <= experts, "
                "moe_every >= 1 and expert_d_ff >= 1");
  static_assert(cp == 1 || s % (2 * cp) == 0,
                "plan: context parallelism cuts every sequence into 2*CP chunks (zig-zag): the sequence length must "
                "be a multiple of 2*CP");
  static_assert(!sp || (std::int64_t{b} * s / cp) % tp == 0,
                "plan: sequence parallelism splits a micro-batch's micro_batch*sequence/CP tokens over TP: make them "
                "a multiple of TP");
  static_assert(Model.positions == 0 || s <= Model.positions,
                "plan: the sequence is longer than the model's learned position embedding (positions rows)");
  static_assert(Model.layers >= parts,
                "plan: the model has fewer transformer blocks than pipeline parts (stages x chunks); every part "
                "needs at least one block");
  static_assert(detail::has_bounds<L, static_cast<std::size_t>(parts)>(),
                "plan layout: `bounds` must have one entry per pipeline part (stages x chunks) plus one");

  static constexpr Rows rows{std::int64_t{b} * s / cp, sp ? std::int64_t{b} * s / cp / tp : std::int64_t{b} * s / cp,
                             tp, cp, ep, sp, t, st, recompute};

  // bounds[p] = first block of part p, bounds[parts] = layers.
  static constexpr std::array<int, parts + 1> split() {
    std::array<int, parts + 1> bounds{};
    if constexpr (requires { L::bounds; }) {
      for (int p = 0; p <= parts; ++p) bounds[static_cast<std::size_t>(p)] = L::bounds[static_cast<std::size_t>(p)];
    } else {
      std::array<int, parts> count{};
      const int q = (Model.layers + parts - 1) / parts;
      count.fill(q);
      for (int k = 0, fewer = q * parts - Model.layers; k < fewer; ++k)  // 0, parts-1, 1, parts-2, ...
        --count[static_cast<std::size_t>(k % 2 == 0 ? k / 2 : parts - 1 - k / 2)];
      for (int p = 0; p < parts; ++p)
        bounds[static_cast<std::size_t>(p + 1)] = bounds[static_cast<std::size_t>(p)] + count[static_cast<std::size_t>(p)];
    }
    return bounds;
  }
  static constexpr std::array<int, parts + 1> bounds = split();
  static constexpr bool cut_ok = [] {
    if (bounds[0] != 0 || bounds[parts] != Model.layers) return false;
    for (int p = 0; p < parts; ++p)
      if (bounds[static_cast<std::size_t>(p + 1)] <= bounds[static_cast<std::size_t>(p)]) return false;
    return true;
  }();
  static_assert(cut_ok, "plan layout: `bounds` must start at 0, end at the model's layers and give every part a block");

  static constexpr Blocks part(int p) {
    return {bounds[static_cast<std::size_t>(p)],
            bounds[static_cast<std::size_t>(p + 1)] - bounds[static_cast<std::size_t>(p)], p == 0, p == parts - 1};
  }
  static constexpr bool has_experts(int p) {
    for (int l = part(p).first; l < part(p).first + part(p).count; ++l)
      if (Model.is_moe(l)) return true;
    return false;
  }
};

}  // namespace fived::plan
