#pragma once
// The pipeline executor: one rank's schedule walked through its model chunks, on any
// backend.
//
//   // rank r of Mesh<PP<P>>, one chunk: a model part (Model::part<Layers<f, n>>) and its trainer
//   Stage model(ctx, init);
//   DataParallel<Stage> trainer(model, ctx, adamw, /*accum=*/M);
//   pipeline::Executor run(OneFOneB<P, M>::table, r, ctx.comm<Axis::pp>(), std::tie(model), std::tie(trainer));
//   double loss = run.step(tokens, targets, B, T);   // M micro-batches of [B, T]; the same on every rank
//   double held = run.evaluate(tokens, targets, B, T);  // forwards only: a held-out loss
//
// `program` is this rank's list of actions (pipeline/action.hpp: a row of a schedule table),
// in the order this rank issues them. The executor
//   - runs a chunk's forward on micro-batch m (tokens on the first virtual stage, else the
//     activations received) in an activation slot of its own (pipeline/slot_book.hpp), so a
//     chunk holds as many micro-batches as the schedule keeps in flight, no more;
//   - runs its backward (the loss gradient on the last virtual stage, else the gradient
//     received) and keeps d(input) for the send back;
//   - issues a communication action and the ones joined to it as one grouped send_recv over
//     the PP communicator (two neighbours that both send first cannot block each other);
//   - drives each chunk's DataParallel (train/data_parallel.hpp) through the step in pieces,
//     in the frame every step runs (pipeline/step_frame.hpp; DataParallel::step too): begin_step, the hooks, begin/end_backward around every backward or W (the chunk's M-th
//     is the one NoZeRO and ZeRO-1 reduce), end_micro_batches; then the clip over every
//     parameter of the pipeline (summed over the chunks and over PP) and each AdamW update;
//   - returns the mean loss over the M micro-batches and the data-parallel group, on every
//     rank (the last virtual stage computes it; an all-reduce over PP hands it out);
//   - hands activations and gradients over in memory between two chunks of this rank that
//     hold neighbouring virtual stages (the turn of a V), where the table has no message.
//
// A backward split into I and W parts calls the model's backward_input(hooks, slot) at I and
// backward_weight(hooks, slot) at W (nn/weight_grads.hpp); the chunk's DataParallel reduces
// at W, where the gradients are made. A model without them runs its whole backward at I.

#include <algorithm>
#include <cstddef>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/comm/communicator.hpp"
#include "fived/comm/step_gate.hpp"
#include "fived/comm/types.hpp"
#include "fived/device/bf16.hpp"
#include "fived/device/buffer.hpp"
#include "fived/model/unit_hooks.hpp"
#include "fived/optim/flat_range.hpp"
#include "fived/pipeline/action.hpp"
#include "fived/pipeline/connect.hpp"
#include "fived/pipeline/slot_book.hpp"
#include "fived/pipeline/stages.hpp"
#include "fived/pipeline/step_frame.hpp"
#include "fived/pipeline/table.hpp"
#include "fived/pipeline/tied_grads.hpp"
#include "fived/util/call_hash.hpp"

namespace fived::pipeline {

template <class Models, class Trainers, Communicator C>
class Executor;

template <class... Models, class... Trainers, Communicator C>
class Executor<std::tuple<Models&...>, std::tuple<Trainers&...>, C> {
  static constexpr int V = sizeof...(Models);
  static_assert(V >= 1 && sizeof...(Trainers) == V, "pipeline::Executor: one DataParallel per model chunk");
  using first_model = std::tuple_element_t<0, std::tuple<Models...>>;
  using T = typename first_model::value_type;
  using Device = typename first_model::device;
  static_assert(V == 1 || std::is_same_v<Device, Host>,
                "pipeline::Executor: on a device, every model chunk of a rank must queue its kernels on one stream, "
                "which the model's parts do not share yet; use one chunk per rank (GPipe, 1F1B, ZB-H1) on CUDA for now");

 public:
  // shape: the schedule's ranks, micro-batches, chunks and stage order; program: rank
  // `rank`'s actions; chunks and trainers: this rank's, in chunk order; pp: this rank's
  // communicator over the PP axis.
  Executor(Shape shape, int rank, std::vector<Action> program, C& pp, std::tuple<Models&...> chunks,
           std::tuple<Trainers&...> trainers)
      : shape_(shape), rank_(rank), program_(std::move(program)), M_(shape.micro_batches), pp_(pp), chunks_(chunks),
        trainers_(trainers), norm_total_(1), frame_(shape.micro_batches, trainers, norm_total_.span()) {
    if (!shape_.valid() || shape_.chunks != V || rank < 0 || rank >= shape_.ranks)
      throw std::invalid_argument("pipeline::Executor: rank " + std::to_string(rank) + " with " + std::to_string(V) +
                                  " model chunks does not fit the schedule's shape (" + std::to_string(shape_.ranks) +
                                  " ranks, " + std::to_string(shape_.chunks) + " chunks per rank)");
    if (pp.size() != shape_.ranks)
      throw std::invalid_argument("pipeline::Executor: the schedule has " + std::to_string(shape_.ranks) +
                                  " ranks but the PP communicator " + std::to_string(pp.size()));
    for (std::size_t i = 0; i < program_.size(); ++i) {
      const Action& s = program_[i];
      if (s.op == Op::none) continue;
      if (s.chunk < 0 || s.chunk >= V || s.mb < 0 || s.mb >= M_)
        throw std::invalid_argument("pipeline::Executor: action " + std::to_string(i) + " names chunk " +
                                    std::to_string(s.chunk) + " and micro-batch " + std::to_string(s.mb) +
                                    ", outside the " + std::to_string(V) + " chunks and " + std::to_string(M_) +
                                    " micro-batches of this rank");
    }
    book_.emplace(program_, V, M_, [this](int c) { return local_neighbour(c, +1); });
    for_each_chunk([&]<int c>(auto& model, auto& dp) {
      model.set_slots(book_->slots(c));
      if (dp.accum() != M_)
        throw std::invalid_argument("pipeline::Executor: chunk " + std::to_string(c) + "'s DataParallel averages over " +
                                    std::to_string(dp.accum()) + " micro-batches, the schedule runs " +
                                    std::to_string(M_) + ": make it with accum = " + std::to_string(M_));
    });
    // On a device the point-to-point transfers are ordered with the chunks' kernels, and
    // they belong to the first chunk's graph steps (comm/step_gate.hpp).
    if constexpr (requires { pp_.set_compute_stream(std::get<0>(chunks_).ops().stream()); })
      pp_.set_compute_stream(std::get<0>(chunks_).ops().stream());
    gate_.order_after(std::get<0>(chunks_).ops());
    if constexpr (ties) make_tied_sum();
    std::vector<int> peers = peers_of(std::span<const Action>(program_));
    if (tied_.peer() >= 0) peers.push_back(tied_.peer());
    connect_peers<T>(std::move(peers), pp_, std::get<0>(chunks_).ops());
  }

  // One optimizer step on the global batch: M micro-batches of [B, T] token ids, rows
  // [m*B, (m+1)*B) for micro-batch m, the same on every rank (each data-parallel rank takes
  // its rows of every micro-batch). Returns the mean loss, on every rank.
  double step(std::span<const int> tokens, std::span<const int> targets, int B, int seq) {
    // Plain unless the Trainer turned the step graph on (one chunk per rank).
    GraphStep graph(std::get<0>(chunks_).ops(), frame_.graph_shape(tokens.size(), B, seq));
    last_step_ = {tokens.size(), B, seq};
    run(tokens, targets, B, seq);
    update();
    graph.launch();
    return mean_loss();  // the host's one wait, with the whole step queued
  }

  // The step without its update: forwards and backwards as the table says, the gradients
  // reduced as each chunk's policy says (read them now: DataParallel::reduced_grads). Returns
  // the mean loss, on every rank.
  double reduce(std::span<const int> tokens, std::span<const int> targets, int B, int seq) {
    run(tokens, targets, B, seq);
    return mean_loss();
  }

  // After reduce(): the clip over every parameter of the pipeline (each chunk's part of the
  // norm, summed over PP) and each chunk's AdamW step, queued.
  void update() {
    frame_.sum_of_squares([&](std::span<double> total) { sum_over_pp_in_device(total); });
    frame_.update();
  }

  // Activation slots chunk c holds: the most micro-batches it keeps in flight.
  int slots(int chunk) const { return book_->slots(chunk); }

  // The mean loss of a global batch (as step() takes it) on the current weights, on every
  // rank: each micro-batch's forward through the virtual stages in turn, every rank walking
  // the (micro-batch, stage) pairs in the same order, so each activation sent is received next
  // on the stage after (no table needed: a chain cannot wait on itself). Nothing is kept for a
  // backward, reduced or updated, and a model with set_training keeps no training statistic
  // (nn/decoder.hpp). Between steps: it writes over slot 0's activations, which a step
  // writes afresh. A step graph is kept when the batch has the last step's shape (nothing is
  // reserved anew, so no buffer the graph replays moves); another shape gives it up: the next
  // step runs plain, the one after captures again.
  double evaluate(std::span<const int> tokens, std::span<const int> targets, int B, int seq) {
    const bool keeps_graph = last_step_ == StepShape{tokens.size(), B, seq};
    take_batch(tokens, targets, B, seq, "evaluate");
    struct Evaluating {  // set_training(false) for the pass, on again however it ends
      Executor& e;
      explicit Evaluating(Executor& x) : e(x) { e.set_training(false); }
      ~Evaluating() { e.set_training(true); }
    } evaluating(*this);
    for_each_chunk([&]<int c>(auto& model, auto&) {
      if constexpr (requires { model.ops().abandon_graph_step(); })
        if (!keeps_graph) model.ops().abandon_graph_step();
      if constexpr (std::remove_reference_t<decltype(model)>::has_head) model.ops().begin_loss_sum();
    });
    for (int m = 0; m < M_; ++m)
      for (int stage = 0; stage < shape_.stages(); ++stage)
        if (shape_.rank_of(stage) == rank_) forward_only(stage, m);
    for_each_chunk([&]<int c>(auto&, auto& dp) { dp.end_micro_batches(); });  // ZeRO-3: the outer units given back
    return mean_loss();
  }

 private:
  // The step's micro-batches, checked; this data rank's rows of them.
  void take_batch(std::span<const int> tokens, std::span<const int> targets, int B, int seq, const char* call) {
    const std::size_t want = static_cast<std::size_t>(M_) * static_cast<std::size_t>(B) * static_cast<std::size_t>(seq);
    if (tokens.size() != want || targets.size() != want)
      throw std::invalid_argument(std::string("pipeline::Executor::") + call +
                                  ": tokens and targets must hold micro-batches * B * T = " + std::to_string(want) +
                                  " ids (got " + std::to_string(tokens.size()) + " and " +
                                  std::to_string(targets.size()) + ")");
    auto& dp0 = std::get<0>(trainers_);
    const FlatRange mine = dp0.rows(dp0.data_rank(), B);
    b_ = static_cast<int>(mine.size()), T_ = seq;
    tokens_ = tokens, targets_ = targets, row0_ = mine.begin, B_ = B;
  }

  // reduce() but the loss: every action of the table, then the tied tensors' gradients summed.
  void run(std::span<const int> tokens, std::span<const int> targets, int B, int seq) {
    take_batch(tokens, targets, B, seq, "step");
    reserve_boundaries();
    frame_.begin();
    for_each_chunk([&]<int c>(auto& model, auto&) {
      if constexpr (std::remove_reference_t<decltype(model)>::has_head) model.ops().begin_loss_sum();
    });
    book_->begin_step();

    const std::span<const Action> program(program_);
    for (int i = 0; i < static_cast<int>(program.size());) {  // a compute action, or one comm group
      const int e = step_end(program, i);
      if (is_comm(program[static_cast<std::size_t>(i)].op)) exchange(static_cast<std::size_t>(i), static_cast<std::size_t>(e));
      else compute(program[static_cast<std::size_t>(i)]);
      i = e;
    }

    // The host waited for no device work until here: a rank blocked on its device while its
    // neighbour needs it inside NCCL (a p2p connection is set up at first use, by both hosts)
    // would hang the pipeline.
    frame_.end();
    sum_tied_grads();
  }
  // The step's mean loss, on every rank: the last stage's loss sum, over PP and DP.
  double mean_loss() {
    double loss = 0;
    for_each_chunk([&]<int c>(auto& model, auto&) {
      // Every rank waits for its step first, a stage without the head too (it reads no loss):
      // the reductions below must not run beside the step's own transfers and collectives on
      // the same communicators (NCCL's order within a communicator is the order of launch),
      // nor beside a graph still running them.
      if constexpr (requires { model.ops().synchronize(); }) model.ops().synchronize();  // (a stand-in has none)
      if constexpr (std::remove_reference_t<decltype(model)>::has_head)
        loss = model.ops().loss_sum() / (static_cast<double>(b_) * model.local_length(T_));
    });
    return std::get<0>(trainers_).average(all_reduce_pp(loss) / M_);
  }

  // ---- compute -----------------------------------------------------------------------------

  void compute(const Action& s) {
    visit_chunk(s.chunk, [&]<int c>(auto& model, auto& dp) {
      using Model = std::remove_reference_t<decltype(model)>;
      switch (s.op) {
        case Op::forward: {
          const int k = slot(c, s.mb, true);
          const std::size_t off = row_offset(s.mb);
          model.enqueue_forward(tokens_.data() + off, targets_.data() + off, b_, T_, dp.hooks(), k);
          if constexpr (Model::has_head) model.add_to_loss_sum(k);  // read after the program
          else if (const int next = local_neighbour(c, +1); next >= 0)  // the next stage is here
            visit_chunk(next, [&]<int n>(auto& to, auto&) {
              if constexpr (requires { to.input(0, 1, 1); })
                model.ops().copy(to.input(slot(n, s.mb, true), b_, T_), model.output(k), boundary());
            });
          break;
        }
        case Op::backward:
        case Op::input_grad: {
          const int k = slot(c, s.mb, false);
          if constexpr (!Model::has_head)
            model.ops().copy(model.output_grad(b_, T_), grad_in(c, k), boundary());
          backward_at(s.op, c, model, dp, k);
          if constexpr (!Model::has_embedding) {
            const int prev = local_neighbour(c, -1);  // the previous stage is here: straight to it
            model.ops().copy(prev >= 0 ? grad_in(prev, slot(prev, s.mb, false)) : grad_out(c, k), model.input_grad(),
                             boundary());
          }
          if (s.op == Op::backward) done_with(c, s.mb);
          break;
        }
        case Op::weight_grad:  // else computed with the input part (see the top of this file)
          if constexpr (splits_backward<Model>)
            frame_.gradients(c, dp, [&] { model.backward_weight(dp.hooks(), slot(c, s.mb, false)); });
          done_with(c, s.mb);
          break;
        default:
          break;
      }
    });
  }

  // evaluate()'s forward of micro-batch m on virtual stage `stage`, held here: its input
  // received from the stage before when that is on another rank, its output sent to the
  // stage after or handed to this rank's chunk holding it; one slot serves them all.
  void forward_only(int stage, int m) {
    visit_chunk(chunk_holding(stage), [&]<int c>(auto& model, auto& dp) {
      using Model = std::remove_reference_t<decltype(model)>;
      const std::size_t n = boundary();
      if constexpr (!Model::has_embedding)
        if (local_neighbour(c, -1) < 0) {
          recvs_.assign(1, {std::span<T>(model.input(0, b_, T_), n), shape_.rank_of(stage - 1)});
          gate_.send_recv(pp_, std::span<const SendOp<T>>(), std::span<const RecvOp<T>>(recvs_));
        }
      const std::size_t off = row_offset(m);
      model.enqueue_forward(tokens_.data() + off, targets_.data() + off, b_, T_, dp.hooks(), 0);
      if constexpr (Model::has_head) {
        model.add_to_loss_sum(0);
      } else if (const int next = local_neighbour(c, +1); next >= 0) {
        visit_chunk(next, [&]<int d>(auto& to, auto&) {
          if constexpr (requires { to.input(0, 1, 1); }) model.ops().copy(to.input(0, b_, T_), model.output(0), n);
        });
      } else {
        sends_.assign(1, {std::span<const T>(model.output(0), n), shape_.rank_of(stage + 1)});
        gate_.send_recv(pp_, std::span<const SendOp<T>>(sends_), std::span<const RecvOp<T>>());
      }
    });
  }
  // Each chunk that can say whether it trains (set_training: nn/decoder.hpp) told.
  void set_training(bool on) {
    for_each_chunk([&]<int c>(auto& model, auto&) {
      if constexpr (requires { model.set_training(on); }) model.set_training(on);
    });
  }

  // ---- communication -------------------------------------------------------------------------

  // Actions [i, e): one grouped exchange.
  void exchange(std::size_t i, std::size_t e) {
    std::vector<SendOp<T>>& sends = sends_;
    std::vector<RecvOp<T>>& recvs = recvs_;
    sends.clear(), recvs.clear();
    for (std::size_t j = i; j < e; ++j) {
      const Action& s = program_[j];
      visit_chunk(s.chunk, [&]<int c>(auto& model, auto&) {
        using Model = std::remove_reference_t<decltype(model)>;
        const std::size_t n = boundary();
        switch (s.op) {
          case Op::send_act:
            if constexpr (!Model::has_head)
              sends.push_back({std::span<const T>(model.output(slot(c, s.mb, false)), n), s.peer});
            else bad(s, "the chunk with the head has no activations to send");
            break;
          case Op::recv_act:
            if constexpr (!Model::has_embedding)
              recvs.push_back({std::span<T>(model.input(slot(c, s.mb, true), b_, T_), n), s.peer});
            else bad(s, "the chunk with the embedding receives no activations");
            break;
          case Op::send_grad:
            if constexpr (!Model::has_embedding)
              sends.push_back({std::span<const T>(grad_out(c, slot(c, s.mb, false)), n), s.peer});
            else bad(s, "the chunk with the embedding has no input gradient to send");
            break;
          case Op::recv_grad:
            if constexpr (!Model::has_head)
              recvs.push_back({std::span<T>(grad_in(c, slot(c, s.mb, false)), n), s.peer});
            else bad(s, "the chunk with the head receives no gradient");
            break;
          default:
            break;
        }
      });
    }
    gate_.send_recv(pp_, std::span<const SendOp<T>>(sends), std::span<const RecvOp<T>>(recvs));
    for (std::size_t j = i; j < e; ++j)  // d(input) has left: its slot may go
      if (program_[j].op == Op::send_grad) done_with(program_[j].chunk, program_[j].mb);
  }

  // A tensor tied across stages gets the sum of the two copies' reduced gradients, in device
  // memory (pipeline/tied_grads.hpp).
  static constexpr bool ties = ((tied_name<Models>() != nullptr) || ...);
  void make_tied_sum() {
    std::vector<std::pair<int, std::vector<std::span<T>>>> holders;
    for_each_chunk([&]<int c>(auto& model, auto& dp) {
      if (const auto r = tied_range<std::remove_reference_t<decltype(model)>>())
        holders.emplace_back(shape_.stage(rank_, c), dp.owned_reduced_grads(*r));
    });
    tied_ = TiedGradSum<T, Device>(shape_, std::move(holders), std::get<0>(chunks_).ops());
    // Pieces of other sizes would pair up in the swap (DataParallels with other bucket sizes).
    if (pp_.size() > 1) tied_.check_peer_cut([&](std::span<double> v) { all_reduce_pp_host(v, ReduceOp::max); });
  }
  void sum_tied_grads() {
    if constexpr (ties) tied_.sum(std::get<0>(chunks_).ops(), gate_, pp_);
  }

  // Values in the chunks' device memory (the gradient norm), summed in the order of their kernels.
  void sum_over_pp_in_device(std::span<double> v) {
    if (pp_.size() > 1)
      gate_.issue("pipeline: the gradient norm over PP", [this, v] { pp_.all_reduce(std::span<const double>(v), v, ReduceOp::sum); },
                  [&] { return call_hash(&pp_, v.data(), v.size()); });
  }
  double all_reduce_pp(double v) {
    if (pp_.size() == 1) return v;  // no pipeline (Accumulate<M>): nothing to reduce
    gate_.host_wait("pipeline: the loss over PP");
    all_reduce_pp_host(std::span<double>(&v, 1), ReduceOp::sum);
    return v;
  }
  // Values the host holds, reduced over PP (a wait for the device).
  void all_reduce_pp_host(std::span<double> v, ReduceOp op) {
    if constexpr (requires { pp_.all_reduce_host(v, op); }) pp_.all_reduce_host(v, op);
    else pp_.all_reduce(std::span<const double>(v), v, op);
  }

  // B, or I: the input half where the model splits its backward (its gradients come at W),
  // else the whole backward.
  template <class Model, class Trainer>
  void backward_at(Op op, int c, Model& model, Trainer& dp, int k) {
    if constexpr (splits_backward<Model>)
      if (op == Op::input_grad) return model.backward_input(dp.hooks(), k);
    frame_.gradients(c, dp, [&] { model.backward(dp.hooks(), k); });
  }

  template <class Model>
  static constexpr bool splits_backward = requires(Model& m, const UnitHooks& h) {
    m.backward_input(h, 0);
    m.backward_weight(h, 0);
  };

  // The chunk of this rank holding the virtual stage next to chunk c's (+1: after it, -1:
  // before it), or -1 when that stage is on another rank or does not exist.
  int local_neighbour(int c, int direction) const {
    const int s = shape_.stage(rank_, c) + direction;
    if (s < 0 || s >= shape_.stages() || shape_.rank_of(s) != rank_) return -1;
    return chunk_holding(s);
  }
  // The chunk of this rank that holds virtual stage s, or -1.
  int chunk_holding(int s) const {
    for (int d = 0; d < V; ++d)
      if (shape_.stage(rank_, d) == s) return d;
    return -1;
  }

  [[noreturn]] static void bad(const Action& s, const char* why) {
    throw std::logic_error("pipeline::Executor: micro-batch " + std::to_string(s.mb) + " of chunk " +
                           std::to_string(s.chunk) + ": " + why + " (the schedule does not fit the model's parts)");
  }

  // ---- slots and boundary buffers -----------------------------------------------------------

  int slot(int c, int m, bool take) { return book_->slot(c, m, take); }
  void done_with(int c, int m) { book_->done_with(c, m); }

  std::size_t boundary() const { return first_model::boundary_size(b_, T_); }
  // Gradients received for (and d(input) kept from) each chunk's slots.
  void reserve_boundaries() {
    const std::size_t n = boundary();
    if (n <= boundary_capacity_) return;
    boundary_capacity_ = n;
    grad_in_.clear(), grad_out_.clear();
    for_each_chunk([&]<int c>(auto& model, auto&) {
      for (int k = 0; k < book_->slots(c); ++k) {
        grad_in_.push_back(model.ops().template make_buffer<T>(n));
        grad_out_.push_back(model.ops().template make_buffer<T>(n));
      }
    });
  }
  std::size_t buffer_index(int c, int k) const {
    std::size_t i = 0;
    for (int d = 0; d < c; ++d) i += static_cast<std::size_t>(book_->slots(d));
    return i + static_cast<std::size_t>(k);
  }
  T* grad_in(int c, int k) { return grad_in_[buffer_index(c, k)].data(); }
  T* grad_out(int c, int k) { return grad_out_[buffer_index(c, k)].data(); }

  std::size_t row_offset(int m) const {
    return (static_cast<std::size_t>(m) * static_cast<std::size_t>(B_) + row0_) * static_cast<std::size_t>(T_);
  }

  // ---- the chunks ----------------------------------------------------------------------------

  template <class F>
  void for_each_chunk(F&& f) {
    [&]<std::size_t... c>(std::index_sequence<c...>) {
      (f.template operator()<static_cast<int>(c)>(std::get<c>(chunks_), std::get<c>(trainers_)), ...);
    }(std::make_index_sequence<V>{});
  }
  template <class F>
  void visit_chunk(int chunk, F&& f) {
    for_each_chunk([&]<int c>(auto& model, auto& dp) {
      if (c == chunk) f.template operator()<c>(model, dp);
    });
  }

  Shape shape_;
  int rank_;
  std::vector<Action> program_;
  int M_;
  C& pp_;
  std::tuple<Models&...> chunks_;
  std::tuple<Trainers&...> trainers_;
  StepGate gate_;                        // pp_'s calls in a graph step
  TiedGradSum<T, Device> tied_;          // the tied tensor's gradient summed over its stages
  Buffer<double, Device> norm_total_;  // the step's squared gradient norm, summed over PP (device memory)
  StepFrame<Trainers...> frame_;        // begin, each backward's bracket, end, the clip and the updates
  std::optional<SlotBook> book_;  // which slot each micro-batch holds (made once the program is checked)
  std::vector<Buffer<T, Device>> grad_in_, grad_out_;
  std::size_t boundary_capacity_ = 0;
  std::vector<SendOp<T>> sends_;
  std::vector<RecvOp<T>> recvs_;
  std::span<const int> tokens_, targets_;
  std::size_t row0_ = 0;
  int B_ = 0, b_ = 0, T_ = 0;
  struct StepShape {  // a step's ids, B and T: the shape its graph was captured at
    std::size_t ids = 0;
    int B = 0, T = 0;
    bool operator==(const StepShape&) const = default;
  };
  StepShape last_step_;
};

template <class... Models, class... Trainers, Communicator C>
Executor(Shape, int, std::vector<Action>, C&, std::tuple<Models&...>, std::tuple<Trainers&...>)
    -> Executor<std::tuple<Models&...>, std::tuple<Trainers&...>, C>;

// Rank `rank` of a schedule table (pipeline/table.hpp).
template <class Table, class... Models, class... Trainers, Communicator C>
auto make_executor(const Table& table, int rank, C& pp, std::tuple<Models&...> chunks, std::tuple<Trainers&...> trainers) {
  const auto program = table.program(rank);
  return Executor(table.shape, rank, std::vector<Action>(program.begin(), program.end()), pp, chunks, trainers);
}

}  // namespace fived::pipeline
