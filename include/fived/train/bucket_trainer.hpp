#pragma once
// The training step of one pair of flat buffers (a model's parameters and gradients, or its
// experts') over their gradient group, on their shards (train/bucket_shards.hpp): the hooks
// the model calls per unit, the step in pieces (begin_step .. update), the clip to the global
// norm and one AdamW step on what this rank owns, and what the step holds (memory()).
// DataParallel (train/data_parallel.hpp) is one of these for a model's dense buffers, with a
// second one for a mixture of experts' experts, and the step loop over them.
//
// Buffers: a model, or a view of its experts (Model::Experts), with ops(), params(), grads(),
// zero_grad(), norm_parts(r), sum_over_tp(std::span<double>), params_to_host(), a layout
// (nn/param_table.hpp) and a gradient group (grad_group, or the mesh's DP x CP).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/comm/types.hpp"
#include "fived/device/buffer.hpp"
#include "fived/kernels/host/norm.hpp"
#include "fived/mesh/context.hpp"
#include "fived/model/unit_hooks.hpp"
#include "fived/optim/adamw.hpp"
#include "fived/train/bucket_shards.hpp"
#include "fived/train/unit_hook_check.hpp"

namespace fived {

template <class Model, class Policy, std::size_t BucketBytes>
class BucketTrainer : public BucketShards<Model, Policy, BucketBytes> {
  using Shards = BucketShards<Model, Policy, BucketBytes>;
  using typename Shards::group;
  using Shards::DP, Shards::model_, Shards::comm_, Shards::rank_, Shards::queue_, Shards::staging_,
      Shards::grad_pieces_, Shards::reduced_, Shards::reducing_, Shards::in_backward_, Shards::async_,
      Shards::held_, Shards::peak_, Shards::owned_places, Shards::owned_grads, Shards::owned_params,
      Shards::gathered, Shards::gather_bucket, Shards::overlaps, Shards::reduce_unit, Shards::grads_in_use,
      Shards::use_params, Shards::done_with_params, Shards::release_params;

 public:
  // (The shards' names this class reads, public as they are there: a dependent base's names
  // are not found unqualified.)
  using typename Shards::T, typename Shards::ops_type, typename Shards::buffer, typename Shards::layout,
      typename Shards::plan;
  using Shards::stage, Shards::has_hooks, Shards::owned, Shards::param_piece;
  using optimizer_type = AdamWFor<Model>;

  // One replica: a mesh whose gradient group has one rank. accum: micro-batches per step.
  BucketTrainer(Model& model, const AdamWConfig& config, int accum = 1) requires(DP == 1)
      : BucketTrainer(model, MeshComm<group>(), 0, config, accum) {}
  // ctx: this rank's MeshContext; the gradient group's communicator is taken from it.
  template <Communicator Comm>
  BucketTrainer(Model& model, MeshContext<typename Model::mesh, Comm>& ctx, const AdamWConfig& config, int accum = 1)
      : BucketTrainer(model, MeshComm<group>(ctx.template comm<group>()), group::index(ctx.rank()), config, accum) {}
  // grad_comm: this rank's communicator of the mesh's gradient group, given directly.
  template <Communicator Comm>
  BucketTrainer(Model& model, Comm& grad_comm, const AdamWConfig& config, int accum = 1)
      : BucketTrainer(model, MeshComm<group>(grad_comm), grad_comm.rank(), config, accum) {}

  // ---- the step in pieces, for a caller that runs the micro-batches itself (a pipeline
  // executor, whose forwards and backwards interleave):
  //   begin_step();
  //   per micro-batch: model.forward(..., hooks()); ... begin_backward(last); model.backward(hooks()); end_backward();
  //   end_micro_batches();
  //   add_grad_sum_of_squares(total);   // total: one double of device memory, zeroed; then
  //                                     // whatever else holds parameters adds theirs (other
  //                                     // pipeline stages: an all-reduce over PP)
  //   update(total);

  // Zeroes the gradients (or, under ZeRO-2/3, the gradient pieces).
  void begin_step() {
    queue_.begin_step();  // a step that did not end (a refused graph step) leaves nothing pending
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
    reducing_ = stage >= 2 || last;
    in_backward_ = true;
    std::fill(reduced_.begin(), reduced_.end(), false);
  }
  // After it: waits for what backward handed over, and reduces what it did not.
  void end_backward() {
    in_backward_ = false;
    if constexpr (stage == 3) hook_check_.check([](int u) { return plan::unit(u); });
    queue_.drain();
    if (reducing_) {
      for (int u = plan::units - 1; u >= 0; --u) reduce_unit(u, false);
      queue_.drain();
    }
  }
  // After the step's last backward (ZeRO-3: the units still gathered are given back).
  void end_micro_batches() {
    if constexpr (stage == 3)
      for (int u = 0; u < plan::units; ++u) release_params(u);
  }
  // Adds this replica's part of the squared global gradient norm to *total (one double of
  // device memory), every parameter counted once over TP and the DP group: its owned
  // gradients' squares in one sum over fixed chunks (norm_chunks_, cut once), summed over TP
  // (the model's sum_over_tp) and, under ZeRO, the group, all in device memory in the
  // order of the model's kernels. The host waits for nothing.
  void add_grad_sum_of_squares(double* total) {
    ops_type& ops = model_.ops();
    ops.sum_of_squares_chunks(norm_.data(), norm_partials_.data(), this->owned_grad_store().data(),
                              norm_chunks_.data(), norm_chunks_.size());
    model_.sum_over_tp(norm_.span());
    if constexpr (stage >= 1) this->sum_over_group(norm_.span());  // NoZeRO: every replica has the same sum
    ops.add_scalar(total, norm_.data());
  }
  // Clips to the global norm sqrt(*total_sum_of_squares) (when max_norm is set: the factor is
  // computed by AdamW's kernels from the total in device memory) and takes one AdamW step on
  // what this rank owns, in one pass (the gradients in the buffer stay as reduced), then
  // (NoZeRO aside) the new parameters to every replica: all-gathered now under ZeRO-1/2, at
  // their next use under ZeRO-3. The total must stay there until grad_norm() is read.
  void update(const double* total_sum_of_squares) {
    ops_type& ops = model_.ops();
    last_total_ = total_sum_of_squares;
    opt_.begin_step(total_sum_of_squares);  // AdamW multiplies each gradient by the clip factor as it reads it
    opt_.update(ops, this->owned_param_store(), this->owned_grad_store());  // every owned piece, one launch
    if constexpr (stage == 1 || stage == 2) {
      queue_.submit([this](ops_type& side) {
        for (std::size_t i = 0; i < plan::count; ++i) gather_bucket(side, i, owned_params(i), model_.params());
      }, false);
      queue_.drain();  // the next forward reads them
    }
  }

  // ---- whole buffers, in host memory (checks, tests) ----------------------------------------

  // The whole parameter buffer (layout::size elements), in host memory. Under ZeRO<3> an
  // all-gather of every bucket, so every DP rank must call it; otherwise a copy of the
  // model's parameters.
  std::vector<T> full_params() {
    if constexpr (stage < 3) return model_.params_to_host();
    else return gathered([this](std::size_t i) { return std::span<const T>(param_piece(i)); });
  }

  // The gradient after the step's reduction and before its update (between end_micro_batches
  // and update): the whole layout's, averaged over the group and scaled as reduce_bucket
  // scales it (1/accum, the model's grad_scale), before the clip factor (AdamW applies that
  // as it reads them), in host memory, the same on every rank of the group. Under ZeRO each
  // rank holds only its pieces reduced, so this all-gathers them (a collective over the group).
  std::vector<T> reduced_grads() {
    if constexpr (stage == 0) return model_.ops().to_host(std::span<const T>(model_.grads()));
    else return gathered([this](std::size_t i) { return std::span<const T>(owned_grads(i)); });
  }

  // What this rank holds of the reduced gradient of flat range r, in place in device memory
  // (between end_micro_batches and update, as reduced_grads): the owned part of each bucket
  // that overlaps r, in flat order. A tied tensor's gradient (pipeline/tied_grads.hpp) is
  // added into them: its buckets are cut alike on each stage that holds it.
  std::vector<std::span<T>> owned_reduced_grads(FlatRange r) {
    std::vector<std::span<T>> pieces;
    for (std::size_t i = 0; i < plan::count; ++i) {
      const FlatRange o = owned(i);
      const std::size_t b = std::max(o.begin, r.begin), e = std::min(o.end, r.end);
      if (b < e) pieces.push_back(owned_grads(i).subspan(b - o.begin, e - b));
    }
    return pieces;
  }

  // Bytes this rank holds for training state between steps (train/data_parallel.hpp).
  struct Memory {
    std::size_t params = 0, grads = 0, optimizer = 0, staging = 0;
    std::size_t transient_peak = 0;  // ZeRO-2/3: whole units held during the last step
    std::size_t total() const { return params + grads + optimizer + staging; }
    Memory& operator+=(const Memory& o) {
      params += o.params, grads += o.grads, optimizer += o.optimizer, staging += o.staging;
      transient_peak += o.transient_peak;
      return *this;
    }
  };
  Memory memory() const {
    const std::size_t t = sizeof(T);
    return {(stage < 3 ? layout::size : plan::shard_total) * t, (stage < 2 ? layout::size : plan::shard_total) * t,
            opt_.state_bytes(), staging_.elements() * t, stage >= 2 ? peak_ * t : 0};
  }

  // Reduce each unit's buckets during backward, as soon as the model has finished it (on by
  // default; needs a model that calls UnitHooks). Off: every reduction runs after backward.
  // The results are the same bit for bit; what changes is when the collectives are issued.
  void set_overlap(bool on) { overlap_ = on; }
  bool overlap() const { return has_hooks && overlap_; }

  // The mean of a value over the data-parallel group (a loss), on every rank of it.
  double average(double v) { return comm_.all_reduce_host(v, ReduceOp::avg); }

  int optimizer_steps() const { return opt_.step_count(); }
  // The clip factor of the last step (1: not clipped). Reads the norm back (waits for the device).
  double last_clip() const { return last_total_ != nullptr ? opt_.clip_factor(last_sum_of_squares()) : 1.0; }
  // The global gradient norm of the last update, before clipping (every axis counted). Reads
  // it back (waits for the device): for progress lines, after the step.
  double grad_norm() const { return last_total_ != nullptr ? std::sqrt(last_sum_of_squares()) : 0.0; }
  optimizer_type& optimizer() { return opt_; }
  const optimizer_type& optimizer() const { return opt_; }
  // The last update wrote nothing (AdamWConfig::skip_non_finite, its norm not finite, as
  // grad_norm() read it): it is not counted.
  void forget_skipped_step() { opt_.forget_skipped_step(); }

 private:
  BucketTrainer(Model& model, MeshComm<group> comm, int rank, const AdamWConfig& config, int accum)
      : Shards(model, std::move(comm), rank, accum), opt_(config, owned_places()) {
    const std::vector<SquaresChunk> chunks = cut_norm_chunks();
    norm_chunks_ = Buffer<SquaresChunk, typename Model::device>(chunks.size());
    norm_partials_ = Buffer<double, typename Model::device>(chunks.size());
    model_.ops().upload(norm_chunks_.data(), chunks.data(), chunks.size());
    hooks_.before_forward = [this](int u) {
      hook_check_.saw(u, UnitHookCheck::before_forward);
      use_params(u, u + 1);
    };
    hooks_.after_forward = [this](int u) {
      hook_check_.saw(u, UnitHookCheck::after_forward);
      done_with_params(u);
    };
    hooks_.before_backward = [this](int u) {
      hook_check_.saw(u, UnitHookCheck::before_backward);
      grads_in_use(u);
      use_params(u, u - 1);
    };
    hooks_.after_backward = [this](int u) {
      hook_check_.saw(u, UnitHookCheck::after_backward);
      if (async_ && reducing_) reduce_unit(u, true);
      done_with_params(u);
    };
    // A split backward's halves (model/unit_hooks.hpp): I reads parameters, W writes gradients.
    hooks_.after_input_grad = [this](int u) { done_with_params(u); };
    hooks_.before_weight_grad = [this](int u) { grads_in_use(u); };
  }

  // The chunks of the gradient norm, offsets in owned_grad_store(): what this rank owns of
  // every bucket, only the parts the model says this rank counts (a tensor replicated over TP
  // on TP rank 0 only), cut to SquaresChunk::max_elements.
  std::vector<SquaresChunk> cut_norm_chunks() {
    std::vector<SquaresChunk> chunks;
    for (const OwnedRange& o : owned_places()) {  // o.range's first gradient at o.grad_at
      const auto at = [&](std::size_t flat) { return o.grad_at + (flat - o.range.begin); };
      for (const FlatRange& p : model_.norm_parts(o.range))
        for (std::size_t c = p.begin; c < p.end; c += SquaresChunk::max_elements)
          chunks.push_back({at(c), at(std::min(p.end, c + SquaresChunk::max_elements))});
    }
    return chunks;
  }
  double last_sum_of_squares() const {
    return model_.ops().to_host(std::span<const double>(last_total_, 1))[0];
  }

  bool overlap_ = true;
  const double* last_total_ = nullptr;  // the last update's squared norm (device memory)
  optimizer_type opt_;
  UnitHooks hooks_;
  UnitHookCheck hook_check_{stage == 3 ? plan::units : 0};  // ZeRO-3: the first micro-batch's hooks
  Buffer<SquaresChunk, typename Model::device> norm_chunks_;  // cut_norm_chunks(), in device memory
  Buffer<double, typename Model::device> norm_partials_;      // a sum per chunk
  Buffer<double, typename Model::device> norm_{1};            // this pair's part of the squared norm
};

}  // namespace fived
