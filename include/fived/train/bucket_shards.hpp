#pragma once
// ZeRO's shards of one pair of flat buffers (a model's parameters and gradients, or its
// experts') and the collectives that move them over the gradient group, bucket by bucket:
// the reductions (all-reduce, or reduce-scatter into this rank's pieces), ZeRO-3's gathers of
// each unit before it runs and its release after, and the count of what a step holds at
// once. The training step on top (hooks, clip, AdamW) is train/bucket_trainer.hpp.
//
// Buckets (train/bucket_plan.hpp) never cross a unit of the layout; each is reduced on its
// own, through one padded staging buffer under ZeRO (train/bucket_staging.hpp), where each
// rank owns one equal piece of every bucket. A unit's reductions and gathers run on the
// communication side (a thread on the host, a second stream on CUDA: train/comm_queue.hpp)
// when `async`; the results are the same bit for bit. Under ZeRO-2/3 the model's pages of a
// unit are given back once it is reduced or has run (Ops::release_pages) and taken back
// before the next write (commit_pages).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/comm/types.hpp"
#include "fived/device/bf16.hpp"
#include "fived/mesh/mesh_comm.hpp"
#include "fived/model/unit_hooks.hpp"
#include "fived/optim/flat_range.hpp"
#include "fived/train/bucket_plan.hpp"
#include "fived/train/bucket_staging.hpp"
#include "fived/train/comm_queue.hpp"
#include "fived/train/replica_check.hpp"
#include "fived/train/zero_policy.hpp"
#if defined(__CUDACC__)
#include "fived/train/cuda_comm_queue.hpp"  // CommQueue<T, Cuda>
#endif

namespace fived {

template <class Model, class Policy, std::size_t BucketBytes>
class BucketShards {
 protected:
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

  // Lambdas on the communication side point at this object.
  BucketShards(const BucketShards&) = delete;
  BucketShards& operator=(const BucketShards&) = delete;
  // A step graph the model's Ops keep (nn/step_graph.hpp) holds this trainer's collectives and
  // its communication side's work: it goes with the trainer, and the model's next step is plain.
  ~BucketShards() {
    if constexpr (requires { model_.ops().abandon_graph_step(); }) model_.ops().abandon_graph_step();
  }

  int rank() const { return rank_; }
  int accum() const { return accum_; }
  // The gradient group's communicator (DP x CP, or the expert-data group).
  MeshComm<group>& grad_comm() { return comm_; }
  // Sums device memory the compute stream wrote over the gradient group, in stream order: on
  // the communication side, where the group's collectives run, the compute stream waiting for
  // it (a step's gradient norm, its experts' loads).
  template <class X>
  void sum_over_group(std::span<X> x) {
    queue_.submit([this, x](ops_type&) { comm_.all_reduce(x); }, false);
    queue_.drain();
  }

  // ---- what this rank holds of the buffers (checkpoints: train/trainer_state.hpp) ------------

  Model& model() { return model_; }
  // What this rank's optimizer owns of bucket i: the whole bucket without ZeRO, else its piece.
  FlatRange owned(std::size_t i) const { return owned_by(i, rank_); }
  // This rank's stored piece of bucket i's parameters (ZeRO-3; its owned elements first).
  std::span<T> param_piece(std::size_t i) { return piece_of(param_pieces_, i); }
  // The bucket holding flat range r.
  static std::size_t bucket_of(FlatRange r) {
    for (std::size_t i = 0; i < plan::count; ++i)
      if (plan::bucket(i).range.contains(r)) return i;
    throw std::invalid_argument("fived::DataParallel: range [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                ") is not inside one bucket");
  }

  // Every unit's reductions, after a backward run without begin_backward (apply_gradients).
  void reduce_all() {
    for (int u = plan::units - 1; u >= 0; --u) {
      reduced_[static_cast<std::size_t>(u)] = false;
      reduce_unit(u, false);
    }
    queue_.drain();  // on a device the reductions were queued on the communication side
  }

 protected:
  // comm: this rank's communicator of the gradient group, rank its index there; accum:
  // micro-batches per step. Writes a deferred model's initial values (GptInit::deferred), checks
  // that the replicas start equal, then cuts the shards.
  BucketShards(Model& model, MeshComm<group> comm, int rank, int accum)
      : model_(model), comm_(std::move(comm)), rank_(rank), accum_(accum), queue_(model.ops(), group::size > 1) {
    if (accum < 1)
      throw std::invalid_argument("fived::DataParallel: accum (micro-batches per step) must be at least 1, got " +
                                  std::to_string(accum));
    comm_.order_after(queue_.ops());  // the group's collectives run on the communication side
    auto make = [&](std::size_t n) { return model_.ops().template make_buffer<T>(n); };
    if constexpr (stage >= 1) staging_ = BucketStaging<plan, T, Device>(model_.ops());
    if constexpr (stage >= 2) grad_pieces_ = make(plan::shard_total);
    if constexpr (stage == 3) param_pieces_ = make(plan::shard_total);
    reduced_.assign(plan::units, false);
    gathered_.assign(plan::units, false);
    gather_ticket_.assign(plan::units, 0);
    grads_live_.assign(plan::units, false);
    const bool deferred = init_deferred();
    if (deferred) write_initial_params();
    check_replicas_agree(deferred);
    shard_state(deferred);
  }

  // A model (or experts' view) made with GptInit{.deferred = true}: nothing written yet.
  bool init_deferred() const {
    if constexpr (requires { model_.init_deferred(); }) return model_.init_deferred();
    else return false;
  }
  // Its initial values, written where this rank keeps them and computed for those elements
  // alone, a bucket at a time (host staging of one bucket): under ZeRO-3 its owned pieces
  // (never the whole buffer), else every bucket.
  void write_initial_params() {
    if constexpr (requires { model_.initial_params(FlatRange{}); }) {
      for (std::size_t i = 0; i < plan::count; ++i) {
        const FlatRange r = stage == 3 ? owned(i) : plan::bucket(i).range;
        const std::vector<T> v = model_.initial_params(r);
        model_.ops().upload(stage == 3 ? param_piece(i).data() : model_.params().data() + r.begin, v.data(), v.size());
      }
      model_.init_done();
    }
  }

  // The ranks compare a hash of their first weights; a deferred model's, of the initial
  // values of its first bucket (under ZeRO-3 no rank holds the weights whole).
  void check_replicas_agree(bool deferred) {
    if constexpr (DP > 1 && requires { model_.params_to_host(); }) {
      std::vector<T> p;
      if constexpr (requires { model_.initial_params(FlatRange{}); })
        if (deferred) p = model_.initial_params(plan::bucket(0).range);
      if (!deferred) p = model_.params_to_host();
      check_replicas_agree_over(comm_, std::span<const T>(p));
    }
  }

  void shard_state(bool deferred) {
    ops_type& ops = model_.ops();
    if constexpr (stage == 3) {  // the pieces are the parameters from now on (a deferred model's: written)
      if (!deferred)
        for (std::size_t i = 0; i < plan::count; ++i)
          ops.copy(param_piece(i).data(), model_.params().data() + owned(i).begin, owned(i).size());
      ops.release_pages(model_.params());
    }
    if constexpr (stage >= 2) {
      ops.release_pages(model_.grads());
      ops.trim_pages();  // the device holds what a step holds at once, no more
    }
  }

  // What rank r's optimizer owns of bucket i.
  static FlatRange owned_by(std::size_t i, int r) { return stage == 0 ? plan::bucket(i).range : plan::owned(i, r); }
  // What this rank's optimizer owns, and where: its parameters in owned_param_store(), its
  // gradients in owned_grad_store() (AdamW updates them all in one launch).
  std::vector<OwnedRange> owned_places() {
    std::vector<OwnedRange> v;
    const T* params = owned_param_store().data();
    const T* grads = owned_grad_store().data();
    for (std::size_t i = 0; i < plan::count; ++i)
      if (!owned(i).empty())
        v.push_back({owned(i), static_cast<std::size_t>(owned_params(i).data() - params),
                     static_cast<std::size_t>(owned_grads(i).data() - grads)});
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
  // Where every owned_grads(i) lies: the model's gradient buffer, or (ZeRO-2/3) this rank's pieces.
  std::span<T> owned_grad_store() {
    if constexpr (stage >= 2) return grad_pieces_.span();
    else return model_.grads();
  }
  // Where every owned_params(i) lies: the model's parameter buffer, or (ZeRO-3) this rank's pieces.
  std::span<T> owned_param_store() {
    if constexpr (stage == 3) return param_pieces_.span();
    else return model_.params();
  }
  static constexpr bool overlaps(FlatRange a, FlatRange b) { return a.begin < b.end && b.begin < a.end; }
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

  Model& model_;
  MeshComm<group> comm_;
  int rank_;
  int accum_;
  bool reducing_ = false;     // the current micro-batch's gradients are reduced
  bool in_backward_ = false;  // between begin_backward and end_backward
  bool async_ = false;        // this step's collectives run on the communication thread
  BucketStaging<plan, T, Device> staging_;  // ZeRO: one bucket's collectives
  buffer grad_pieces_;                      // ZeRO-2/3: this rank's pieces of the reduced gradient
  buffer param_pieces_;                     // ZeRO-3: this rank's pieces of the parameters
  std::vector<bool> reduced_, gathered_, grads_live_;  // per unit
  std::vector<std::uint64_t> gather_ticket_;           // per unit: its ZeRO-3 gather's ticket
  // Elements of gathered parameters and unreduced gradients, counted on the calling thread;
  // a unit's gradients count as given back when its reduction is issued.
  std::size_t held_ = 0, peak_ = 0;
  CommQueue<T, Device> queue_;  // the communication side; last, so it stops first
};

}  // namespace fived
