#pragma once
// Trainer: one mesh, one model, one optimizer policy, one schedule, every axis at once.
//
//   using mesh  = Mesh<DP<2>, PP<2>, CP<2>, TP<2>, EP<2>>;          // 16 ranks; EP a view of DP x CP
//   using model = GPT<cfg, mesh, float, Host, SequenceParallel>;     // the whole model, as the user names it
//   Trainer<model, ZeRO<1>, pipeline::OneFOneB<2, 4>> t(ctx, {.adamw = hp, .lr = WarmupCosine{...}}, GptInit{1});
//   double loss = t.step(step, tokens, targets, B, T);   // the global batch: 4 micro-batches of [B, T]
//
// Each rank builds what the mesh gives it: on a PP mesh its chunks of the model (the
// schedule's stages of it, cut by StageLayers: balanced by FLOPs, or equal for schedules with
// several chunks per rank), each split over TP, its sequences' zig-zag chunks under CP, its
// experts under EP; a DataParallel per chunk (the policy's ZeRO over DP x CP, the experts'
// own over the expert-data group); and the pipeline executor walking its row of the schedule.
// Without a pipeline the schedule is 1F1B on one stage, which is gradient accumulation over
// its M micro-batches: `Accumulate<M>`. So there is one step for every mesh: forward and
// backward as the schedule says, gradients reduced as the policy says, the clip over every
// parameter once (all axes), AdamW at the learning rate of the step (train/lr_schedule.hpp).
//
// evaluate() is a held-out loss on the same mesh: forwards only, through every stage, no
// serial copy of the weights gathered, nothing reduced or updated. fit() is the loop around step: batches from a sampler
// (train/token_data.hpp), a progress line every N steps (train/progress.hpp), a held-out
// loss every M, a callback after each step, and an end after any step when asked (a signal:
// train/stop_signal.hpp).
//
// The context must outlive the trainer (the executor holds its PP communicator). Recompute is
// the model's configuration's (nn/recompute.hpp).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/mesh/mesh_comm.hpp"
#include "fived/device/buffer.hpp"
#include "fived/mesh/context.hpp"
#include "fived/model/contract.hpp"
#include "fived/pipeline/executor.hpp"
#include "fived/pipeline/schedules.hpp"
#include "fived/pipeline/stage_layers.hpp"
#include "fived/train/checkpoint.hpp"
#include "fived/train/chunk_state.hpp"
#include "fived/train/data_parallel.hpp"
#include "fived/train/lr_schedule.hpp"
#include "fived/train/progress.hpp"
#include "fived/train/saver.hpp"
#include "fived/train/serial_state.hpp"
#include "fived/train/token_data.hpp"
#include "fived/util/one_writer.hpp"

namespace fived {

// No pipeline: M micro-batches of gradient accumulation, which is 1F1B on one stage.
template <int M = 1>
using Accumulate = pipeline::OneFOneB<1, M>;

// fit() stops at a step whose loss or gradient norm is not finite (nan or inf): its update may
// have made the weights non-finite, and a run that went on would save them over good
// checkpoints. With AdamWConfig::skip_non_finite a step whose norm is not finite changes
// nothing, and fit throws at the (FitOptions::max_skipped + 1)-th of them in a row
// (`skipped`: how many; the weights are then those before the first of them).
struct NonFiniteStep : std::runtime_error {
  NonFiniteStep(int s, double l, double n, int skipped_in_a_row = 0, bool skipping = false)
      : std::runtime_error(
            "fived::Trainer::fit: step " + std::to_string(s) + ": the loss is " + text(l) + " and the gradient norm " +
            text(n) +
            (skipped_in_a_row > 0
                 ? ", not both finite, at " + std::to_string(skipped_in_a_row) +
                       " steps in a row, each skipped (nothing updated): the weights are those after step " +
                       std::to_string(s - skipped_in_a_row) +
                       ". Look at the data of those steps, or resume from a checkpoint with a lower learning rate"
                 : std::string(", not both finite; stopped before anything was saved from this step (its update may "
                               "have made the weights non-finite). Resume from the last checkpoint, with a lower "
                               "learning rate or a gradient clip (AdamWConfig::max_norm)") +
                       (skipping ? "" : ", or skip such steps (AdamWConfig::skip_non_finite)"))),
        step(s), loss(l), grad_norm(n), skipped(skipped_in_a_row) {}
  int step;
  double loss, grad_norm;
  int skipped;

 private:
  static std::string text(double x) {  // "nan" whatever its sign bit
    if (std::isnan(x)) return "nan";
    char b[32];
    std::snprintf(b, sizeof b, "%g", x);
    return b;
  }
};

struct TrainerConfig {
  AdamWConfig adamw;  // its lr is replaced every step by lr(step)
  LrSchedule lr = WarmupCosine{};  // any callable double(int step): train/lr_schedule.hpp
  // From the third step on, replay the second as a graph (a CUDA graph on CUDA: the device
  // starts each kernel without waiting for the host to launch it; nn/step_graph.hpp), its
  // collectives over TP, CP, DP and PP included. With one model chunk per pipeline rank,
  // without experts or ZeRO-2/3; the batch's shape and the hyperparameters but the learning
  // rate fixed (a change captures again).
  bool step_graph = false;
};

template <class Model, class Policy = NoZeRO, class Schedule = Accumulate<1>, template <class> class Cost = FlopCost>
class Trainer {
  static_assert(check_model<Model>::ok, "fived::Trainer: the model does not satisfy the model contract (see above)");

 public:
  using mesh = typename Model::mesh;
  using value_type = typename Model::value_type;
  using device = typename Model::device;
  using init_type = typename Model::init_type;
  static constexpr pipeline::Shape shape = Schedule::table.shape;
  static constexpr int P = shape.ranks, V = shape.chunks, M = shape.micro_batches;
  static_assert(P == mesh::pp,
                "fived::Trainer: the schedule's pipeline ranks must equal the mesh's PP extent (use "
                "pipeline::OneFOneB<PP, M> or another schedule over PP ranks; Accumulate<M> when PP is 1)");
  // Schedules with several chunks per rank hand over at equal steps: equal parts.
  using cut = StageLayers<Model, P * V, Cost, (V > 1)>;
  // The model of pipeline stage s (the whole model without a pipeline).
  template <int s>
  using stage_model = std::conditional_t<P * V == 1, Model, typename Model::template part<typename cut::template part<s>>>;
  using serial_layout = typename Model::serial_layout;  // the whole model's, at TP 1
  using serial_expert_layout = typename checkpoint::expert_layout_of<Model>::type;

  template <Communicator C>
  Trainer(MeshContext<mesh, C>& ctx, const TrainerConfig& cfg, const init_type& init = {}) : cfg_(cfg) {
    const int pp = ctx.coord()[Axis::pp];
    [&]<std::size_t... r>(std::index_sequence<r...>) {
      ((pp == static_cast<int>(r) ? void(rank_ = std::make_unique<RankOf<static_cast<int>(r), C>>(ctx, cfg, init)) : void()),
       ...);
    }(std::make_index_sequence<P>{});
    world_rank_ = ctx.rank();
    world_ = std::make_unique<GroupCommOf<C>>(ctx.world());
    split_save_comm_ = [&ctx] {
      return std::make_unique<OwnedGroupComm<C>>(ctx.world().split(0, ctx.world().rank(), "checkpoint"));
    };
  }

  // One optimizer step at the learning rate of `step` (from 1) on the global batch: M
  // micro-batches of [B, T] ids, micro-batch k in rows [kB, (k+1)B), the same on every rank.
  // Returns the mean loss over the global batch, on every rank.
  double step(int step, std::span<const int> tokens, std::span<const int> targets, int B, int T) {
    lr_ = cfg_.lr(step);
    rank_->set_lr(lr_);
    const double loss = rank_->step(tokens, targets, B, T);
    norm_.reset();
    count_skipped();
    return loss;
  }
  // The same step in two halves, for a caller that looks at the gradient in between:
  // reduce() runs the forwards and backwards and reduces the gradients (the learning rate of
  // `step` is set for the update) and returns the mean loss; serial_grads() then gives the
  // reduced gradient in the serial layout; update() clips and steps AdamW.
  double reduce(int step, std::span<const int> tokens, std::span<const int> targets, int B, int T) {
    lr_ = cfg_.lr(step);
    rank_->set_lr(lr_);
    return rank_->reduce(tokens, targets, B, T);
  }
  void update() {
    rank_->update();
    norm_.reset();
    count_skipped();
  }
  // Whether the last step was skipped (AdamWConfig::skip_non_finite: its gradient norm was not
  // finite, so nothing was updated or counted).
  bool last_step_skipped() const { return last_skipped_; }

  // The mean loss of a global batch (M micro-batches of [B, T], as step() takes it) on the
  // current weights, on every rank: forwards only, on the mesh as it trains (no serial copy of
  // the weights gathered), no gradient made or reduced, nothing updated, and the model keeps
  // no training statistic (set_training, where it has one): the steps after are what they
  // would have been without it. Between steps, not between reduce() and update(). A step
  // graph is kept when B and T are the steps' (fit's held-out losses), else given up: the
  // next step runs plain, the one after captures again.
  double evaluate(std::span<const int> tokens, std::span<const int> targets, int B, int T) {
    return rank_->evaluate(tokens, targets, B, T);
  }
  // The mean over `batches` global batches of `data`, those it draws at steps 0, 1, ...
  // (held-out data: the same batches at every call).
  double evaluate(const BatchSampler& data, int batches, int B, int T) {
    if (batches < 1) throw std::invalid_argument("fived::Trainer::evaluate: needs at least one batch, got " +
                                                 std::to_string(batches));
    std::vector<int> tok, tgt;
    double sum = 0;
    for (int i = 0; i < batches; ++i) {
      data.fill(static_cast<std::uint64_t>(i), M, B, T, tok, tgt);
      sum += evaluate(tok, tgt, B, T);
    }
    return sum / batches;
  }
  // After reduce(), before update(): the gradient of the global batch's mean loss, reduced
  // over DP (and CP), gathered over TP and PP into serial_layout, on every rank (a
  // collective); a tied tensor's is the sum over the stages that hold it.
  std::vector<value_type> serial_grads() { return rank_->serial_grads(false); }
  // The same for the experts of a mixture of experts (serial_expert_layout): reduced over the
  // expert-data group, gathered over TP and EP as well.
  std::vector<value_type> serial_expert_grads() { return rank_->serial_grads(true); }

  // Starts from given weights: the whole dense model in serial_layout order (e.g. the serial
  // model's params()) and, for a mixture of experts, its experts in serial_expert_layout order,
  // with fresh optimizer state. Each rank keeps only its part. A collective.
  void load_serial(std::span<const value_type> dense, std::span<const value_type> experts = {}) {
    checkpoint::Restored<Model> start;
    start.start_from(dense, experts);
    rank_->load(start, 0);
  }
  // ... or from a file the model reads (Model::read_serial: for fived's decoders, Hugging
  // Face safetensors by their names).
  void load_weights(const std::filesystem::path& file)
    requires requires(const io::SafetensorsFile& f) { Model::read_serial(f); }
  {
    const auto w = Model::read_serial(io::SafetensorsFile::read(file));
    load_serial(w.dense, w.experts);
  }

  // The whole model's weights in one file of the model's format (Model::write_serial: Hugging
  // Face names and shapes, a mixture's experts included), from any mesh, ZeRO stage and
  // schedule: gathered into the serial layouts (serial_params, serial_expert_params) and written
  // by world rank 0 (a temporary file, then rename). A collective: every rank returns once the
  // file is complete, or throws when rank 0 could not write it.
  void save_weights(const std::filesystem::path& file, const std::map<std::string, std::string>& metadata = {})
    requires requires(std::span<const value_type> w) { Model::write_serial(file, w, w, metadata); }
  {
    const std::vector<value_type> dense = serial_params();
    std::vector<value_type> experts;
    if constexpr (serial_expert_layout::size > 0) experts = serial_expert_params();
    written_by_one(
        world_rank_ == 0,
        [&] { Model::write_serial(file, std::span<const value_type>(dense), std::span<const value_type>(experts), metadata); },
        [&](double x) { return max_over_world(x); },
        "Trainer::save_weights: world rank 0 could not write " + file.string() + " (its error says why)");
  }

  double lr() const { return lr_; }
  // The last update's global gradient norm, read back once (the step's skip check and fit's
  // line share the read).
  double grad_norm() const {
    if (!norm_) norm_ = rank_->grad_norm();
    return *norm_;
  }
  // Whether a captured step is kept to replay (TrainerConfig::step_graph: after the second
  // step of a shape).
  bool step_graph_captured() { return rank_->step_graph_captured(); }
  int world_rank() const { return world_rank_; }

  // The whole model in the serial layout (serial_layout), on every rank: each stage's part
  // gathered over TP (under ZeRO-3 over its data group, DP x CP, first, from the shards the
  // ranks keep between steps) and summed over PP. A collective, between steps.
  std::vector<value_type> serial_params() { return rank_->serial_params(false); }
  // The same for the experts of a mixture of experts (serial_expert_layout): gathered over TP
  // and EP as well (under ZeRO-3 over their expert-data group first).
  std::vector<value_type> serial_expert_params() { return rank_->serial_params(true); }

  // Bytes the library's buffers hold on this rank's device: the process's on CUDA (a rank per
  // process), the process's over the ranks that share it on the host backend (its threads).
  static std::size_t memory_in_use() {
    const int sharing = std::is_same_v<device, Host> ? std::max(1, host_ranks_in_process().load()) : 1;
    return buffer_bytes_held<device>() / static_cast<std::size_t>(sharing);
  }

  // ---- checkpoints (train/checkpoint.hpp) ------------------------------------------------

  struct SaveOptions {
    int keep_last = 0;                          // > 0: remove complete steps older than the newest N
    std::map<std::string, std::string> run{};   // what made the run, recorded in the manifest
  };
  // Saves the state after `step` under dir/step-<step>: each rank its share, then the
  // manifest (train/saver.hpp). A collective; returns when the checkpoint is committed. Then
  // world rank 0 removes what killed saves left (checkpoint::remove_leftovers) and, with
  // keep_last > 0, the complete steps older than the newest keep_last (checkpoint::keep_last).
  void save(const std::filesystem::path& dir, int step, const SaveOptions& options = {}) {
    saver_.save(rank_->shard(), record(dir, step, options), *world_);
  }
  // The same save written behind the training: the state is copied now (from a GPU into host
  // memory), and a thread writes the files and commits them over a communicator of its own
  // (split off the world at the first such save: a collective) while the next steps run. The
  // next save, load, wait_for_save() or the trainer's end waits for it. A collective call.
  void save_async(const std::filesystem::path& dir, int step, const SaveOptions& options = {}) {
    checkpoint::Shard shard = rank_->shard();
    saver_.wait();  // its communicator is free again
    if (!save_comm_) save_comm_ = split_save_comm_();
    saver_.start(std::move(shard), record(dir, step, options), *save_comm_);
  }
  // Waits for a save_async: returns its step (0 when none was pending); rethrows its error.
  int wait_for_save() { return saver_.wait(); }

  // Loads the checkpoint of `step` under dir, saved from this model on any mesh, ZeRO stage or
  // schedule: parameters and AdamW's state. Without a step, the newest that verifies (its
  // manifest, every file of its recorded size, and every tensor entry the ranks read of its
  // recorded hash); the newer ones passed over are added to `refused` (each with its reason),
  // and when none verifies the error lists them. A step asked for is refused outright when it
  // does not verify. Each rank reads the manifest (the step's index) and the entries that hold
  // its share (checkpoint::Restored), and every rank has loaded when this returns. Returns the
  // step it holds; training goes on at the next one. A collective.
  int load(const std::filesystem::path& dir, std::optional<int> step = std::nullopt,
           std::vector<checkpoint::Refusal>* refused = nullptr) {
    saver_.wait();
    return checkpoint::resume(dir, step, model_name(), refused,
                              [&](const std::filesystem::path& folder,
                                  const checkpoint::Manifest& m) -> std::optional<std::string> {
                                checkpoint::Restored<Model> restored(folder, m);
                                if (const std::optional<int> failed = read_share(restored)) return restored.failure(*failed);
                                rank_->load(restored, m.adam_step);
                                world_->barrier();
                                return std::nullopt;
                              });
  }

  struct FitOptions {
    int log_every = 10;
    double peak_flops = 0;          // one device's, for MFU (0: none)
    std::FILE* out = stdout;        // rank 0 prints; null: nothing
    std::FILE* metrics = nullptr;   // rank 0 writes a JSON line per step and evaluation (train/progress.hpp)
    // Every eval_every steps and after the last (0: never), evaluate(*held_out, eval_batches)
    // printed as a line of its own (not counted in the steps' seconds or tokens/s).
    const BatchSampler* held_out = nullptr;
    int eval_every = 0, eval_batches = 4;
    // Asked on every rank after each step (given on every rank or on none): once it is true on
    // any rank, every rank ends fit after that step, which is then logged and passed to
    // `after` as the last, not evaluated (a StopSignal's requested(): train/stop_signal.hpp).
    // The ranks agree by one host all-reduce a step.
    std::function<bool()> stop = nullptr;
    // With AdamWConfig::skip_non_finite: fit goes on past a skipped step (logged as skipped,
    // passed to `after`), and throws NonFiniteStep at the (max_skipped + 1)-th in a row.
    int max_skipped = 8;
  };
  // Steps [first, last] on batches drawn from `data`; after each step `after(step, loss)`, or
  // `after(step, loss, last)` where it takes a third argument: whether fit ends with this step
  // (the last, or a stop: the place to save). Returns the seconds spent in the steps. A step
  // whose loss or gradient norm is not finite is logged (a progress line and its metrics line,
  // its values null there) and throws NonFiniteStep on every rank, before `after` (which saves
  // checkpoints) sees it; under AdamWConfig::skip_non_finite one whose norm is not finite was
  // skipped (nothing changed), and fit goes on unless it is one more than max_skipped in a row.
  template <class After>
  double fit(const BatchSampler& data, int first, int last, int B, int T, const FitOptions& o, After&& after) {
    check_held_out(o, T);
    ProgressLog log(world_rank_ == 0 ? o.out : nullptr, mesh::size, Model::flops_per_token(T), o.peak_flops,
                    o.log_every, world_rank_ == 0 ? o.metrics : nullptr);
    log.header();
    std::vector<int> tok, tgt;
    double total = 0;
    int in_a_row = 0;  // skipped steps
    for (int s = first; s <= last; ++s) {
      data.fill(static_cast<std::uint64_t>(s), M, B, T, tok, tgt);
      const auto t0 = std::chrono::steady_clock::now();
      const double loss = step(s, tok, tgt, B, T);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      total += dt;
      const double norm = grad_norm();
      // The loss and the norm are the same on every rank (reduced over the mesh), so every rank
      // stops here alike, its line (the last) logged. A step skip_non_finite skipped changed
      // nothing: fit goes on, up to max_skipped of them in a row.
      const bool skipped = last_skipped_;
      in_a_row = skipped ? in_a_row + 1 : 0;
      const bool fails = skipped ? in_a_row > o.max_skipped : !(std::isfinite(loss) && std::isfinite(norm));
      const bool stopping = !fails && o.stop && any_rank(o.stop());
      const bool ends = s == last || stopping;
      log.add({s, loss, lr_, norm, dt, static_cast<double>(M) * B * T, skipped}, memory_in_use(), ends || fails);
      if (fails) throw NonFiniteStep(s, loss, norm, in_a_row, cfg_.adamw.skip_non_finite);
      // (Not at a stop: its checkpoint comes first, within a scheduler's grace period.)
      if (o.held_out != nullptr && o.eval_every > 0 && (s % o.eval_every == 0 || s == last))
        log.held_out(s, evaluate(*o.held_out, o.eval_batches, B, T), o.eval_batches);
      if constexpr (std::is_invocable_v<After&, int, double, bool>) after(s, loss, ends);
      else after(s, loss);
      if (stopping) break;
    }
    // On the host the ranks may be threads sharing one count of held bytes (memory_in_use):
    // none may leave and free its buffers before rank 0 has logged the last step.
    if constexpr (std::is_same_v<device, Host>) world_->barrier();
    return total;
  }

 private:
  static std::string model_name() { return Model::config_name(); }
  // After an update: with skip_non_finite, a norm that is not finite (the same on every rank:
  // the global one) means the kernels wrote nothing, and the optimizers forget the step. The
  // loss was read already, so the norm's read waits for nothing more.
  void count_skipped() {
    last_skipped_ = cfg_.adamw.skip_non_finite && !std::isfinite(grad_norm());
    if (last_skipped_) rank_->forget_skipped_step();
  }
  // The world's largest x (a collective).
  double max_over_world(double x) {
    world_->all_reduce_host(std::span<double>(&x, 1), ReduceOp::max);
    return x;
  }
  bool any_rank(bool mine) { return max_over_world(mine ? 1 : 0) > 0; }
  // fit's held-out settings, before its first step rather than at its first evaluation.
  static void check_held_out(const FitOptions& o, int T) {
    const std::string where = "fived::Trainer::fit: ";
    if (o.eval_every < 0) throw std::invalid_argument(where + "eval_every must be 0 (never) or more");
    if (o.eval_every > 0 && o.held_out == nullptr)
      throw std::invalid_argument(where + "eval_every " + std::to_string(o.eval_every) +
                                  " needs held_out: the sampler of the held-out data");
    if (o.eval_every == 0 && o.held_out != nullptr)
      throw std::invalid_argument(where + "held_out is given but eval_every is 0: set eval_every to evaluate every "
                                          "so many steps");
    if (o.held_out == nullptr) return;
    if (o.eval_batches < 1)
      throw std::invalid_argument(where + "eval_batches must be at least 1 (got " + std::to_string(o.eval_batches) + ")");
    if (!o.held_out->fits(T))
      throw std::invalid_argument(where + "the held-out part of " + o.held_out->data->name() + " has " +
                                  std::to_string(o.held_out->end - o.held_out->begin) +
                                  " tokens, fewer than a window of T + 1 = " + std::to_string(T + 1));
  }
  // Every rank reads its share of a step (Rank::want); the first failure of any, which all
  // ranks agree on (a collective), or none.
  std::optional<int> read_share(checkpoint::Restored<Model>& restored) {
    double worst = -std::numeric_limits<double>::infinity();  // minus the smallest failure code
    try {
      rank_->want(restored);
    } catch (const checkpoint::ReadFailure& f) {
      worst = -static_cast<double>(f.code());
    }
    worst = max_over_world(worst);
    if (std::isinf(worst)) return std::nullopt;
    return static_cast<int>(-worst);
  }
  checkpoint::SaveRecord record(const std::filesystem::path& dir, int step, const SaveOptions& o) const {
    return {dir, step, rank_->adam_step(), mesh::name(), model_name(), o.run, o.keep_last};
  }

  struct Rank {
    virtual ~Rank() = default;
    virtual double step(std::span<const int> tokens, std::span<const int> targets, int B, int T) = 0;
    virtual double reduce(std::span<const int> tokens, std::span<const int> targets, int B, int T) = 0;
    virtual void update() = 0;
    virtual double evaluate(std::span<const int> tokens, std::span<const int> targets, int B, int T) = 0;
    virtual std::vector<value_type> serial_grads(bool experts) = 0;
    virtual void set_lr(double lr) = 0;
    virtual double grad_norm() const = 0;
    virtual bool step_graph_captured() = 0;
    virtual std::vector<value_type> serial_params(bool experts) = 0;
    virtual checkpoint::Shard shard() = 0;  // this rank's state, copied out
    virtual void want(checkpoint::Restored<Model>& restored) = 0;  // reads what load() takes
    virtual void load(const checkpoint::Restored<Model>& restored, int adam_step) = 0;
    virtual int adam_step() const = 0;
    virtual void forget_skipped_step() = 0;
  };

  // Pipeline rank R: its chunks (stages shape.stage(R, c)), their trainers, the executor.
  template <int R, Communicator C>
  class RankOf final : public Rank {
    template <std::size_t c>
    using chunk = stage_model<shape.stage(R, static_cast<int>(c))>;
    template <class Seq>
    struct tuples;
    template <std::size_t... c>
    struct tuples<std::index_sequence<c...>> {
      using models = std::tuple<std::unique_ptr<chunk<c>>...>;
      using trainers = std::tuple<std::unique_ptr<DataParallel<chunk<c>, Policy>>...>;
      using executor = pipeline::Executor<std::tuple<chunk<c>&...>, std::tuple<DataParallel<chunk<c>, Policy>&...>, C>;
    };
    using chunks = std::make_index_sequence<V>;
    using types = tuples<chunks>;

    static_assert([]<std::size_t... c>(std::index_sequence<c...>) { return (ModelPart<chunk<c>> && ...); }(chunks{}),
                  "fived::Trainer: a pipeline part of the model does not satisfy ModelPart (model/contract.hpp, "
                  "docs/model.md): check its forward, backward, buffers and stage boundary");

   public:
    RankOf(MeshContext<mesh, C>& ctx, const TrainerConfig& cfg, const init_type& init)
        : pp_(ctx.template comm<typename mesh::pp_group>()),
          tp_(ctx.template comm<typename mesh::tp_group>()),
          ep_(ctx.template comm<typename mesh::expert_group>()),
          tp_rank_(mesh::tp_group::index(ctx.rank())),
          ep_rank_(mesh::expert_group::index(ctx.rank())) {
      [&]<std::size_t... c>(std::index_sequence<c...>) {
        ((std::get<c>(models_) = std::make_unique<chunk<c>>(ctx, init_under<Policy>(init))), ...);
        ((std::get<c>(trainers_) = std::make_unique<DataParallel<chunk<c>, Policy>>(*std::get<c>(models_), ctx, cfg.adamw, M)),
         ...);
        executor_.emplace(shape, R, programme(), ctx.template comm<Axis::pp>(), std::tie(*std::get<c>(models_)...),
                          std::tie(*std::get<c>(trainers_)...));
      }(chunks{});
      if (cfg.step_graph) {
        // Decided for the whole model, so every rank decides alike (a stage without experts
        // of a model with them refuses too).
        if constexpr (V == 1 && DataParallel<Model, Policy>::graph_step_allowed)
          std::get<0>(trainers_)->set_step_graph(true);
        else
          throw std::invalid_argument(
              std::string("fived::Trainer: TrainerConfig::step_graph replays a step as a graph with one model chunk "
                          "per pipeline rank, without dropless experts or ZeRO-2/3; ") +
              (V > 1 ? "this schedule has " + std::to_string(V) + " chunks per rank"
               : DataParallel<Model, Policy>::routing_waits ? std::string("this model's experts route dropless (pad_to_capacity pads them "
                                                    "to a static size)")
                                   : "this trainer has ZeRO<" + std::to_string(Policy::stage) + ">") +
              ": set step_graph = false");
      }
    }

    double step(std::span<const int> tokens, std::span<const int> targets, int B, int T) override {
      return executor_->step(tokens, targets, B, T);
    }
    double reduce(std::span<const int> tokens, std::span<const int> targets, int B, int T) override {
      return executor_->reduce(tokens, targets, B, T);
    }
    void update() override { executor_->update(); }
    double evaluate(std::span<const int> tokens, std::span<const int> targets, int B, int T) override {
      return executor_->evaluate(tokens, targets, B, T);
    }
    std::vector<value_type> serial_grads(bool experts) override {
      return gather_serial(experts, [](auto& trainer) { return trainer.reduced_grads(); });
    }
    void set_lr(double lr) override {
      [&]<std::size_t... c>(std::index_sequence<c...>) { ((std::get<c>(trainers_)->optimizer().hp.lr = lr), ...); }(chunks{});
    }
    double grad_norm() const override { return std::get<0>(trainers_)->grad_norm(); }
    bool step_graph_captured() override { return std::get<0>(models_)->ops().step_graph_captured(); }

    std::vector<value_type> serial_params(bool experts) override {
      return gather_serial(experts, [](auto& trainer) { return trainer.full_params(); });
    }

    // What each chunk's trainer holds whole (values: its full_params or reduced_grads) in the
    // serial layout, on every rank: assembled over TP, then summed over EP (each expert is on
    // one EP rank) and PP (each element is on one stage, zeros elsewhere). A collective.
    template <class Values>
    std::vector<value_type> gather_serial(bool experts, Values values) {
      std::vector<double> whole(experts ? serial_expert_layout::size : serial_layout::size, 0.0);
      [&]<std::size_t... c>(std::index_sequence<c...>) {
        (add_serial<serial_layout, serial_expert_layout>(*std::get<c>(trainers_), experts, whole, tp_, tp_rank_,
                                                         ep_rank_, values),
         ...);
      }(chunks{});
      if (experts) ep_.all_reduce_host(std::span<double>(whole));
      pp_.all_reduce_host(std::span<double>(whole));
      std::vector<value_type> out(whole.size());
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<value_type>(whole[i]);
      return out;
    }

    int adam_step() const override { return std::get<0>(trainers_)->optimizer_steps(); }
    void forget_skipped_step() override {
      [&]<std::size_t... c>(std::index_sequence<c...>) { (std::get<c>(trainers_)->forget_skipped_step(), ...); }(chunks{});
    }

    checkpoint::Shard shard() override {
      checkpoint::Shard w;
      [&]<std::size_t... c>(std::index_sequence<c...>) {
        (checkpoint::add_chunk<Model>(*std::get<c>(models_), *std::get<c>(trainers_), w), ...);
      }(chunks{});
      w.add_metadata("tp", std::to_string(mesh::tp)), w.add_metadata("ep", std::to_string(mesh::ep));
      w.add_metadata("tp_rank", std::to_string(tp_rank_)), w.add_metadata("ep_rank", std::to_string(ep_rank_));
      return w;
    }

    void want(checkpoint::Restored<Model>& restored) override {
      [&]<std::size_t... c>(std::index_sequence<c...>) {
        (checkpoint::want_chunk(*std::get<c>(trainers_), restored, tp_rank_, ep_rank_), ...);
      }(chunks{});
    }

    void load(const checkpoint::Restored<Model>& restored, int adam_step) override {
      [&]<std::size_t... c>(std::index_sequence<c...>) {
        (checkpoint::load_chunk(*std::get<c>(models_), *std::get<c>(trainers_), restored, adam_step, tp_rank_, ep_rank_),
         ...);
      }(chunks{});
    }

   private:
    static std::vector<pipeline::Action> programme() {
      const auto p = Schedule::table.program(R);
      return {p.begin(), p.end()};
    }
    MeshComm<typename mesh::pp_group> pp_;
    MeshComm<typename mesh::tp_group> tp_;
    MeshComm<typename mesh::expert_group> ep_;
    int tp_rank_ = 0, ep_rank_ = 0;
    typename types::models models_;
    typename types::trainers trainers_;
    std::optional<typename types::executor> executor_;
  };

  TrainerConfig cfg_;
  std::unique_ptr<Rank> rank_;
  std::unique_ptr<GroupComm> world_;
  double lr_ = 0;
  bool last_skipped_ = false;
  mutable std::optional<double> norm_;  // grad_norm(), once read after an update
  int world_rank_ = 0;
  // save_async's communicator (a split of the world, made at its first call) and the saver,
  // last: destroyed first, it waits for a background save before the rest goes.
  std::function<std::unique_ptr<GroupComm>()> split_save_comm_;
  std::unique_ptr<GroupComm> save_comm_;
  checkpoint::Saver saver_;
};

}  // namespace fived
