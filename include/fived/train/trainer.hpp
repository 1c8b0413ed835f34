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
// fit() is the loop around it: batches from a sampler (train/token_data.hpp), a progress
// line every N steps (train/progress.hpp), a callback for evaluation.
//
// The context must outlive the trainer (the executor holds its PP communicator). Recompute is
// the model's configuration's (nn/recompute.hpp).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
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

#include "fived/comm/group_comm.hpp"
#include "fived/device/buffer.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/pipeline/executor.hpp"
#include "fived/pipeline/schedules.hpp"
#include "fived/pipeline/stage_layers.hpp"
#include "fived/train/checkpoint.hpp"
#include "fived/train/data_parallel.hpp"
#include "fived/train/lr_schedule.hpp"
#include "fived/train/progress.hpp"
#include "fived/train/token_data.hpp"

namespace fived {

// No pipeline: M micro-batches of gradient accumulation, which is 1F1B on one stage.
template <int M = 1>
using Accumulate = pipeline::OneFOneB<1, M>;

struct TrainerConfig {
  AdamWConfig adamw;  // its lr is replaced every step by lr(step)
  WarmupCosine lr;
};

// The model's FLOPs per token of a training step (forward and backward), the MFU numerator:
// 6 per parameter a token meets (the experts it is routed to, not all) and 12·L·C·T for
// attention's two T-long products (no causal discount, as PaLM and llm.c count).
template <class Cfg>
constexpr double flops_per_token(int T) {
  using dims = gpt_dims<Cfg>;
  double params = static_cast<double>(ParamTable<GptSpecs<Cfg>, 1>::num_parameters);
  if constexpr (ExpertSpecs<Cfg>::moe_blocks > 0)
    params += static_cast<double>(ParamTable<ExpertSpecs<Cfg>, 1, 1>::num_parameters) * dims::top_k / dims::experts;
  return 6.0 * params + 12.0 * dims::layers * dims::d_model * static_cast<double>(T);
}

namespace trainer_detail {
// What a GPT type names, read without instantiating it (GPT<cfg, mesh with PP> whole is only a
// name here: each rank instantiates its parts).
template <class Model>
struct gpt_args;
template <class Cfg, MeshType M, class T, class D, class SP, class P>
struct gpt_args<GPT<Cfg, M, T, D, SP, P>> {
  using config = Cfg;
  using mesh = M;
  using value_type = T;
  using device = D;
  template <class Part>
  using with_part = GPT<Cfg, M, T, D, SP, Part>;
};
}  // namespace trainer_detail

template <class Model, class Policy = NoZeRO, class Schedule = Accumulate<1>, template <class> class Cost = FlopCost>
class Trainer {
 public:
  using args = trainer_detail::gpt_args<Model>;
  using mesh = typename args::mesh;
  using config = typename args::config;
  using value_type = typename args::value_type;
  using device = typename args::device;
  static constexpr pipeline::Shape shape = Schedule::table.shape;
  static constexpr int P = shape.ranks, V = shape.chunks, M = shape.micro_batches;
  static_assert(P == mesh::pp,
                "fived::Trainer: the schedule's pipeline ranks must equal the mesh's PP extent (use "
                "pipeline::OneFOneB<PP, M> or another schedule over PP ranks; Accumulate<M> when PP is 1)");
  // Schedules with several chunks per rank hand over at equal steps: equal parts.
  using cut = StageLayers<config, P * V, Cost, (V > 1)>;
  // The model of pipeline stage s (the whole model without a pipeline).
  template <int s>
  using stage_model =
      std::conditional_t<P * V == 1, Model, typename args::template with_part<typename cut::template part<s>>>;
  using serial_layout = ParamTable<GptSpecs<config>, 1>;  // the whole model's, at TP 1
  using serial_expert_layout = ParamTable<ExpertSpecs<config>, 1, 1>;

  template <Communicator C>
  Trainer(MeshContext<mesh, C>& ctx, const TrainerConfig& cfg, const GptInit& init = {}) : cfg_(cfg) {
    const int pp = ctx.coord()[Axis::pp];
    [&]<std::size_t... r>(std::index_sequence<r...>) {
      ((pp == static_cast<int>(r) ? void(rank_ = std::make_unique<RankOf<static_cast<int>(r), C>>(ctx, cfg, init)) : void()),
       ...);
    }(std::make_index_sequence<P>{});
    world_rank_ = ctx.rank();
    world_ = std::make_unique<GroupCommOf<C>>(ctx.world());
  }

  // One optimizer step at the learning rate of `step` (from 1) on the global batch: M
  // micro-batches of [B, T] ids, micro-batch k in rows [kB, (k+1)B), the same on every rank.
  // Returns the mean loss over the global batch, on every rank.
  double step(int step, std::span<const int> tokens, std::span<const int> targets, int B, int T) {
    lr_ = cfg_.lr(step);
    rank_->set_lr(static_cast<float>(lr_));
    return rank_->step(tokens, targets, B, T);
  }
  double lr() const { return lr_; }
  double grad_norm() const { return rank_->grad_norm(); }
  int world_rank() const { return world_rank_; }

  // The whole model in the serial layout (serial_layout), on every rank: each stage's part
  // gathered over TP (under ZeRO-3 over DP first) and summed over PP. A collective.
  std::vector<value_type> serial_params() { return rank_->serial_params(false); }
  // The same for the experts of a mixture of experts (serial_expert_layout): gathered over TP
  // and EP as well.
  std::vector<value_type> serial_expert_params() { return rank_->serial_params(true); }

  // Bytes the library's buffers hold on this rank's device: the process's on CUDA (a rank per
  // process), the process's over the ranks on the host backend (the ranks are its threads).
  static std::size_t memory_in_use() { return buffer_bytes_held<device>() / (std::is_same_v<device, Host> ? mesh::size : 1); }

  // ---- checkpoints (train/checkpoint.hpp) ------------------------------------------------

  // Saves the state after `step` under dir/step-<step>: each rank its share, then the
  // manifest. A collective; returns when the checkpoint is committed.
  void save(const std::filesystem::path& dir, int step) {
    const std::filesystem::path folder = checkpoint::step_folder(dir, step);
    std::filesystem::create_directories(folder);
    const std::filesystem::path mine = folder / checkpoint::rank_file(world_rank_);
    rank_->write_shard(mine);
    // every file's size and hash to rank 0 (as doubles: 32-bit halves, summed over the world)
    const std::uint64_t h = checkpoint::file_hash(mine), n = std::filesystem::file_size(mine);
    std::vector<double> all(3 * static_cast<std::size_t>(mesh::size), 0.0);
    all[3 * static_cast<std::size_t>(world_rank_)] = static_cast<double>(h >> 32);
    all[3 * static_cast<std::size_t>(world_rank_) + 1] = static_cast<double>(h & 0xffffffffu);
    all[3 * static_cast<std::size_t>(world_rank_) + 2] = static_cast<double>(n);
    world_->all_reduce_host(std::span<double>(all), ReduceOp::sum);  // also: every file is written
    if (world_rank_ == 0) {
      checkpoint::Manifest m{step, rank_->adam_step(), mesh::size, mesh::name(), model_name(), {}};
      for (int r = 0; r < mesh::size; ++r) {
        const auto at = 3 * static_cast<std::size_t>(r);
        m.files.push_back({checkpoint::rank_file(r), static_cast<std::uint64_t>(all[at + 2]),
                           static_cast<std::uint64_t>(all[at]) << 32 | static_cast<std::uint64_t>(all[at + 1])});
      }
      checkpoint::write_manifest(folder, m);
    }
    world_->barrier();
  }

  // Loads the checkpoint of `step` under dir (the latest complete one when not given), saved
  // from this model on any mesh, ZeRO stage or schedule: parameters and AdamW's state. Every
  // rank reads every file (resharding assembles whole tensors in host memory). Returns the
  // step it holds; training goes on at the next one.
  int load(const std::filesystem::path& dir, std::optional<int> step = std::nullopt) {
    if (!step) step = checkpoint::latest_step(dir);
    if (!step) throw io::SafetensorsError(dir.string() + ": holds no complete checkpoint (no step-*/manifest.json)");
    const std::filesystem::path folder = checkpoint::step_folder(dir, *step);
    const checkpoint::Manifest m = checkpoint::read_manifest(folder);
    if (m.model != model_name())
      throw io::SafetensorsError((folder / "manifest.json").string() + ": a checkpoint of " + m.model +
                                 ", not of this model (" + model_name() + ")");
    Loaded loaded;
    for (const checkpoint::FileEntry& f : m.files) gather(io::SafetensorsFile::read(folder / f.name), loaded);
    rank_->load(loaded, m.adam_step);
    return m.step;
  }

  struct FitOptions {
    int log_every = 10;
    double peak_flops = 0;          // one device's, for MFU (0: none)
    std::FILE* out = stdout;        // rank 0 prints; null: nothing
  };
  // Steps [first, last] on batches drawn from `data`; after each step `after(step, loss)`.
  // Returns the seconds spent in the steps.
  template <class After>
  double fit(const BatchSampler& data, int first, int last, int B, int T, const FitOptions& o, After&& after) {
    ProgressLog log(world_rank_ == 0 ? o.out : nullptr, mesh::size, flops_per_token<config>(T), o.peak_flops,
                    o.log_every);
    log.header();
    std::vector<int> tok, tgt;
    double total = 0;
    for (int s = first; s <= last; ++s) {
      data.fill(static_cast<std::uint64_t>(s), M, B, T, tok, tgt);
      const auto t0 = std::chrono::steady_clock::now();
      const double loss = step(s, tok, tgt, B, T);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      total += dt;
      log.add({s, loss, lr_, grad_norm(), dt, static_cast<double>(M) * B * T}, memory_in_use(), s == last);
      after(s, loss);
    }
    return total;
  }

 private:
  // One kind of state for the whole model, in the serial layouts (the dense buffer, then the
  // experts'), and which elements a checkpoint gave; and the MoE blocks' selection biases.
  struct Whole {
    std::vector<double> values;
    std::vector<bool> given;
  };
  struct Loaded {
    std::map<std::string, Whole> state;        // per kind of state
    std::map<int, std::vector<float>> bias;    // per MoE block of the model, in order
  };
  static constexpr std::size_t whole_size = serial_layout::size + serial_expert_layout::size;
  // Where a tensor starts in a Whole, by name (dense or expert), with its whole spec.
  static std::optional<std::pair<std::size_t, const ParamInfo*>> whole_tensor(std::string_view name) {
    if (const auto i = serial_layout::find(name))
      return std::pair{serial_layout::tensors[static_cast<std::size_t>(*i)].offset, &serial_layout::tensors[static_cast<std::size_t>(*i)]};
    if (const auto i = serial_expert_layout::find(name))
      return std::pair{serial_layout::size + serial_expert_layout::tensors[static_cast<std::size_t>(*i)].offset,
                       &serial_expert_layout::tensors[static_cast<std::size_t>(*i)]};
    return std::nullopt;
  }
  // The MoE blocks before layer `first` (the first of a part's is the model's next).
  static constexpr int moe_blocks_before(int first) {
    int n = 0;
    for (int l = 0; l < first; ++l) n += gpt_dims<config>::is_moe(l) ? 1 : 0;
    return n;
  }
  static std::string model_name() { return GPT<config>::describe(); }
  // Scatters every entry of a rank's file ("<kind>/<tensor>/<first element of its piece>")
  // to its whole tensors, through the piece's placement in the file's metadata.
  static void gather(const io::SafetensorsFile& f, Loaded& loaded) {
    auto meta = [&](const char* key) {
      const auto it = f.metadata().find(key);
      if (it == f.metadata().end()) throw io::SafetensorsError(f.source() + ": lacks the metadata \"" + key + "\"");
      try {
        return std::stoi(it->second);
      } catch (const std::exception&) {
        throw io::SafetensorsError(f.source() + ": metadata \"" + key + "\" is not a number");
      }
    };
    const int tp = meta("tp"), tp_rank = meta("tp_rank"), ep = meta("ep"), ep_rank = meta("ep_rank");
    if (tp < 1 || ep < 1 || tp_rank < 0 || tp_rank >= tp || ep_rank < 0 || ep_rank >= ep)
      throw io::SafetensorsError(f.source() + ": its placement (tp " + std::to_string(tp_rank) + " of " +
                                 std::to_string(tp) + ", ep " + std::to_string(ep_rank) + " of " + std::to_string(ep) +
                                 ") is not one");
    for (const io::TensorEntry& e : f.tensors()) {
      const std::size_t a = e.name.find('/'), b = e.name.rfind('/');
      const std::string kind = e.name.substr(0, a == std::string::npos ? 0 : a);
      const std::string tensor = a == std::string::npos || a == b ? std::string() : e.name.substr(a + 1, b - a - 1);
      if (kind == "router_bias") {  // "router_bias/<MoE block>/0"
        int block = -1;
        try {
          block = std::stoi(tensor);
        } catch (const std::exception&) {
        }
        if (block < 0 || block >= ExpertSpecs<config>::moe_blocks || e.numel() != static_cast<std::size_t>(gpt_dims<config>::experts))
          throw io::SafetensorsError(f.source() + ": entry '" + e.name + "' is no MoE block's selection bias of this model");
        std::vector<float>& v = loaded.bias[block];
        v.resize(e.numel());
        f.read_into(e, std::span<float>(v));
        continue;
      }
      const auto where = whole_tensor(tensor);
      if (!where) throw io::SafetensorsError(f.source() + ": entry '" + e.name + "' names no tensor of this model");
      const auto [base, t] = *where;
      const std::int64_t piece = piece_extent(t->spec, 0, tp, ep) * piece_extent(t->spec, 1, tp, ep);
      std::int64_t first = -1;
      try {
        first = std::stoll(e.name.substr(b + 1));
      } catch (const std::exception&) {
      }
      if (first < 0 || e.shape.size() != 1 || first + e.shape[0] > piece)
        throw io::SafetensorsError(f.source() + ": entry '" + e.name + "' does not fit the tensor's piece of " +
                                   std::to_string(piece) + " elements");
      std::vector<double> v(e.numel());
      f.read_into(e, std::span<double>(v));
      Whole& w = loaded.state[kind];
      if (w.values.empty()) w.values.assign(whole_size, 0.0), w.given.assign(whole_size, false);
      for (std::size_t k = 0; k < v.size(); ++k) {
        const auto at = base + static_cast<std::size_t>(whole_index(t->spec, tp, ep, tp_rank, ep_rank, first + static_cast<std::int64_t>(k)));
        w.values[at] = v[k];
        w.given[at] = true;
      }
    }
  }

  struct Rank {
    virtual ~Rank() = default;
    virtual double step(std::span<const int> tokens, std::span<const int> targets, int B, int T) = 0;
    virtual void set_lr(float lr) = 0;
    virtual double grad_norm() const = 0;
    virtual std::vector<value_type> serial_params(bool experts) = 0;
    virtual void write_shard(const std::filesystem::path& file) = 0;
    virtual void load(const Loaded& loaded, int adam_step) = 0;
    virtual int adam_step() const = 0;
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

   public:
    RankOf(MeshContext<mesh, C>& ctx, const TrainerConfig& cfg, const GptInit& init)
        : pp_(ctx.template comm<typename mesh::pp_group>()),
          tp_(ctx.template comm<typename mesh::tp_group>()),
          ep_(ctx.template comm<typename mesh::expert_group>()),
          tp_rank_(mesh::tp_group::index(ctx.rank())),
          ep_rank_(mesh::expert_group::index(ctx.rank())) {
      [&]<std::size_t... c>(std::index_sequence<c...>) {
        ((std::get<c>(models_) = std::make_unique<chunk<c>>(ctx, init)), ...);
        ((std::get<c>(trainers_) = std::make_unique<DataParallel<chunk<c>, Policy>>(*std::get<c>(models_), ctx, cfg.adamw, M)),
         ...);
        executor_.emplace(shape, R, programme(), ctx.template comm<Axis::pp>(), std::tie(*std::get<c>(models_)...),
                          std::tie(*std::get<c>(trainers_)...));
      }(chunks{});
    }

    double step(std::span<const int> tokens, std::span<const int> targets, int B, int T) override {
      return executor_->step(tokens, targets, B, T);
    }
    void set_lr(float lr) override {
      [&]<std::size_t... c>(std::index_sequence<c...>) { ((std::get<c>(trainers_)->optimizer().hp.lr = lr), ...); }(chunks{});
    }
    double grad_norm() const override { return std::get<0>(trainers_)->grad_norm(); }

    std::vector<value_type> serial_params(bool experts) override {
      std::vector<double> whole(experts ? serial_expert_layout::size : serial_layout::size, 0.0);
      [&]<std::size_t... c>(std::index_sequence<c...>) {
        (add_part(*std::get<c>(models_), *std::get<c>(trainers_), experts, whole), ...);
      }(chunks{});
      // Each element is on one stage (and, for experts, one EP and TP rank), zeros elsewhere.
      if (experts) tp_.all_reduce_host(std::span<double>(whole)), ep_.all_reduce_host(std::span<double>(whole));
      pp_.all_reduce_host(std::span<double>(whole));
      std::vector<value_type> out(whole.size());
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<value_type>(whole[i]);
      return out;
    }

    int adam_step() const override { return std::get<0>(trainers_)->optimizer_steps(); }

    void write_shard(const std::filesystem::path& file) override {
      io::SafetensorsWriter w;
      std::vector<std::vector<value_type>> params;  // the writer keeps views: the values live here
      std::vector<std::vector<float>> states;
      [&]<std::size_t... c>(std::index_sequence<c...>) {
        (add_chunk(*std::get<c>(models_), *std::get<c>(trainers_), w, params, states), ...);
      }(chunks{});
      w.add_metadata("tp", std::to_string(mesh::tp)), w.add_metadata("ep", std::to_string(mesh::ep));
      w.add_metadata("tp_rank", std::to_string(tp_rank_)), w.add_metadata("ep_rank", std::to_string(ep_rank_));
      w.write(file);
    }

    void load(const Loaded& loaded, int adam_step) override {
      [&]<std::size_t... c>(std::index_sequence<c...>) {
        (load_model_chunk(*std::get<c>(models_), *std::get<c>(trainers_), loaded, adam_step), ...);
      }(chunks{});
    }

   private:
    using State = TrainState;
    static constexpr const char* kind_name(State k) {
      return k == State::params ? "params" : k == State::master ? "master" : k == State::exp_avg ? "exp_avg" : "exp_avg_sq";
    }

    // A chunk's dense state, its experts' and its MoE blocks' selection biases.
    template <class Part, class D>
    void add_chunk(Part& part, D& dp, io::SafetensorsWriter& w, std::vector<std::vector<value_type>>& params,
                   std::vector<std::vector<float>>& states) {
      add_shard(dp, w, params, states);
      if constexpr (Part::has_experts) {
        add_shard(dp.experts(), w, params, states);
        if constexpr (config::balancing::bias)
          for (int m = 0; m < Part::moe_blocks; ++m) {
            const std::span<const float> b = part.router_bias(m);
            auto& x = states.emplace_back(b.begin(), b.end());
            w.add("router_bias/" + std::to_string(moe_blocks_before(Part::first_layer) + m) + "/0",
                  {static_cast<std::int64_t>(x.size())}, std::span<const float>(x));
          }
      }
    }
    template <class Part, class D>
    void load_model_chunk(Part& part, D& dp, const Loaded& loaded, int adam_step) {
      load_chunk(dp, loaded.state, adam_step);
      if constexpr (Part::has_experts) {
        load_chunk(dp.experts(), loaded.state, adam_step);
        if constexpr (config::balancing::bias)
          for (int m = 0; m < Part::moe_blocks; ++m) {
            const auto it = loaded.bias.find(moe_blocks_before(Part::first_layer) + m);
            if (it == loaded.bias.end())
              throw io::SafetensorsError("the checkpoint holds no selection bias for MoE block " +
                                         std::to_string(moe_blocks_before(Part::first_layer) + m));
            part.set_router_bias(m, it->second);
          }
      }
    }

    template <class D>
    void add_shard(D& dp, io::SafetensorsWriter& w, std::vector<std::vector<value_type>>& params,
                   std::vector<std::vector<float>>& states) {
      using L = typename D::layout;
      std::vector<State> kinds{State::params, State::exp_avg, State::exp_avg_sq};
      if constexpr (D::optimizer_type::has_master) kinds.push_back(State::master);
      for (const FlatRange& r : dp.save_ranges())
        for (State k : kinds) {
          const std::vector<double> v = dp.save_state(k, r);
          for (const ParamInfo& t : L::tensors) {
            const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
            if (b >= e) continue;
            const std::string name = std::string(kind_name(k)) + "/" + t.name() + "/" + std::to_string(b - t.offset);
            const auto from = v.begin() + static_cast<std::ptrdiff_t>(b - r.begin), to = from + static_cast<std::ptrdiff_t>(e - b);
            if (k == State::params) {
              auto& x = params.emplace_back(e - b);
              std::transform(from, to, x.begin(), [](double d) { return static_cast<value_type>(static_cast<acc_t<value_type>>(d)); });
              w.add(name, {static_cast<std::int64_t>(e - b)}, std::span<const value_type>(x));
            } else {
              auto& x = states.emplace_back(e - b);
              std::transform(from, to, x.begin(), [](double d) { return static_cast<float>(d); });
              w.add(name, {static_cast<std::int64_t>(e - b)}, std::span<const float>(x));
            }
          }
        }
    }

    template <class D>
    void load_chunk(D& dp, const std::map<std::string, Whole>& whole, int adam_step) {
      using L = typename D::layout;
      auto fetch = [&](State k, FlatRange r) {
        // a bf16 model's masters, from a checkpoint without them: its parameters
        const char* kind = k == State::master && !whole.count("master") ? "params" : kind_name(k);
        const auto it = whole.find(kind);
        if (it == whole.end()) throw io::SafetensorsError(std::string("the checkpoint holds no \"") + kind + "\" state");
        std::vector<double> out(r.size());
        for (int i = 0; i < L::count; ++i) {
          const ParamInfo& t = L::tensors[static_cast<std::size_t>(i)];
          const std::size_t b = std::max(t.offset, r.begin), e = std::min(t.end(), r.end);
          if (b >= e) continue;
          const std::size_t base = whole_tensor(t.name())->first;
          for (std::size_t j = b; j < e; ++j) {
            const std::size_t at = base + static_cast<std::size_t>(L::global_index(i, tp_rank_, static_cast<std::int64_t>(j - t.offset), ep_rank_));
            if (!it->second.given[at])
              throw io::SafetensorsError("the checkpoint lacks element " + std::to_string(at - base) + " of " + t.name() +
                                         " (" + kind + "): a rank's file is missing");
            out[j - r.begin] = it->second.values[at];
          }
        }
        return out;
      };
      dp.load_state(fetch, adam_step);
    }

    static std::vector<pipeline::Action> programme() {
      const auto p = Schedule::table.program(R);
      return {p.begin(), p.end()};
    }
    // Adds a part's tensors, in its serial layout, to the whole model's at their names.
    template <class From, class To>
    static void put(std::span<const value_type> part, std::vector<double>& whole) {
      for (const ParamInfo& t : From::tensors) {
        const ParamInfo& to = To::tensors[static_cast<std::size_t>(*To::find(t.name()))];
        for (std::size_t i = 0; i < t.size(); ++i) whole[to.offset + i] += static_cast<double>(part[t.offset + i]);
      }
    }
    template <class Part, class D>
    void add_part(Part& part, D& dp, bool experts, std::vector<double>& whole) {
      if (!experts) {
        if constexpr (Policy::stage == 3) {  // the pieces gathered over DP into the model's buffer first
          const std::vector<value_type> full = dp.full_params();
          part.ops().upload(part.params().data(), full.data(), full.size());
        }
        const std::vector<value_type> p = part.gather_params();  // the part whole over TP
        put<typename Part::serial_layout, serial_layout>(p, whole);
      } else if constexpr (Part::has_experts) {  // this rank's piece in place, the other pieces zero
        using EL = typename Part::expert_layout;
        std::vector<value_type> pieces(EL::size * static_cast<std::size_t>(mesh::ep * mesh::tp)), mine(EL::serial::size);
        const std::vector<value_type> own = part.expert_params_to_host();
        std::copy(own.begin(), own.end(),
                  pieces.begin() + static_cast<std::ptrdiff_t>(EL::size * static_cast<std::size_t>(part.ep_rank() * mesh::tp + part.tp_rank())));
        EL::assemble(std::span<const value_type>(pieces), std::span<value_type>(mine));
        put<typename EL::serial, serial_expert_layout>(mine, whole);
      }
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
  int world_rank_ = 0;
};

}  // namespace fived
