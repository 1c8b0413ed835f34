#pragma once
// Bytes per GPU: the training state (parameters, gradients, optimizer, ZeRO staging) of one
// part's flat buffers, cut by the same BucketPlan DataParallel uses, and the Memory of a rank.
//
// Training state, per buffer (train/data_parallel.hpp, DataParallel::memory()): N elements,
// S = BucketPlan::shard_total (N/G plus the padding that makes every bucket a multiple of
// 64·G elements), O = BucketPlan::owned_total(0) (what the first rank of the group owns, the
// most any rank does), t = element bytes, k = 8 (fp32 moments) or 12 (bf16: + fp32 master):
//
//   ZeRO      params   grads   optimizer   staging (one padded bucket + one piece)
//   0         tN       tN      kN          0
//   1         tN       tN      kO          t·(max padded + max padded / G)
//   2         tN       tS      kO          "
//   3         tS       tS      kO          "
//
// G is the group the buffer reduces over: DP x CP for the dense tensors, the expert-data
// group (DP·CP/EP) for the experts, which train without ZeRO where that group has one rank.
// ZeRO-2 and 3 also hold whole units while they run (`transient`, DataParallel's
// transient_peak): the gradients of the unit in backward until its reduction is issued
// (with a tied head, the embedding's from the head's backward to the end: the head writes
// wte's gradient), and under ZeRO-3 the parameters of both end units (gathered for the whole
// step) and two blocks (the one running and the one prefetched). The peak is in a block's
// backward: ZeRO-2 holds a block's gradients (+ the embedding's when tied), or an end unit's
// if larger; ZeRO-3 both ends and three blocks (two gathered, one's gradients), + the
// embedding's gradients when tied. The planner counts given-back memory as given back, as
// DataParallel::memory() does: on the host the pages go back to the system, on CUDA their
// chunks to a pool that the next commit maps again (device/cuda_pages.hpp; a chunk that
// straddles a unit boundary stays while either unit is live).

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "fived/plan/activations.hpp"
#include "fived/plan/model.hpp"
#include "fived/train/bucket_plan.hpp"

namespace fived::plan {

// One part's flat buffer as units (embedding, each block, final norm + head), sized like
// ParamTable lays them out for TP (and EP): what BucketPlan cuts into buckets. Experts: the
// expert buffer, with the same unit numbers (units without experts are empty).
template <Transformer Model, int TP, int EP, Blocks Part, bool Experts>
struct UnitLayout {
  static constexpr int units = (Part.embedding ? 1 : 0) + Part.count + (Part.head ? 1 : 0);
  static constexpr std::size_t unit_size(int u) {
    if (Part.embedding && u == 0) return Experts ? 0 : static_cast<std::size_t>(Model.embedding_elements(TP));
    const int block = u - (Part.embedding ? 1 : 0);
    if (block >= Part.count) return Experts ? 0 : static_cast<std::size_t>(Model.final_elements(TP, Part.embedding));
    const int layer = Part.first + block;
    return static_cast<std::size_t>(Experts ? Model.block_expert_elements(layer, TP, EP) : Model.block_elements(layer, TP));
  }
  static constexpr std::size_t unit_begin(int u) {
    std::size_t at = 0;
    for (int k = 0; k < u && k < units; ++k) at += unit_size(k);
    return at;
  }
  static constexpr std::size_t size = unit_begin(units);
  // The embedding's gradient is written at both ends of the part (a tied head on it).
  static constexpr bool tied_ends = Model.tied && Part.embedding && Part.head && !Experts;
  // wte where a tied model's pipeline holds it on two stages (ParamTable::tied_range): first
  // on the embedding's part, last on the head's.
  static constexpr FlatRange tied_range = [] {
    const std::size_t wte = static_cast<std::size_t>(Model.padded_vocab / TP) * static_cast<std::size_t>(Model.d_model);
    if (!Model.tied || Experts || Part.embedding == Part.head) return FlatRange{};
    return Part.embedding ? FlatRange{0, wte} : FlatRange{size - wte, size};
  }();
};

// What a rank holds for training between steps, and while a step runs.
struct State {
  Bytes parameters = 0, gradients = 0, optimizer = 0, staging = 0, transient = 0;
  constexpr State& operator+=(const State& o) {
    parameters += o.parameters, gradients += o.gradients, optimizer += o.optimizer, staging += o.staging,
        transient += o.transient;
    return *this;
  }
};

// The state of one buffer laid out by Layout, reduced over a group of G ranks at ZeRO `zero`.
template <class Layout, int G, int T, std::size_t BucketBytes>
constexpr State buffer_state(int zero) {
  using BP = BucketPlan<Layout, G, static_cast<std::size_t>(T), BucketBytes>;
  const Bytes t = T, N = Layout::size, S = BP::shard_total, k = T == 2 ? 12 : 8;
  if (N == 0) return {};
  State s{zero < 3 ? t * N : t * S, zero < 2 ? t * N : t * S, k * (zero == 0 ? N : BP::owned_total(0)),
          zero >= 1 ? t * (BP::max_padded + BP::max_padded / G) : 0, 0};
  if (zero >= 2) {
    const int U = Layout::units;
    Bytes inner = 0;
    for (int u = 1; u + 1 < U; ++u) inner = std::max<Bytes>(inner, Layout::unit_size(u));
    const Bytes first = Layout::unit_size(0), last = U > 1 ? Layout::unit_size(U - 1) : 0;
    const Bytes held_first = Layout::tied_ends ? first : 0;  // the head's wte gradient, held to the end
    if (zero == 2) s.transient = t * (held_first + std::max({inner, last, held_first > 0 ? Bytes{0} : first}));
    else s.transient = t * (first + last + 3 * inner + held_first);
  }
  return s;
}

// One pipeline rank's bytes. `activations` is one micro-batch slot (of its largest chunk when
// it holds several), `in_flight` the (micro-batch, chunk) pairs its schedule holds at once
// (pipeline/simulate.hpp's peak_pending: a slot is kept until its backward, or its W), and
// the peak their product. A schedule that splits the backward also keeps, for each pair
// between its I and its W (`awaiting_w`, peak_deferred), one tape of snapshots (`deferred`:
// plan/activations.hpp's deferred_bytes).
struct Memory {
  Bytes parameters = 0, gradients = 0, optimizer = 0, staging = 0;
  Bytes transient = 0;    // ZeRO-2/3: whole units gathered or unreduced while a step runs
  Bytes activations = 0;  // one micro-batch slot
  int in_flight = 0;
  Bytes peak_activations = 0;  // activations x in_flight
  Bytes deferred = 0;          // one micro-batch's snapshots for its W
  int awaiting_w = 0;
  Bytes peak_deferred = 0;  // deferred x awaiting_w
  Bytes recompute = 0;      // the buffers recomputation runs in
  Bytes work = 0;           // buffers the slots share: gradients of the stream, SP rows, ring, MoE,
                            // the pipeline's boundary buffers and the tied gradient's swap
  constexpr Bytes state() const { return parameters + gradients + optimizer + staging; }
  constexpr Bytes total() const { return state() + transient + peak_activations + peak_deferred + recompute + work; }
};

}  // namespace fived::plan
