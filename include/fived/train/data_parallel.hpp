#pragma once
// Data-parallel training steps, on the host backend and on CUDA: every DP rank takes its
// slice of each global batch, and the gradients are averaged over the DP group; the policy
// (train/zero_policy.hpp) says how much of the training state each rank holds.
//
//   using M = Mesh<DP<4>>;
//   fived::host::run(M::size, [&](fived::host::Comm& world) {
//     auto ctx = make_mesh_context<M>(world);
//     GPT<cfg, M> model(GptInit{.seed = 1});                               // same init on every rank
//     fived::DataParallel<GPT<cfg, M>, fived::ZeRO<2>> dp(model, ctx, adamw_config, /*accum=*/3);
//     for (int step = 0; step < n; ++step) {
//       // tokens/targets: the GLOBAL batch of the step, accum micro-batches of [B, T], identical on every rank
//       double loss = dp.step(tokens, targets, B, T);                      // mean loss over the global batch
//     }
//     std::vector<float> weights = dp.full_params();                       // (a collective under ZeRO-3)
//   });
//
// The group is the model's mesh's gradient group (grad_group: DP x CP), its communicator
// taken from the MeshContext. On a mesh whose group has one rank (Mesh<>, Mesh<TP<4>>) no
// context is needed and DataParallel<Model> is the training step of one replica: the same
// clip and AdamW with every collective compiled away. That is the one optimizer step of
// every path. The model may itself be split over TP: DP then cuts and reduces one TP rank's
// buffer over the DP group of that TP rank.
//
// Data: micro-batch k of the step is rows [k*B, (k+1)*B) of `tokens`; rank r reads rows
// [r*B/DP, (r+1)*B/DP) of each micro-batch (`rows(r, B)`), so the DP ranks together see
// exactly the tokens a serial run of the same global batch sees. Gradient: each rank's
// gradient of its micro-batch's mean loss, scaled by 1/accum and averaged over DP, summed
// over the micro-batches: the serial run's, up to summation order.
//
// Buckets (train/bucket_plan.hpp) never cross a model unit (embeddings, each layer, ln_f +
// head); each is reduced on its own, through one padded staging buffer under ZeRO
// (train/bucket_staging.hpp), where each rank owns one equal piece of every bucket:
//   NoZeRO   all-reduce of each bucket in the last micro-batch; every rank steps all of it.
//   ZeRO<1>  reduce-scatter in the last micro-batch; AdamW state for this rank's pieces;
//            an all-gather per bucket brings every replica the new parameters.
//   ZeRO<2>  as ZeRO<1>, but every micro-batch's gradient is reduce-scattered as soon as
//            backward finishes its unit, added into this rank's gradient pieces, and the
//            unit's gradient pages given back (Ops::release_pages: device/host_pages.hpp,
//            device/cuda_pages.hpp) and taken back before backward writes them again.
//   ZeRO<3>  as ZeRO<2>, and the parameters too are pieces: a unit is all-gathered before
//            it runs (forward, and again backward), the next one prefetched, and given back
//            after; the outer units stay gathered for the step. Needs a model that calls
//            UnitHooks (model/unit_hooks.hpp; checked: train/unit_hook_check.hpp).
// With hooks, a unit's reductions and gathers run on the communication side (a thread on
// the host, a second stream on CUDA: train/comm_queue.hpp) while backward goes on; without,
// after backward; the results are the same bit for bit. The ranks compare a hash of their
// first weights (train/replica_check.hpp). Memory per policy (memory()), mixed precision
// and what waits for the device: docs/architecture.md, "Optimizer and data parallelism".
//
// Three floors: the shards and their collectives (train/bucket_shards.hpp), the step of one
// pair of flat buffers on them (train/bucket_trainer.hpp: hooks, clip, AdamW), and here a
// model's: one BucketTrainer for its dense buffers and, with a mixture of experts, one for
// its experts over the expert-data group (ZeRO only where that group has more than one
// rank), composed; and the step loop. What a rank saves and loads: train/trainer_state.hpp.

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fived/comm/types.hpp"
#include "fived/mesh/context.hpp"
#include "fived/model/unit_hooks.hpp"
#include "fived/optim/adamw.hpp"
#include "fived/pipeline/step_frame.hpp"
#include "fived/train/bucket_trainer.hpp"
#include "fived/train/zero_policy.hpp"

namespace fived {

namespace dp_detail {
// The experts' own trainer: over the expert-data group; ZeRO only where that group has more
// than one rank. None without experts.
struct no_experts {};
template <class Model, class Policy, std::size_t BucketBytes>
struct expert_trainer {
  using type = no_experts;
};
template <HasExperts Model, class Policy, std::size_t BucketBytes>
struct expert_trainer<Model, Policy, BucketBytes> {
  using E = typename Model::Experts;
  using type = BucketTrainer<E, std::conditional_t<(E::grad_group::size > 1), Policy, NoZeRO>, BucketBytes>;
};
}  // namespace dp_detail

template <class Model, class Policy = NoZeRO, std::size_t BucketBytes = (std::size_t{4} << 20)>
class DataParallel : public BucketTrainer<Model, Policy, BucketBytes> {
  using Dense = BucketTrainer<Model, Policy, BucketBytes>;
  static constexpr bool moe = HasExperts<Model>;
  using expert_trainer = typename dp_detail::expert_trainer<Model, Policy, BucketBytes>::type;

 public:
  // (The dense trainer's names this class reads, public as they are there.)
  using typename Dense::Memory, typename Dense::plan;
  using Dense::dp, Dense::stage, Dense::has_hooks, Dense::rank, Dense::accum;

  // One replica: a mesh whose gradient group has one rank. accum: micro-batches per step.
  DataParallel(Model& model, const AdamWConfig& config, int accum = 1) requires(dp == 1)
      : Dense(model, config, accum) {
    if constexpr (moe) {
      experts_ = std::make_unique<expert_trainer>(model.experts(), config, accum);
      wire_hooks();
    }
  }
  // ctx: this rank's MeshContext; the gradient group's communicator is taken from it (and
  // the expert-data group's, for a model with a mixture of experts).
  template <Communicator Comm>
  DataParallel(Model& model, MeshContext<typename Model::mesh, Comm>& ctx, const AdamWConfig& config, int accum = 1)
      : Dense(model, ctx, config, accum) {
    if constexpr (moe) {
      experts_ = std::make_unique<expert_trainer>(model.experts(), ctx, config, accum);
      wire_hooks();
    }
  }
  // grad_comm: this rank's communicator of the mesh's gradient group, given directly.
  template <Communicator Comm>
  DataParallel(Model& model, Comm& grad_comm, const AdamWConfig& config, int accum = 1)
    requires(!moe)
      : Dense(model, grad_comm, config, accum) {}

  // After a forward and backward run by the caller (NoZeRO): the gradients reduced over the
  // group, clipped to the global norm and one AdamW step. Returns the clip factor (read back).
  double apply_gradients() {
    static_assert(stage == 0, "fived::DataParallel::apply_gradients: under ZeRO use step(), which reduces each "
                              "micro-batch as backward finishes it");
    if constexpr (moe) experts_->reduce_all();
    Dense::reduce_all();
    update();
    return this->last_clip();
  }

  // Rows of each micro-batch that data rank r reads: [r*B/D, (r+1)*B/D), D the mesh's DP
  // extent. The CP ranks of a replica read the same rows (the model keeps its part of each
  // sequence), so D is the group's size over CP.
  static constexpr int data_ranks = dp / Model::mesh::cp;
  static FlatRange rows(int r, int B) {
    if (B < 1 || B % data_ranks != 0)
      throw std::invalid_argument("fived::DataParallel: the global batch B = " + std::to_string(B) +
                                  " is not divisible by the data-parallel size " + std::to_string(data_ranks) +
                                  " (every DP rank takes B / DP rows; use a multiple of " + std::to_string(data_ranks) +
                                  ")");
    const std::size_t b = static_cast<std::size_t>(B / data_ranks);
    return {static_cast<std::size_t>(r) * b, static_cast<std::size_t>(r + 1) * b};
  }
  // This rank's data rank: its index in the group is cp + CP * dp (mesh/mesh.hpp: CP varies
  // faster than DP).
  int data_rank() const { return rank() / Model::mesh::cp; }

  // One optimizer step on the global batch: `accum` micro-batches of [B, T] token ids, rows
  // [k*B, (k+1)*B) for micro-batch k, the same on every rank. Returns the mean loss over the
  // global batch (the same value on every rank).
  double step(std::span<const int> tokens, std::span<const int> targets, int B, int T_) {
    const FlatRange mine = rows(data_rank(), B);
    const std::size_t want = static_cast<std::size_t>(accum()) * static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    if (tokens.size() != want || targets.size() != want)
      throw std::invalid_argument("fived::DataParallel::step: tokens and targets must hold accum * B * T = " +
                                  std::to_string(want) + " ids (got " + std::to_string(tokens.size()) + " and " +
                                  std::to_string(targets.size()) + ")");
    const int b = static_cast<int>(mine.size());
    Model& model = this->model();
    // The frame every schedule's step runs (pipeline/step_frame.hpp): this is the one-stage
    // schedule, forward and backward of each micro-batch in turn.
    pipeline::StepFrame<DataParallel> frame(accum(), std::tie(*this), norm_total_.span());
    GraphStep graph(model.ops(), frame.graph_shape(tokens.size(), B, T_));  // plain unless set_step_graph(true)
    frame.begin();
    model.ops().begin_loss_sum();
    for (int k = 0; k < accum(); ++k) {
      const std::size_t off = (static_cast<std::size_t>(k) * static_cast<std::size_t>(B) + mine.begin) *
                              static_cast<std::size_t>(T_);
      if constexpr (has_hooks) model.enqueue_forward(tokens.data() + off, targets.data() + off, b, T_, hooks());
      else model.enqueue_forward(tokens.data() + off, targets.data() + off, b, T_);
      model.add_to_loss_sum(0);  // on a device: added there, read once below
      frame.gradients(0, *this, [&] {
        if constexpr (has_hooks) {
          model.backward(hooks());
        } else {
          for (int u = 0; u < plan::units; ++u) this->grads_in_use(u);
          model.backward();
        }
      });
    }
    frame.end();
    frame.sum_of_squares([](std::span<double>) {});  // every parameter is here
    frame.update();
    graph.launch();
    // The host's one wait for the device, with the whole step queued.
    const double rows = static_cast<double>(accum()) * b * Model::local_length(T_);
    return this->average(model.ops().loss_sum() / rows);
  }

  // Each step() after the second of its shape replays the device work of the second, captured
  // as a graph (nn/step_graph.hpp; a CUDA graph on CUDA, recorded calls on the host), while
  // the step's host code still runs. The collectives of every group (TP, CP, the gradients'
  // over DP x CP) are part of the graph. Not with a mixture of experts that routes dropless
  // (a step waits for their counts; pad_to_capacity waits for none) nor under ZeRO-2/3 (a
  // step gives gradient pages back and maps them again).
  // A step that changes in any other way than through its uploads (token ids, the learning
  // rate) is refused.
  void set_step_graph(bool on) {
    static_assert(graph_step_allowed,
                  "fived::DataParallel::set_step_graph: a step is captured as a graph without experts or with experts "
                  "padded to capacity, and under NoZeRO or ZeRO<1> only (a dropless expert count's wait cannot be "
                  "replayed, nor ZeRO-2/3's mapping of pages)");
    this->model().ops().use_step_graph = on;
  }
  // Whether the model's step waits for its experts' counts (the model contract's
  // routing_waits; a model that does not say: whether it has experts).
  static constexpr bool routing_waits = [] {
    if constexpr (requires { Model::routing_waits; }) return static_cast<bool>(Model::routing_waits);
    else return moe;
  }();
  static constexpr bool graph_step_allowed = !routing_waits && stage < 2;

  // ---- the step in pieces (train/bucket_trainer.hpp), over the experts' buffers too ----------

  void begin_step() {
    if constexpr (moe) experts_->begin_step();
    Dense::begin_step();
  }
  const UnitHooks& hooks() const {
    if constexpr (moe) return hooks_;
    else return Dense::hooks();
  }
  void begin_backward(bool last) {
    if constexpr (moe) experts_->begin_backward(last);
    Dense::begin_backward(last);
  }
  void end_backward() {
    if constexpr (moe) experts_->end_backward();
    Dense::end_backward();
  }
  void end_micro_batches() {
    if constexpr (moe) experts_->end_micro_batches();
    Dense::end_micro_batches();
  }
  void add_grad_sum_of_squares(double* total) {
    Dense::add_grad_sum_of_squares(total);
    if constexpr (moe) experts_->add_grad_sum_of_squares(total);
  }
  // With experts, their step too, and the balance of their loads, summed over the gradient
  // group (Model::balance_experts; queued, nothing read back).
  void update(const double* total_sum_of_squares) {
    Dense::update(total_sum_of_squares);
    if constexpr (moe) {
      experts_->update(total_sum_of_squares);
      // A step the optimizer skips (a norm not finite) moves no selection bias either.
      this->model().balance_experts([this](auto loads) { this->sum_over_group(loads); },
                                    this->optimizer().hp.skip_non_finite ? total_sum_of_squares : nullptr);
    }
  }
  void forget_skipped_step() {
    Dense::forget_skipped_step();
    if constexpr (moe) experts_->forget_skipped_step();
  }
  // After end_micro_batches: the clip over this trainer's parameters, which are all there are
  // (no pipeline), and the AdamW step; queued, as step() queues them.
  void update() {
    pipeline::StepFrame<DataParallel> frame(accum(), std::tie(*this), norm_total_.span());
    frame.sum_of_squares([](std::span<double>) {});
    frame.update();
  }
  // With a mixture of experts, the expert buffers' state is included.
  Memory memory() const {
    Memory m = Dense::memory();
    if constexpr (moe) m += experts_->memory();
    return m;
  }
  void set_overlap(bool on) {
    Dense::set_overlap(on);
    if constexpr (moe) experts_->set_overlap(on);
  }
  // The trainer of the model's expert buffers (a mixture of experts).
  expert_trainer& experts() requires moe { return *experts_; }

 private:
  // The model's hooks: the dense trainer's, then the experts'.
  void wire_hooks() {
    const UnitHooks& d = Dense::hooks();
    const UnitHooks& e = experts_->hooks();
    auto both = [](const std::function<void(int)>& a, const std::function<void(int)>& b) {
      return [&a, &b](int u) { detail::call(a, u), detail::call(b, u); };
    };
    hooks_.before_forward = both(d.before_forward, e.before_forward);
    hooks_.after_forward = both(d.after_forward, e.after_forward);
    hooks_.before_backward = both(d.before_backward, e.before_backward);
    hooks_.after_backward = both(d.after_backward, e.after_backward);
    hooks_.after_input_grad = both(d.after_input_grad, e.after_input_grad);
    hooks_.before_weight_grad = both(d.before_weight_grad, e.before_weight_grad);
  }

  UnitHooks hooks_;                          // with experts: both trainers' (wire_hooks)
  std::unique_ptr<expert_trainer> experts_;  // a mixture of experts' (built after the dense one)
  Buffer<double, typename Model::device> norm_total_{1};  // the step's squared gradient norm (device memory)
};

}  // namespace fived
