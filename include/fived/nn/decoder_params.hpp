#pragma once
// What a Decoder holds between steps: this rank's parameters and gradients (one flat buffer
// each, laid out by the parameter table, nn/param_table.hpp; a second pair for a mixture of
// experts' experts), the TP, CP and EP communicators they are bound to, the experts' balance,
// and the ways in and out of them: views by name, gathers over TP, the clip norm's parts,
// initialisation, and Hugging Face files. The passes over them are nn/decoder.hpp.
//
// Every buffer is made releasable (Ops::make_buffer(n, releasable_pages)): a trainer that
// shards the state over data parallelism (ZeRO-2/3) gives the pages of what it does not hold
// back to the device between uses (device/cuda_pages.hpp).

#include <array>
#include <cstddef>
#include <filesystem>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/io/safetensors.hpp"
#include "fived/mesh/context.hpp"
#include "fived/mesh/mesh_comm.hpp"
#include "fived/nn/checkpoint.hpp"
#include "fived/nn/decoder_facts.hpp"
#include "fived/nn/expert_balance.hpp"
#include "fived/nn/sp_partial_grads.hpp"
#include "fived/nn/tensor_view.hpp"
#include "fived/util/one_writer.hpp"

namespace fived {

template <class Arch, MeshType M, class T, class Device, class SP, class Part>
class DecoderParams : public DecoderFacts<Arch, M, T, Device, SP, Part> {
  using Facts = DecoderFacts<Arch, M, T, Device, SP, Part>;

 public:
  // (The facts this class reads, named here because a dependent base's names are not found
  // unqualified; the same names, public as they are there.)
  using typename Facts::ops_type, typename Facts::layout, typename Facts::expert_layout,
      typename Facts::serial_layout, typename Facts::serial_expert_layout, typename Facts::config;
  using Facts::tp, Facts::ep, Facts::has_experts, Facts::on_host, Facts::num_params, Facts::moe_blocks,
      Facts::describe;

  DecoderParams(const DecoderParams&) = delete;  // a bound communicator, device buffers and pointers into them
  DecoderParams& operator=(const DecoderParams&) = delete;

  ops_type& ops() { return ops_; }
  const ops_type& ops() const { return ops_; }
  int tp_rank() const { return comm_.rank(); }

  // ---- parameters and gradients (this rank's pieces; device memory on Cuda) ----------------

  std::span<T> params() { return params_.span(); }
  std::span<const T> params() const { return params_.span(); }
  std::span<T> grads() { return grads_.span(); }
  std::span<const T> grads() const { return grads_.span(); }
  TensorView<T> param(std::string_view name) { return view(params_, index_of(name)); }
  TensorView<T> grad(std::string_view name) { return view(grads_, index_of(name)); }
  TensorView<const T> param(std::string_view name) const { return view(params_, index_of(name)); }
  TensorView<const T> grad(std::string_view name) const { return view(grads_, index_of(name)); }

  void zero_grad() {
    ops_.zero(grads_);
    if constexpr (has_experts) ops_.zero(expert_grads_);
  }
  std::vector<T> params_to_host() const { return ops_.to_host(params_.span()); }
  std::vector<T> grads_to_host() const { return ops_.to_host(grads_.span()); }

  // The whole model's buffers in the serial layout, on every TP rank (an all-gather over TP).
  std::vector<T> gather_params() { return gather(params_); }
  std::vector<T> gather_grads() { return gather(grads_); }

  // The clip norm, every parameter counted once over TP: the parts of r (flat offsets)
  // this rank counts, and a sum over the TP group of values in device memory, in the order
  // of the model's kernels (nothing to sum at TP 1).
  std::vector<FlatRange> norm_parts(FlatRange r) const { return layout::norm_parts(r, tp_rank()); }
  void sum_over_tp(std::span<double> s) { comm_.all_reduce(s); }

  // ---- initial values, when GptInit::deferred leaves them to the trainer ----------------------

  // Whether the parameters wait for their trainer to write them (GptInit{.deferred = true}).
  bool init_deferred() const { return init_.deferred && !init_written_; }
  // The initial values of this rank's parameters [r), computed for those elements alone:
  // the values a model made without deferred holds there.
  std::vector<T> initial_params(FlatRange r) const { return initial<layout>(r, 0); }
  // The trainer has written them where this rank keeps them.
  void init_done() { init_written_ = true; }

  // ---- a mixture of experts ------------------------------------------------------------------

  // The expert buffers as a trainer sees a model (train/data_parallel.hpp drives them beside
  // the dense ones): reduced over the expert-data group and scaled by 1/EP, because each
  // expert's gradient sums the mean losses of the EP ranks whose tokens it took; the clip
  // norm sums over TP (each parameter once) and over EP (different experts).
  class Experts {
   public:
    using mesh = M;
    using value_type = T;
    using device = Device;
    using ops_type = typename Facts::ops_type;
    using layout = expert_layout;
    using grad_group = typename M::expert_data_group;
    static constexpr double grad_scale = 1.0 / ep;
    static constexpr bool calls_hooks = true;  // the model's forward and backward call them for it

    explicit Experts(DecoderParams& m) : m_(m) {}
    ops_type& ops() { return m_.ops_; }
    std::span<T> params() { return m_.expert_params_.span(); }
    std::span<T> grads() { return m_.expert_grads_.span(); }
    void zero_grad() { m_.ops_.zero(m_.expert_grads_); }
    std::vector<T> params_to_host() const { return m_.ops_.to_host(std::span<const T>(m_.expert_params_.span())); }
    std::vector<FlatRange> norm_parts(FlatRange r) const { return layout::norm_parts(r, m_.tp_rank()); }
    void sum_over_tp(std::span<double> s) { m_.comm_.all_reduce(s), m_.ep_comm_.all_reduce(s); }
    bool init_deferred() const { return m_.init_.deferred && !m_.experts_init_written_; }
    std::vector<T> initial_params(FlatRange r) const { return m_.template initial<layout>(r, m_.ep_rank_); }
    void init_done() { m_.experts_init_written_ = true; }

   private:
    DecoderParams& m_;
  };
  Experts& experts() requires(has_experts) { return experts_view_; }
  int ep_rank() const { return ep_rank_; }

  // This rank's expert buffers (its E/EP experts, its TP slice of them: expert_layout); device
  // memory on Cuda, *_to_host() copies.
  std::span<T> expert_params() requires(has_experts) { return expert_params_.span(); }
  std::span<T> expert_grads() requires(has_experts) { return expert_grads_.span(); }
  std::vector<T> expert_params_to_host() const requires(has_experts) {
    return ops_.to_host(std::span<const T>(expert_params_.span()));
  }
  std::vector<T> expert_grads_to_host() const requires(has_experts) {
    return ops_.to_host(std::span<const T>(expert_grads_.span()));
  }

  // After an optimizer step, in its stream order (DataParallel::update calls it, summing over
  // its gradient group, DP x CP: every rank that routes tokens): the rows each expert took in
  // the step's training forwards, summed by sum_over_group(std::span<stat_t>) in device memory,
  // become expert_loads(); with AuxLossFreeBias each MoE block's selection bias moves by
  // bias_update_rate * sign(mean load - load) there, unless *skip_if_non_finite (the step's
  // squared gradient norm in device memory, when AdamWConfig::skip_non_finite) is not finite.
  // Nothing is read back; nothing without experts.
  template <class SumOverGroup>
  void balance_experts(SumOverGroup&& sum_over_group, const double* skip_if_non_finite = nullptr) {
    if constexpr (has_experts) balance_.step(sum_over_group, ops_, skip_if_non_finite);
  }
  // Rows per expert in the last balanced step, [MoE block][expert] (empty before the first);
  // read back from the device.
  std::vector<double> expert_loads() const { return balance_.last_loads(ops_); }
  // The selection bias of the part's m-th MoE block (AuxLossFreeBias), [expert], read back.
  std::vector<float> router_bias(int m) const { return balance_.bias(m, ops_); }
  // Sets it (a resumed run's, or a test's skewed router); the same on every rank of a replica.
  void set_router_bias(int m, std::span<const float> bias) requires(config::balancing::bias) {
    balance_.set_bias(m, bias, ops_, std::string(Arch::name) + "::set_router_bias");
  }

  // ---- safetensors, with Hugging Face names and shapes ----------------------------------------

  // The whole model's file (nn/checkpoint.hpp), experts included: gathered over TP, written by
  // TP rank 0 (atomic: a temporary file, then rename); every rank returns once the file is
  // complete.
  void save(const std::filesystem::path& path, const std::map<std::string, std::string>& metadata = {}) {
    if constexpr (has_experts && (tp > 1 || ep > 1))
      throw std::logic_error(std::string(Arch::name) +
                             "::save: a mixture of experts split over TP or EP is saved by its Trainer, which gathers "
                             "the experts (Trainer::save_weights), or as a sharded checkpoint (Trainer::save)");
    if constexpr (tp == 1) {
      ops_.read_to_host(params_, [&](std::span<const T> p) {
        ops_.read_to_host(expert_params_, [&](std::span<const T> e) { write_serial(path, p, e, metadata); });
      });
    } else {
      const std::vector<T> all = gather_params();
      written_by_one(
          tp_rank() == 0, [&] { write_serial(path, std::span<const T>(all), {}, metadata); },
          [&](double x) { return comm_.all_reduce_host(x, ReduceOp::max); },
          std::string(Arch::name) + "::save: TP rank 0 could not write " + path.string() + " (its error says why)");
    }
  }
  // The file of weights given in serial_layout and serial_expert_layout (the model contract's
  // way out: Trainer::save_weights).
  static void write_serial(const std::filesystem::path& path, std::span<const T> dense, std::span<const T> experts,
                           const std::map<std::string, std::string>& metadata = {}) {
    save_weights<serial_layout, serial_expert_layout>(path, dense, experts, metadata);
  }

  // Reads Hugging Face weights (any floating dtype, names with or without "transformer.") and
  // keeps this rank's piece, its experts' included. A missing, mis-shaped or unknown tensor is
  // an io::SafetensorsError naming it, and the model is left unchanged.
  void load(const std::filesystem::path& path) { load(io::SafetensorsFile::read(path)); }
  void load(const io::SafetensorsFile& f) {
    const SerialWeights<T> w = read_serial(f);
    ops_.write_from_host(params_, [&](std::span<T> p) { layout::slice(std::span<const T>(w.dense), p, tp_rank()); });
    if constexpr (has_experts)
      ops_.write_from_host(expert_params_, [&](std::span<T> p) {
        expert_layout::slice(std::span<const T>(w.experts), p, tp_rank(), ep_rank_);
      });
  }

  // The part's tensors of a Hugging Face file, in serial_layout and serial_expert_layout (the
  // model contract's way in for given weights: Trainer::load_weights).
  static SerialWeights<T> read_serial(const io::SafetensorsFile& f) {
    SerialWeights<T> w{std::vector<T>(serial_layout::size), std::vector<T>(serial_expert_layout::size)};
    load_weights<serial_layout, serial_expert_layout>(f, std::span<T>(w.dense), std::span<T>(w.experts), describe());
    return w;
  }

 protected:
  using typename Facts::ep_comm_type;
  using Facts::index_of;

  // Bound to this rank's communicators and initialised as the serial model with the same
  // GptInit, this rank's piece element by element.
  DecoderParams(AxisComm<M, Axis::tp> comm, AxisComm<M, Axis::cp> cp_comm, ep_comm_type ep_comm, int ep_rank,
                const GptInit& init)
      : comm_(std::move(comm)), cp_comm_(std::move(cp_comm)), ep_comm_(std::move(ep_comm)), ep_rank_(ep_rank), init_(init),
        params_(ops_.template make_buffer<T>(num_params, releasable_pages)),
        grads_(ops_.template make_buffer<T>(num_params, releasable_pages)),
        expert_params_(ops_.template make_buffer<T>(expert_layout::size, releasable_pages)),
        expert_grads_(ops_.template make_buffer<T>(expert_layout::size, releasable_pages)),
        balance_(ops_, moe_blocks), sp_partial_(ops_), experts_view_(*this) {
    comm_.order_after(ops_);     // TP collectives in the order of the model's kernels
    cp_comm_.order_after(ops_);  // and the ring's transfers
    ep_comm_.order_after(ops_);  // and the experts' all-to-all
    if (!init.deferred) {
      ops_.write_from_host(params_, [&](std::span<T> p) { init_params<layout>(p, tp_rank(), init); });
      if constexpr (has_experts)
        ops_.write_from_host(expert_params_,
                             [&](std::span<T> p) { init_params<expert_layout>(p, tp_rank(), init, ep_rank_); });
    }
    for (int i = 0; i < layout::count; ++i) p_at_[static_cast<std::size_t>(i)] = P(i), g_at_[static_cast<std::size_t>(i)] = G(i);
    for (int i = 0; i < expert_layout::count; ++i) {
      const std::size_t off = expert_layout::tensors[static_cast<std::size_t>(i)].offset;
      ep_at_[static_cast<std::size_t>(i)] = expert_params_.data() + off;
      eg_at_[static_cast<std::size_t>(i)] = expert_grads_.data() + off;
    }
  }
  template <Axis A, class Ctx>
  static AxisComm<M, A> bind(Ctx& ctx) {
    if constexpr (M::extent(A) == 1) return AxisComm<M, A>();
    else return AxisComm<M, A>(ctx.template comm<A>());
  }
  template <class Ctx>
  static ep_comm_type bind_ep(Ctx& ctx) {
    if constexpr (ep == 1) return ep_comm_type();
    else return ep_comm_type(ctx.template comm<typename M::expert_group>());
  }

  T* P(int i) { return params_.data() + layout::tensors[static_cast<std::size_t>(i)].offset; }
  // Where tensor i's gradient accumulates: the gradient buffer, or under SP, for a gradient
  // summed over this rank's rows, its unit's partial buffer (finish_unit reduces it).
  T* G(int i) {
    if (T* partial = sp_partial_.at(i)) return partial;
    return grads_.data() + layout::tensors[static_cast<std::size_t>(i)].offset;
  }
  // Unit u's backward is done: under SP its partial gradients are summed over TP.
  void finish_unit(int u) { sp_partial_.finish(u, comm_, ops_, grads_.data()); }
  // Whether forward may read the parameters: written at construction, or by the trainer.
  bool params_written() const {
    return !init_deferred() && (!has_experts || !init_.deferred || experts_init_written_);
  }

  ops_type ops_;  // first: the buffers below are made by it
  AxisComm<M, Axis::tp> comm_;
  AxisComm<M, Axis::cp> cp_comm_;
  ep_comm_type ep_comm_;
  int ep_rank_ = 0;
  GptInit init_;
  bool init_written_ = false, experts_init_written_ = false;  // GptInit::deferred: by the trainer
  Buffer<T, Device> params_, grads_;
  Buffer<T, Device> expert_params_, expert_grads_;  // empty without a mixture of experts
  // rows per expert, AuxLossFreeBias's selection bias
  ExpertBalance<config, Device, typename ops_type::stat_t> balance_;
  SpPartialGrads<layout, T, Device, Facts::step_type::sp> sp_partial_;
  std::array<T*, layout::count> p_at_{}, g_at_{};           // each tensor's parameters and gradient
  std::array<T*, expert_layout::count> ep_at_{}, eg_at_{};  // the same for the experts

 private:
  template <class Table>
  std::vector<T> initial(FlatRange r, int ep_rank) const {
    std::vector<T> v(r.size());
    init_range<Table>(r, std::span<T>(v), tp_rank(), init_, ep_rank);
    return v;
  }
  std::vector<T> gather(const Buffer<T, Device>& local) {
    if constexpr (tp == 1) {
      return ops_.to_host(local.span());
    } else {  // gathered where the buffers live, then assembled on the host
      Buffer<T, Device> all = ops_.template make_buffer<T>(local.size() * static_cast<std::size_t>(tp));
      comm_.all_gather(local.span(), all.span());
      std::vector<T> serial(serial_layout::size);
      layout::assemble(std::span<const T>(ops_.to_host(all.span())), std::span<T>(serial));
      return serial;
    }
  }
  template <class Buf>
  static auto view(Buf& b, int i) {
    using E = std::remove_reference_t<decltype(*b.data())>;
    const ParamInfo& t = layout::tensors[static_cast<std::size_t>(i)];
    return TensorView<E>{&t, std::span<E>(b.data() + t.offset, t.size())};
  }

  Experts experts_view_;
};

}  // namespace fived
