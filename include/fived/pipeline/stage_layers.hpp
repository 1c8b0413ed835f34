#pragma once
// Which layers each pipeline stage holds: the blocks of a model (model/contract.hpp: its
// `layers`) cut into S contiguous parts (S = P stages, or P·V model chunks for interleaved
// and V-shaped schedules), the embedding on the first part and the final norm + head (and
// the loss) on the last, balanced by a cost.
//
//   using model = GPT<cfg, Mesh<PP<4>>>;
//   using cut = StageLayers<model, 4>;                // 4 parts, balanced by FlopCost
//   static_assert(cut::first(1) == 3 && cut::count(1) == 3);
//   model::part<cut::part<1>> stage1(ctx, init);
//
// Balance: contiguous parts minimising the most expensive one (exact, by dynamic
// programming over the blocks at compile time); ties go to the split that puts blocks
// earlier. The cost is a type the user may replace: `block()` per transformer block,
// `embedding()` and `head()` added to the first and last parts. FlopCost takes the model's
// own matmul FLOPs per token (block_flops(), embedding_flops(), head_flops(): for GPT-2 a
// block is 24·C², the head 2·C·Vp), so a large vocabulary moves blocks off the last stage,
// as Megatron's uneven first/last stages do by hand. UniformCost gives every block 1 and the
// ends 0.
//
// Even<true> (schedules that need it, e.g. interleaved 1F1B: every chunk the same number
// of blocks) splits the blocks equally and ignores the cost; the layers must divide.

#include <array>
#include <cstdint>

#include "fived/model/layers.hpp"

namespace fived {

// Matmul FLOPs per token, forward (the backward is twice that everywhere, so it cancels).
template <class Model>
struct FlopCost {
  static constexpr double block() { return Model::block_flops(); }
  static constexpr double embedding() { return Model::embedding_flops(); }
  static constexpr double head() { return Model::head_flops(); }
};

template <class Model>
struct UniformCost {
  static constexpr double block() { return 1.0; }
  static constexpr double embedding() { return 0.0; }
  static constexpr double head() { return 0.0; }
};

template <class Model, int Parts, template <class> class Cost = FlopCost, bool Even = false>
struct StageLayers {
  static constexpr int layers = Model::layers;
  static_assert(Parts >= 1, "StageLayers: a pipeline needs at least one part");
  static_assert(layers >= Parts,
                "StageLayers: the model has fewer transformer blocks than pipeline parts (stages x chunks); every "
                "part needs at least one block: use fewer stages or chunks, or a deeper model");
  static_assert(!Even || layers % Parts == 0,
                "StageLayers: this schedule needs every part to hold the same number of blocks, and the blocks do "
                "not divide evenly over the parts (stages x chunks); change the layers, the stages or the chunks");

 private:
  using cost = Cost<Model>;
  // The cost of part p holding blocks [b, e).
  static constexpr double part_cost(int p, int b, int e) {
    return (e - b) * cost::block() + (p == 0 ? cost::embedding() : 0.0) + (p == Parts - 1 ? cost::head() : 0.0);
  }
  // bounds[p] = first block of part p; bounds[Parts] = layers.
  static constexpr std::array<int, Parts + 1> cut() {
    std::array<int, Parts + 1> bounds{};
    if constexpr (Even) {
      for (int p = 0; p <= Parts; ++p) bounds[static_cast<std::size_t>(p)] = p * (layers / Parts);
      return bounds;
    } else {
      // best[p][e]: the least possible maximum part cost when parts 0..p hold blocks [0, e),
      // each at least one block; from[p][e]: where part p starts in that split.
      constexpr double inf = 1e300;
      std::array<std::array<double, layers + 1>, Parts> best{};
      std::array<std::array<int, layers + 1>, Parts> from{};
      for (auto& row : best) row.fill(inf);
      for (int e = 1; e <= layers; ++e) best[0][static_cast<std::size_t>(e)] = part_cost(0, 0, e);
      for (int p = 1; p < Parts; ++p)
        for (int e = p + 1; e <= layers; ++e)
          for (int b = p; b < e; ++b) {
            const double prev = best[static_cast<std::size_t>(p - 1)][static_cast<std::size_t>(b)];
            const double c = prev > part_cost(p, b, e) ? prev : part_cost(p, b, e);
            if (c < best[static_cast<std::size_t>(p)][static_cast<std::size_t>(e)])
              best[static_cast<std::size_t>(p)][static_cast<std::size_t>(e)] = c,
                                               from[static_cast<std::size_t>(p)][static_cast<std::size_t>(e)] = b;
          }
      bounds[Parts] = layers;
      for (int p = Parts - 1; p > 0; --p)
        bounds[static_cast<std::size_t>(p)] =
            from[static_cast<std::size_t>(p)][static_cast<std::size_t>(bounds[static_cast<std::size_t>(p + 1)])];
      bounds[0] = 0;
      return bounds;
    }
  }

 public:
  static constexpr std::array<int, Parts + 1> bounds = cut();
  static constexpr int first(int p) { return bounds[static_cast<std::size_t>(p)]; }
  static constexpr int count(int p) { return bounds[static_cast<std::size_t>(p + 1)] - bounds[static_cast<std::size_t>(p)]; }
  static constexpr double cost_of(int p) { return part_cost(p, first(p), first(p) + count(p)); }
  // The layers of pipeline part p: the stage's model is Model::part<part<p>>.
  template <int p>
  using part = Layers<first(p), count(p)>;
};

}  // namespace fived
