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

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/mesh/mesh_comm.hpp"
#include "fived/comm/types.hpp"
#include "fived/device/bf16.hpp"
#include "fived/mesh/context.hpp"
#include "fived/model/unit_hooks.hpp"
#include "fived/optim/adamw.hpp"
#include "fived/train/bucket_plan.hpp"
#include "fived/train/bucket_staging.hpp"
#include "fived/train/comm_queue.hpp"
#include "fived/train/replica_check.hpp"
#include "fived/train/unit_hook_check.hpp"
#include "fived/train/zero_policy.hpp"
#if defined(__CUDACC__)
#include "fived/train/cuda/comm_queue.hpp"  // CommQueue<T, Cuda>
#endif

namespace fived {

template <class Model, class Policy = NoZeRO, std::size_t BucketBytes = (std::size_t{4} << 20)>
class DataParallel {
  using group = typename dp_detail::reduce_group<Model>::type;
  static constexpr int DP = group::size;
  static_assert(is_zero_policy<Policy>, "fived::DataParallel: the policy must be fived::NoZeRO or fived::ZeRO<S>");
  static_assert(std::is_same_v<typename Model::value_type, float> ||
                    std::is_same_v<typename Model::value_type, double> ||
                    std::is_same_v<typename Model::value_type, bf16>,
                "fived::DataParallel: the model's element type must be float, double or fived::bf16");

 public:
  using model_type = Model;
  using T = typename Model::value_type;
  using Device = typename Model::device;
  using ops_type = typename Model::ops_type;
  using buffer = Buffer<T, Device>;
  using layout = typename Model::layout;
  using policy = Policy;
  using plan = BucketPlan<layout, DP, sizeof(T), BucketBytes>;
  using optimizer_type = AdamWFor<Model>;
  static constexpr int dp = DP;
  static constexpr int stage = Policy::stage;
  static_assert(stage == 0 || DP > 1,
                "fived::DataParallel: ZeRO shards the training state over the data-parallel group, which has one rank "
                "on this mesh; use NoZeRO (or a mesh with DP > 1)");
  static constexpr bool has_hooks = requires(Model& m, const int* ids, const UnitHooks& h) {
    m.forward(ids, ids, 1, 1, h);
    m.backward(h);
  } || requires { requires Model::calls_hooks; };
  static_assert(stage < 3 || (has_hooks && plan::has_units),
                "fived::DataParallel: ZeRO<3> gathers each unit's parameters just before the model uses them, so the "
                "model must call UnitHooks in forward and backward and its layout must have units (docs/model.md): "
                "use ZeRO<1> or ZeRO<2> with this model");

  // The hooks given to the model point at this object.
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // One replica: a mesh whose gradient group has one rank. accum: micro-batches per step.
  DataParallel(Model& model, const AdamWConfig& config, int accum = 1) requires(DP == 1)
      : DataParallel(model, MeshComm<group>(), 0, config, accum) {
    if constexpr (HasExperts<Model>) experts_ = std::make_unique<expert_trainer>(model.experts(), config, accum);
  }
  // ctx: this rank's MeshContext; the gradient group's communicator is taken from it (and
  // the expert-data group's, for a model with a mixture of experts).
  template <Communicator Comm>
  DataParallel(Model& model, MeshContext<typename Model::mesh, Comm>& ctx, const AdamWConfig& config, int accum = 1)
      : DataParallel(model, MeshComm<group>(ctx.template comm<group>()), group::index(ctx.rank()), config, accum) {
    if constexpr (HasExperts<Model>) experts_ = std::make_unique<expert_trainer>(model.experts(), ctx, config, accum);
  }

  // grad_comm: this rank's communicator of the mesh's gradient group, given directly.
  template <Communicator Comm>
  DataParallel(Model& model, Comm& grad_comm, const AdamWConfig& config, int accum = 1)
    requires(!HasExperts<Model>)
      : DataParallel(model, MeshComm<group>(grad_comm), grad_comm.rank(), config, accum) {}

  // After a forward and backward run by the caller (NoZeRO): the gradients reduced over the
  // group, clipped to the global norm and one AdamW step. Returns the clip factor.
  double apply_gradients() {
    static_assert(stage == 0, "fived::DataParallel::apply_gradients: under ZeRO use step(), which reduces each "
                              "micro-batch as backward finishes it");
    if constexpr (HasExperts<Model>) experts_->reduce_all();
    reduce_all();
    return optimizer_step();
  }

 private:
  void shard_state() {
    ops_type& ops = model_.ops();
    if constexpr (stage == 3) {  // the pieces are the parameters from now on
      for (std::size_t i = 0; i < plan::count; ++i)
        ops.copy(param_piece(i).data(), model_.params().data() + owned(i).begin, owned(i).size());
      ops.release_pages(model_.params());
    }
    if constexpr (stage >= 2) {
      ops.release_pages(model_.grads());
      ops.trim_pages();  // the device holds what a step holds at once, no more
    }
  }

 public:

  // Rows of each micro-batch that data rank r reads: [r*B/D, (r+1)*B/D), D the mesh's DP
  // extent. The CP ranks of a replica read the same rows (the model keeps its part of each
  // sequence), so D is the group's size over CP.
  static constexpr int data_ranks = DP / Model::mesh::cp;
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
  int data_rank() const { return rank_ / Model::mesh::cp; }

  // One optimizer step on the global batch: `accum` micro-batches of [B, T] token ids, rows
  // [k*B, (k+1)*B) for micro-batch k, the same on every rank. Returns the mean loss over the
  // global batch (the same value on every rank).
  double step(std::span<const int> tokens, std::span<const int> targets, int B, int T_) {
    const FlatRange mine = rows(data_rank(), B);
    const std::size_t want = static_cast<std::size_t>(accum_) * static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    if (tokens.size() != want || targets.size() != want)
      throw std::invalid_argument("fived::DataParallel::step: tokens and targets must hold accum * B * T = " +
                                  std::to_string(want) + " ids (got " + std::to_string(tokens.size()) + " and " +
                                  std::to_string(targets.size()) + ")");
    const int b = static_cast<int>(mine.size());
    begin_step();
    double loss = 0;
    for (int k = 0; k < accum_; ++k) {
      const std::size_t off = (static_cast<std::size_t>(k) * static_cast<std::size_t>(B) + mine.begin) *
                              static_cast<std::size_t>(T_);
      // The loss is read after backward is queued: on a device the host then waits while
      // backward runs, not before it.
      if constexpr (has_hooks) {
        model_.enqueue_forward(tokens.data() + off, targets.data() + off, b, T_, hooks_);
        begin_backward(k == accum_ - 1);
        model_.backward(hooks_);
      } else {
        model_.enqueue_forward(tokens.data() + off, targets.data() + off, b, T_);
        begin_backward(k == accum_ - 1);
        for (int u = 0; u < plan::units; ++u) grads_in_use(u);
        model_.backward();
      }
      loss += model_.loss();
      end_backward();
    }
    end_micro_batches();
    loss = comm_.all_reduce_host(loss / accum_, ReduceOp::avg);
    optimizer_step();
    return loss;
  }

  // ---- the step in pieces, for a caller that runs the micro-batches itself (a pipeline
  // executor, whose forwards and backwards interleave):
  //   begin_step();
  //   per micro-batch: model.forward(..., hooks()); ... begin_backward(last); model.backward(hooks()); end_backward();
  //   end_micro_batches();
  //   update(total sum of squares of the gradient: grad_sum_of_squares() summed over whatever
  //          else holds parameters, e.g. the other pipeline stages)

  // Zeroes the gradients (or, under ZeRO-2/3, the gradient pieces).
  void begin_step() {
    if constexpr (HasExperts<Model>) experts_->begin_step();
    async_ = overlap();
    peak_ = held_;
    if constexpr (stage < 2) model_.zero_grad();  // ZeRO-2/3: released gradient pages read as zeros
    else model_.ops().zero(grad_pieces_);
  }
  // What the model's forward and backward must be given.
  const UnitHooks& hooks() const { return hooks_; }
  // Before a micro-batch's backward; `last`: the step's last one (NoZeRO and ZeRO-1 reduce
  // only then, ZeRO-2/3 every micro-batch).
  void begin_backward(bool last) {
    if constexpr (HasExperts<Model>) experts_->begin_backward(last);
    reducing_ = stage >= 2 || last;
    in_backward_ = true;
    std::fill(reduced_.begin(), reduced_.end(), false);
  }
  // After it: waits for what backward handed over, and reduces what it did not.
  void end_backward() {
    in_backward_ = false;
    if constexpr (stage == 3) hook_check_.check([](int u) { return plan::unit(u); });
    if constexpr (HasExperts<Model>) experts_->end_backward();
    queue_.drain();
    if (reducing_) {
      for (int u = plan::units - 1; u >= 0; --u) reduce_unit(u, false);
      queue_.drain();
    }
  }
  // After the step's last backward (ZeRO-3: the units still gathered are given back).
  void end_micro_batches() {
    if constexpr (HasExperts<Model>) experts_->end_micro_batches();
    if constexpr (stage == 3)
      for (int u = 0; u < plan::units; ++u) release_params(u);
  }
  // This replica's part of the squared global gradient norm, every parameter counted once
  // over TP and the DP group (a collective over them; on a device the host reads it).
  double grad_sum_of_squares() {
    ops_type& ops = model_.ops();
    ops.begin_sum_of_squares();
    for (std::size_t i = 0; i < plan::count; ++i) add_sum_of_squares(ops, i);
    double s = model_.sum_over_tp(ops.sum_of_squares());
    if constexpr (stage >= 1) s = comm_.all_reduce_host(s);  // NoZeRO: every replica has the same sum
    if constexpr (HasExperts<Model>) s += experts_->grad_sum_of_squares();
    return s;
  }
  // Clips to the global norm sqrt(total_sum_of_squares) (when max_norm is set), one AdamW
  // step on what this rank owns, then (NoZeRO aside) the new parameters to every replica:
  // all-gathered now under ZeRO-1/2, at their next use under ZeRO-3. Returns the clip factor.
  double update(double total_sum_of_squares) {
    ops_type& ops = model_.ops();
    double f = 1.0;
    last_norm_ = std::sqrt(total_sum_of_squares);
    if (opt_.hp.max_norm > 0) {
      f = last_clip_ = opt_.clip_factor(total_sum_of_squares);
      if (f < 1.0)
        for (std::size_t i = 0; i < plan::count; ++i) ops.scale(owned_grads(i).data(), owned(i).size(), f);
    }
    opt_.begin_step();
    for (std::size_t i = 0; i < plan::count; ++i)
      if (!owned(i).empty()) opt_.update(ops, owned_params(i), owned_grads(i), owned(i), owned(i).begin);
    if constexpr (stage == 1 || stage == 2) {
      queue_.submit([this](ops_type& side) {
        for (std::size_t i = 0; i < plan::count; ++i) gather_bucket(side, i, owned_params(i), model_.params());
      }, false);
      queue_.drain();  // the next forward reads them
    }
    if constexpr (HasExperts<Model>) {
      experts_->update(total_sum_of_squares);
      model_.balance_experts(comm_);
    }
    return f;
  }

  // The whole parameter buffer (layout::size elements), in host memory. Under ZeRO<3> an
  // all-gather of every bucket, so every DP rank must call it; otherwise a copy of the
  // model's parameters.
  std::vector<T> full_params() {
    if constexpr (stage < 3) return model_.params_to_host();
    else return gathered([this](std::size_t i) { return std::span<const T>(param_piece(i)); });
  }

  // The gradient after the step's reduction and before its update (between end_micro_batches
  // and update): the whole layout's, averaged over the group and scaled as the optimizer will
  // see it, in host memory, the same on every rank of the group. Under ZeRO each rank holds
  // only its pieces reduced, so this all-gathers them (a collective over the group).
  std::vector<T> reduced_grads() {
    if constexpr (stage == 0) return model_.ops().to_host(std::span<const T>(model_.grads()));
    else return gathered([this](std::size_t i) { return std::span<const T>(owned_grads(i)); });
  }

  // The same for flat range r only (a collective over the group under ZeRO: the buckets that
  // overlap r are gathered), and back: after the caller changed it (a tied tensor's gradient
  // summed over the pipeline stages that hold it), every rank keeps its owned part of it.
  std::vector<T> reduced_grads(FlatRange r) {
    if constexpr (stage == 0) {
      return model_.ops().to_host(std::span<const T>(model_.grads().subspan(r.begin, r.size())));
    } else {
      buffer all = model_.ops().template make_buffer<T>(layout::size);
      queue_.submit([&](ops_type& ops) {
        for (std::size_t i = 0; i < plan::count; ++i)
          if (overlaps(plan::bucket(i).range, r)) gather_bucket(ops, i, owned_grads(i), all.span());
      }, false);
      queue_.drain();
      return model_.ops().to_host(std::span<const T>(all.span().subspan(r.begin, r.size())));
    }
  }
  void set_reduced_grads(FlatRange r, std::span<const T> values) {
    if (values.size() != r.size())
      throw std::invalid_argument("fived::DataParallel::set_reduced_grads: " + std::to_string(values.size()) +
                                  " values for a range of " + std::to_string(r.size()));
    for (std::size_t i = 0; i < plan::count; ++i) {
      const FlatRange o = owned(i);
      const std::size_t b = std::max(o.begin, r.begin), e = std::min(o.end, r.end);
      if (b >= e) continue;
      model_.ops().upload(owned_grads(i).data() + (b - o.begin), values.data() + (b - r.begin), e - b);
    }
  }

  // Bytes this rank holds for training state between steps (see the top of this file).
  struct Memory {
    std::size_t params = 0, grads = 0, optimizer = 0, staging = 0;
    std::size_t transient_peak = 0;  // ZeRO-2/3: whole units held during the last step
    std::size_t total() const { return params + grads + optimizer + staging; }
  };
  // With a mixture of experts, the expert buffers' state is included.
  Memory memory() const {
    const std::size_t t = sizeof(T);
    Memory m{(stage < 3 ? layout::size : plan::shard_total) * t, (stage < 2 ? layout::size : plan::shard_total) * t,
             opt_.state_bytes(), staging_.elements() * t, stage >= 2 ? peak_ * t : 0};
    if constexpr (HasExperts<Model>) {
      const Memory e = experts_->memory();
      m.params += e.params, m.grads += e.grads, m.optimizer += e.optimizer, m.staging += e.staging;
      m.transient_peak += e.transient_peak;
    }
    return m;
  }
  // The DataParallel of the model's expert buffers (a mixture of experts).
  auto& experts() requires HasExperts<Model> { return *experts_; }

  // Reduce each unit's buckets during backward, as soon as the model has finished it (on by
  // default; needs a model that calls UnitHooks). Off: every reduction runs
  // after backward. The results are the same bit for bit; what changes is when the
  // collectives are issued.
  void set_overlap(bool on) {
    overlap_ = on;
    if constexpr (HasExperts<Model>) experts_->set_overlap(on);
  }
  // Off: every reduction is issued after backward. The results are the same bit for bit.
  bool overlap() const { return has_hooks && overlap_; }

  // The mean of a value over the data-parallel group (a loss), on every rank of it.
  double average(double v) { return comm_.all_reduce_host(v, ReduceOp::avg); }

  // ---- checkpoints (train/checkpoint.hpp) -------------------------------------------------

  // What this rank saves: its piece of every bucket (plan::owned), whatever the policy, so the
  // group's ranks together save every element of the buffer once.
  std::vector<FlatRange> save_ranges() const {
    std::vector<FlatRange> v;
    for (std::size_t i = 0; i < plan::count; ++i)
      if (const FlatRange r = plan::owned(i, rank_); !r.empty()) v.push_back(r);
    return v;
  }
  // The values of a kind of state over `r` (one of save_ranges()), in host memory and in the
  // precision they are kept in: the parameters (T), or AdamW's masters (bf16 models), first
  // or second moments (optimizer_type::state_type). f(std::span<const U>) is given them.
  using State = TrainState;
  template <class F>
  void save_state(State kind, FlatRange r, F&& f) {
    ops_type& ops = model_.ops();
    if (kind == State::params) {
      std::span<const T> from;
      if constexpr (stage == 3) {  // the piece holds the owned elements first
        const std::size_t i = bucket_of(r);
        from = param_piece(i).subspan(r.begin - owned(i).begin, r.size());
      } else {
        from = model_.params().subspan(r.begin, r.size());
      }
      const std::vector<T> h = ops.to_host(from);
      f(std::span<const T>(h));
      return;
    }
    using S = typename optimizer_type::state_type;
    const std::span<const S> s = kind == State::master ? opt_.master() : kind == State::exp_avg ? opt_.exp_avg() : opt_.exp_avg_sq();
    const std::vector<S> h = ops.to_host(s.subspan(opt_.state_offset(r), r.size()));
    f(std::span<const S>(h));
  }
  // What load_state asks of its fetch, in its order: the parameters this rank holds (under
  // ZeRO-3 its owned piece of each bucket, else the whole buffer), then the AdamW state of
  // each range its optimizer owns. A loader reads just these (train/checkpoint.hpp).
  std::vector<std::pair<State, FlatRange>> state_wanted() const {
    std::vector<std::pair<State, FlatRange>> w;
    if constexpr (stage == 3)
      for (std::size_t i = 0; i < plan::count; ++i) w.push_back({State::params, owned(i)});
    else
      w.push_back({State::params, FlatRange{0, layout::size}});
    for (const FlatRange& r : opt_.owned()) {
      w.push_back({State::exp_avg, r}), w.push_back({State::exp_avg_sq, r});
      if constexpr (optimizer_type::has_master) w.push_back({State::master, r});
    }
    return w;
  }
  // Restores the step's state: fetch(kind, range) gives the values of each range of the flat
  // buffer that state_wanted() names (from a checkpoint of any mesh); `step` is AdamW's step
  // count. (A mixture of experts' expert buffers are their own DataParallel's: experts().)
  template <class Fetch>
  void load_state(Fetch&& fetch, int step) {
    ops_type& ops = model_.ops();
    using S = typename optimizer_type::state_type;
    std::vector<S> m, v, master;
    std::size_t bucket = 0;  // ZeRO-3: the next bucket's piece
    for (const auto& [k, r] : state_wanted()) {
      const std::vector<double> x = fetch(k, r);
      if (k == State::params) {
        std::vector<T> p(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) p[i] = static_cast<T>(x[i]);
        T* to = stage == 3 ? param_piece(bucket++).data() : model_.params().data() + r.begin;
        ops.upload(to, p.data(), p.size());
        continue;
      }
      std::vector<S>& to = k == State::exp_avg ? m : k == State::exp_avg_sq ? v : master;
      for (double d : x) to.push_back(static_cast<S>(d));
    }
    opt_.restore(ops, step, m, v, master);
  }
  int optimizer_steps() const { return opt_.step_count(); }

  // The clip factor of the last step (1: not clipped).
  double last_clip() const { return last_clip_; }
  // The global gradient norm of the last update, before clipping (every axis counted).
  double grad_norm() const { return last_norm_; }
  optimizer_type& optimizer() { return opt_; }
  const optimizer_type& optimizer() const { return opt_; }
  int rank() const { return rank_; }
  int accum() const { return accum_; }

 private:
  DataParallel(Model& model, MeshComm<group> comm, int rank, const AdamWConfig& config, int accum)
      : model_(model), comm_(std::move(comm)), rank_(rank), accum_(accum), opt_(config, owned_ranges(rank)),
        queue_(model.ops()) {
    if (accum < 1)
      throw std::invalid_argument("fived::DataParallel: accum (micro-batches per step) must be at least 1, got " +
                                  std::to_string(accum));
    comm_.set_compute_stream(queue_.stream());  // the group's collectives run on the communication side
    auto make = [&](std::size_t n) { return model_.ops().template make_buffer<T>(n); };
    if constexpr (stage >= 1) {
      staging_ = BucketStaging<plan, T, Device>(model_.ops());
    }
    if constexpr (stage >= 2) grad_pieces_ = make(plan::shard_total);
    if constexpr (stage == 3) param_pieces_ = make(plan::shard_total);
    reduced_.assign(plan::units, false);
    gathered_.assign(plan::units, false);
    gather_ticket_.assign(plan::units, 0);
    grads_live_.assign(plan::units, false);
    hooks_.before_forward = [this](int u) {
      hook_check_.saw(u, UnitHookCheck::before_forward);
      use_params(u, u + 1);
      if constexpr (HasExperts<Model>) detail::call(experts_->hooks().before_forward, u);
    };
    hooks_.after_forward = [this](int u) {
      hook_check_.saw(u, UnitHookCheck::after_forward);
      done_with_params(u);
      if constexpr (HasExperts<Model>) detail::call(experts_->hooks().after_forward, u);
    };
    hooks_.before_backward = [this](int u) {
      hook_check_.saw(u, UnitHookCheck::before_backward);
      grads_in_use(u);
      use_params(u, u - 1);
      if constexpr (HasExperts<Model>) detail::call(experts_->hooks().before_backward, u);
    };
    hooks_.after_backward = [this](int u) {
      hook_check_.saw(u, UnitHookCheck::after_backward);
      if (async_ && reducing_) reduce_unit(u, true);
      done_with_params(u);
      if constexpr (HasExperts<Model>) detail::call(experts_->hooks().after_backward, u);
    };
    hooks_.after_input_grad = [this](int u) {  // a split backward's halves (model/unit_hooks.hpp)
      done_with_params(u);
      if constexpr (HasExperts<Model>) detail::call(experts_->hooks().after_input_grad, u);
    };
    hooks_.before_weight_grad = [this](int u) {
      grads_in_use(u);
      if constexpr (HasExperts<Model>) detail::call(experts_->hooks().before_weight_grad, u);
    };
    check_replicas_agree();
    shard_state();
  }

  void check_replicas_agree() {
    if constexpr (DP > 1 && requires { model_.params_to_host(); }) {
      const std::vector<T> p = model_.params_to_host();
      check_replicas_agree_over(comm_, std::span<const T>(p));
    }
  }

  // What this rank's optimizer owns of bucket i: the whole bucket without ZeRO, else its piece.
  static FlatRange owned(std::size_t i, int r) { return stage == 0 ? plan::bucket(i).range : plan::owned(i, r); }
  FlatRange owned(std::size_t i) const { return owned(i, rank_); }
  static std::vector<FlatRange> owned_ranges(int r) {
    std::vector<FlatRange> v;
    for (std::size_t i = 0; i < plan::count; ++i)
      if (!owned(i, r).empty()) v.push_back(owned(i, r));
    return v;
  }
  // This rank's stored piece of bucket i in a sharded buffer (its owned elements first).
  static std::span<T> piece_of(buffer& v, std::size_t i) {
    return v.span().subspan(plan::bucket(i).shard_offset, plan::shard_size(i));
  }
  // A unit's ranges of the model's buffers: ZeRO-2/3 give them back with Ops::release_pages
  // once done (after the work queued on that Ops' stream) and take them back with
  // commit_pages before the next write.
  std::span<T> unit_params(int u) { return model_.params().subspan(plan::unit(u).begin, plan::unit(u).size()); }
  std::span<T> unit_grads(int u) { return model_.grads().subspan(plan::unit(u).begin, plan::unit(u).size()); }
  std::span<T> param_piece(std::size_t i) { return piece_of(param_pieces_, i); }
  // The whole buffer from every rank's piece of every bucket (piece(i): this rank's of bucket
  // i), all-gathered over the group, in host memory.
  template <class Piece>
  std::vector<T> gathered(Piece&& piece) {
    buffer all = model_.ops().template make_buffer<T>(layout::size);
    queue_.submit([&](ops_type& ops) {
      for (std::size_t i = 0; i < plan::count; ++i) gather_bucket(ops, i, piece(i), all.span());
    }, false);
    queue_.drain();
    return model_.ops().to_host(std::span<const T>(all.span()));
  }
  // The gradient of what this rank owns of bucket i, from its first owned element on.
  std::span<T> owned_grads(std::size_t i) {
    if constexpr (stage >= 2) return piece_of(grad_pieces_, i).first(owned(i).size());
    else return model_.grads().subspan(owned(i).begin, owned(i).size());
  }
  static constexpr bool overlaps(FlatRange a, FlatRange b) { return a.begin < b.end && b.begin < a.end; }
  // The bucket holding flat range r.
  static std::size_t bucket_of(FlatRange r) {
    for (std::size_t i = 0; i < plan::count; ++i)
      if (plan::bucket(i).range.contains(r)) return i;
    throw std::invalid_argument("fived::DataParallel: range [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                ") is not inside one bucket");
  }
  std::span<T> owned_params(std::size_t i) {
    if constexpr (stage == 3) return param_piece(i).first(owned(i).size());
    else return model_.params().subspan(owned(i).begin, owned(i).size());
  }

  // ---- gradients ------------------------------------------------------------------------

  // Scale bucket i by 1/accum and reduce it over DP: all-reduce in place (NoZeRO), or
  // reduce-scatter through the padded staging buffer into this rank's piece (ZeRO). `ops`:
  // the communication side's kernels.
  void reduce_bucket(ops_type& ops, std::size_t i) {
    const Bucket& bk = plan::bucket(i);
    std::span<T> g = model_.grads().subspan(bk.range.begin, bk.range.size());
    constexpr double scale = dp_detail::grad_scale<Model>();
    if (accum_ > 1 || scale != 1.0) ops.scale(g.data(), g.size(), scale / accum_);
    if constexpr (stage == 0) {
      comm_.all_reduce(g, ReduceOp::avg);
    } else {
      const std::span<const T> out = staging_.reduce_scatter(ops, comm_, i, g);
      std::span<T> mine = owned_grads(i);
      if constexpr (stage == 1) ops.copy(mine.data(), out.data(), mine.size());
      else ops.residual_forward(mine.data(), mine.data(), out.data(), mine.size());
    }
  }

  // Reduces unit u's buckets (ZeRO-2/3: and gives its gradient pages back), on the
  // communication thread when `async`.
  void reduce_unit(int u, bool async) {
    if (reduced_[static_cast<std::size_t>(u)]) return;
    reduced_[static_cast<std::size_t>(u)] = true;
    if (grads_live_[static_cast<std::size_t>(u)]) held_ -= plan::unit(u).size();  // counted when issued
    grads_live_[static_cast<std::size_t>(u)] = false;
    queue_.submit([this, u](ops_type& ops) {
      const FlatRange bs = plan::buckets_of(u);
      for (std::size_t i = bs.end; i-- > bs.begin;) reduce_bucket(ops, i);
      if constexpr (stage >= 2) ops.release_pages(unit_grads(u));  // the reduced gradient lives in the pieces now
    }, async);
  }

  // Backward is about to write unit u's gradients (for the transient count under ZeRO-2/3).
  // Only between begin_backward and end_backward: a split backward's input half (a pipeline's
  // I, outside them) reads parameters and writes no gradient; its weight half (W) does.
  void grads_in_use(int u) {
    if (stage < 2 || !in_backward_ || grads_live_[static_cast<std::size_t>(u)]) return;
    grads_live_[static_cast<std::size_t>(u)] = true;
    hold(plan::unit(u).size());
    model_.ops().commit_pages(unit_grads(u));  // backward writes them on the compute stream
  }

  // ---- ZeRO-3 parameters ------------------------------------------------------------------

  // The first and last units stay gathered for the whole step (a tied head reads wte at
  // both ends of the model).
  static constexpr bool outer(int u) { return u == 0 || u == plan::units - 1; }

  // All-gather bucket i into dst (flat-buffer offsets) from every rank's piece; `mine` is
  // this rank's (its owned elements, or the whole stored piece).
  void gather_bucket(ops_type& ops, std::size_t i, std::span<const T> mine, std::span<T> dst) {
    staging_.all_gather(ops, comm_, i, mine, dst);
  }

  // Starts gathering unit u (on the communication thread when async_). Returns whether it
  // did (false: u does not exist or is gathered already).
  bool gather_params(int u) {
    if (u < 0 || u >= plan::units || gathered_[static_cast<std::size_t>(u)]) return false;
    gathered_[static_cast<std::size_t>(u)] = true;
    hold(plan::unit(u).size());
    gather_ticket_[static_cast<std::size_t>(u)] = queue_.submit([this, u](ops_type& ops) {
      ops.commit_pages(unit_params(u));
      const FlatRange bs = plan::buckets_of(u);
      for (std::size_t i = bs.begin; i < bs.end; ++i) gather_bucket(ops, i, param_piece(i), model_.params());
    }, async_);
    return true;
  }

  void release_params(int u) {
    if (!gathered_[static_cast<std::size_t>(u)]) return;
    gathered_[static_cast<std::size_t>(u)] = false;
    model_.ops().release_pages(unit_params(u));  // after the kernels queued on it
    held_ -= plan::unit(u).size();
  }

  // Unit u is about to run: gather it, then prefetch `next`, the unit that runs after it (on
  // NCCL that gather overlaps u's compute). An outer unit used again (the tied head reads
  // unit 0 at the end of forward) prefetches nothing.
  void use_params(int u, int next) {
    if constexpr (stage == 3) {
      if (gather_params(u) || !outer(u)) gather_params(next);
      queue_.wait(gather_ticket_[static_cast<std::size_t>(u)]);
    }
  }
  void done_with_params(int u) {
    if constexpr (stage == 3)
      if (!outer(u)) release_params(u);
  }

  void hold(std::size_t elements) { peak_ = std::max(peak_, held_ += elements); }

  // ---- the optimizer step -------------------------------------------------------------------

  // The step of a model that holds every parameter of the run: its own norm, then update().
  double optimizer_step() { return update(opt_.hp.max_norm > 0 ? grad_sum_of_squares() : 0.0); }

  // Adds the squares of what this rank owns of bucket i, counting only the parts the model
  // says this rank counts (a tensor replicated over TP on TP rank 0 only).
  void add_sum_of_squares(ops_type& ops, std::size_t i) {
    const FlatRange o = owned(i);
    std::span<const T> g = owned_grads(i);
    for (const FlatRange& p : model_.norm_parts(o)) ops.add_sum_of_squares(g.data() + (p.begin - o.begin), p.size());
  }

  // Every unit's reductions after backward (apply_gradients).
  void reduce_all() {
    for (int u = plan::units - 1; u >= 0; --u) {
      reduced_[static_cast<std::size_t>(u)] = false;
      reduce_unit(u, false);
    }
    queue_.drain();  // on a device the reductions were queued on the communication side
  }
  template <class, class, std::size_t>
  friend class DataParallel;

  // The experts' own trainer: over the expert-data group; ZeRO only where that group has
  // more than one rank.
  struct no_experts {};
  template <class X>
  struct expert_trainer_of {
    using type = no_experts;
  };
  template <HasExperts X>
  struct expert_trainer_of<X> {
    using E = typename X::Experts;
    using type = DataParallel<E, std::conditional_t<(E::grad_group::size > 1), Policy, NoZeRO>, BucketBytes>;
  };
  using expert_trainer = typename expert_trainer_of<Model>::type;

  Model& model_;
  MeshComm<group> comm_;
  int rank_;
  int accum_;
  bool overlap_ = true;
  double last_clip_ = 1.0;
  double last_norm_ = 0;
  bool reducing_ = false;  // the current micro-batch's gradients are reduced
  bool in_backward_ = false;  // between begin_backward and end_backward
  bool async_ = false;     // this step's collectives run on the communication thread
  optimizer_type opt_;
  UnitHooks hooks_;
  UnitHookCheck hook_check_{stage == 3 ? plan::units : 0};  // ZeRO-3: the first micro-batch's hooks
  BucketStaging<plan, T, Device> staging_;  // ZeRO: one bucket's collectives
  buffer grad_pieces_;      // ZeRO-2/3: this rank's pieces of the reduced gradient
  buffer param_pieces_;     // ZeRO-3: this rank's pieces of the parameters
  std::vector<bool> reduced_, gathered_, grads_live_;  // per unit
  std::vector<std::uint64_t> gather_ticket_;           // per unit: its ZeRO-3 gather's ticket
  // Elements of gathered parameters and unreduced gradients, counted on the calling thread;
  // a unit's gradients count as given back when its reduction is issued.
  std::size_t held_ = 0, peak_ = 0;
  CommQueue<T, Device> queue_;  // the communication side; last, so it stops first
  std::unique_ptr<expert_trainer> experts_;  // a mixture of experts' (built after this one)
};

}  // namespace fived
