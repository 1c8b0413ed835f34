#pragma once
// A mixture of experts in place of a block's MLP: a linear router picks top_k of E experts
// for every token, the tokens travel to the ranks holding their experts (all-to-all over
// EP), each expert is the MLP of nn/mlp.hpp applied to its contiguous rows, and the outputs
// come home weighted by the gates.
//
//   x ─gather_rows─► x_full [N, C] ─router─► scores [N, E] ─top-k─► expert, gate [N, k]
//     ─dispatch_plan─► rows sorted by expert ─all_to_all_v(EP)─► [local expert][source rank]
//     ─E/EP expert MLPs (F split over TP)─► ─all_to_all_v back─► Σ_j gate · y ─reduce_rows─► y
//
// Placement. The experts' weights are stacked along their rows in the expert buffer (nn/
// param_table.hpp: `experts`), whole experts over EP, each expert's hidden width F over TP as
// the dense MLP's (c_fc columns, c_proj rows). EP is carved out of DP·CP (mesh/mesh.hpp), so
// the TP ranks of a replica hold the same rows, route them alike (the router weight is
// replicated over TP) and exchange them with the same TP slice of the other EP ranks; the
// expert outputs are Partial over TP like the MLP's, and one reduce_rows finishes them.
// Gradients: the router's dx is complete on every TP rank, so TP rank 0 adds it to the
// partial sum (as RowParallel adds its bias); a gate's gradient <dy, y_e> is Partial over TP
// and is all-reduced over TP ([N·k] values) before the router's backward.
//
// Counts first. The per-expert counts are exchanged (all_to_all_host over EP) before the
// rows, so each rank knows what it receives; the all_to_all_v with per-peer counts then
// moves them. Every rank joins every collective of forward and backward, also with zero
// tokens to send or receive. Those counts are host values: on CUDA the routing waits for
// the device once per MoE layer (dropless routing cannot size a transfer otherwise).
// With pad_to_capacity (nn/config.hpp) every expert's rows are padded to its capacity
// (empty slots are zero rows, whose outputs no token reads and whose gradients are zero):
// every size is known before routing, nothing is counted on the host and nothing waits.
//
// Balancing. The Switch load-balancing loss, aux = coef · E · Σ_e f_e · P_e (f_e: the share
// of the k·N assignments kept for expert e, P_e: the mean score of e), over the tokens of a
// replica's micro-batch (summed over CP); its gradient coef·E·f_e/N on every score joins the
// router's backward. Both come from the kept rows and score sums per expert in device
// memory, summed over CP there (Saved::balance); the loss's value is read from them when it
// is reported, apart from the language-model loss (aux_loss()). With
// AuxLossFreeBias (nn/config.hpp) the selection adds a per-expert bias that the model moves
// after each step towards equal loads (balance_experts, nn/expert_balance.hpp).
//
// At EP 1 the exchanges vanish: the sorted rows are the experts' rows, and this is the
// serial mixture of experts every parallel run is compared with.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "fived/mesh/mesh_comm.hpp"
#include "fived/device/buffer.hpp"
#include "fived/model/plan_shape.hpp"  // plan::expert_capacity
#include "fived/nn/config.hpp"
#include "fived/nn/linear.hpp"
#include "fived/nn/param_table.hpp"
#include "fived/nn/stream.hpp"

namespace fived {

// The router, a dense tensor replicated over TP, stored as the experts are (W): GPT-2's
// Conv1D "mlp.router.weight" [C, E], or torch.nn.Linear [E, C] under Mixtral's name
// "block_sparse_moe.gate.weight".
template <class W = Conv1D>
constexpr std::array<TensorSpec, 1> router_specs(int layer, int unit, int C, int E, std::uint64_t stream) {
  if constexpr (W::transposed) return {matrix_spec("block_sparse_moe.gate.weight", layer, E, C, {}, unit, Init::normal, stream)};
  else return {matrix_spec("mlp.router.weight", layer, C, E, {}, unit, Init::normal, stream)};
}

// The experts, stacked: c_fc.weight [E·C, F], c_fc.bias [E, F], c_proj.weight [E·F, C],
// c_proj.bias [E, C]; whole experts over EP, F over TP; reduced over the expert-data group.
constexpr std::array<TensorSpec, 4> expert_specs(int layer, int unit, int C, int F, int E, std::uint64_t stream) {
  auto expert = [E](TensorSpec s, bool decays) {
    s.reduce = ReduceGroup::expert_data;
    s.experts = E;
    s.decays = decays;
    return s;
  };
  return {expert(matrix_spec("mlp.experts.c_fc.weight", layer, std::int64_t{E} * C, F, {1, 1}, unit, Init::normal, stream), true),
          expert(matrix_spec("mlp.experts.c_fc.bias", layer, E, F, {1, 1}, unit, Init::zeros, stream + 1), false),
          expert(matrix_spec("mlp.experts.c_proj.weight", layer, std::int64_t{E} * F, C, {0, 1}, unit,
                             Init::normal_residual, stream + 2),
                 true),
          expert(matrix_spec("mlp.experts.c_proj.bias", layer, E, C, {}, unit, Init::zeros, stream + 3), false)};
}

// SwiGLU experts (Llama's MLP, stacked, torch.nn.Linear [out, in], no biases), as
// transformers' Mixtral holds them: gate_up_proj [E·2F, C] (each expert's gate rows, then its
// up rows, both split over TP: a rank's [2F/TP, C] of an expert is one GEMM), down_proj
// [E·C, F] (F over TP). In a file, as Mixtral's: expert e's gate rows are
// "block_sparse_moe.experts.{e}.w1.weight", its up rows w3, its down_proj w2.
constexpr std::array<TensorSpec, 2> swiglu_expert_specs(int layer, int unit, int C, int F, int E, std::uint64_t stream) {
  auto expert = [E](TensorSpec s, ExpertFiles files) {
    s.reduce = ReduceGroup::expert_data;
    s.experts = E;
    s.expert_files = files;
    return s;
  };
  return {expert(matrix_spec("block_sparse_moe.experts.gate_up_proj", layer, std::int64_t{E} * 2 * F, C, {0, 2}, unit,
                             Init::normal, stream),
                 {"block_sparse_moe.experts.{}.w1.weight", "block_sparse_moe.experts.{}.w3.weight"}),
          expert(matrix_spec("block_sparse_moe.experts.down_proj", layer, std::int64_t{E} * C, F, {1, 1}, unit,
                             Init::normal_residual, stream + 1),
                 {"block_sparse_moe.experts.{}.w2.weight"})};
}

// Gated: SwiGLU experts (swiglu_expert_specs; Params' fc_w is gate_up, proj_w down, no
// biases) and the router as torch.nn.Linear (Mixtral), else GELU MLPs (expert_specs) and a
// Conv1D router (GPT-2's layout).
template <class S, class Cfg, bool Gated = false>
struct MoE {
  using RouterW = std::conditional_t<Gated, TorchLinear, Conv1D>;  // router_specs<RouterW>
  using T = typename S::value_type;
  using Device = typename S::device;
  using stat_t = typename S::stat_t;
  using ops_type = typename S::ops_type;
  using dims = gpt_dims<Cfg>;
  static constexpr int E = dims::experts, K = dims::top_k, EP = S::ep, El = E / (EP > 0 ? EP : 1);
  static constexpr bool sigmoid = Cfg::router_sigmoid, renormalize = Cfg::renormalize_gates;
  static constexpr bool padded = Cfg::pad_to_capacity;
  static constexpr double coef = Cfg::aux_loss_coef;
  static constexpr int balance_size = coef > 0 ? 2 * E : 0;  // Saved::balance's elements
  static_assert(E % EP == 0,
                "a mixture of experts spreads its experts over EP: the number of experts must be a multiple of the EP "
                "extent");

  template <class U>
  using buffer = Buffer<U, Device>;

  // The router in the dense buffer; this rank's experts (E/EP of them, F/TP wide) in the
  // expert buffer (gated: fc_w the gate|up rows, proj_w down, no biases).
  struct Params {
    T *router, *fc_w, *fc_b, *proj_w, *proj_b;
  };
  static constexpr int act_width(int Fl) { return Gated ? 2 * Fl : Fl; }  // pre-activation (or gate|up) per row

  // Each expert's capacity on this rank (-1: dropless).
  static int capacity(int N) {
    if constexpr (Cfg::capacity_factor <= 0) return -1;
    else return static_cast<int>(plan::expert_capacity(Cfg::capacity_factor, N, K, E));
  }
  // Rows in dispatch order for N tokens: the N·k assignments, or E padded experts.
  static std::size_t dispatch_rows(std::size_t N) {
    if constexpr (padded) return static_cast<std::size_t>(E) * static_cast<std::size_t>(capacity(static_cast<int>(N)));
    else return N * K;
  }

  // Rows at this rank's experts for N tokens a rank, with a capacity: the most that can arrive
  // (each EP rank sends each local expert at most capacity rows, and no more than its N·k),
  // padded exactly E·capacity; -1 dropless (as many as arrive). plan::Transformer::expert_rows.
  static int expert_rows(int N) {
    if constexpr (Cfg::capacity_factor <= 0) return -1;
    else if constexpr (padded) return E * capacity(N);
    else return std::min(E * capacity(N), EP * N * K);
  }

  // What forward keeps for backward (one per block and micro-batch slot). The buffers of the
  // rows at this rank's experts are made at the first forward, for expert_rows with a
  // capacity; dropless, the rows that arrive are data dependent: those buffers grow when more
  // arrive, never shrink.
  struct Saved {
    buffer<T> x_full;                  // SP: the gathered input
    buffer<stat_t> scores, gate;       // [N, E], [N·k]
    buffer<int> expert, pos;           // [N·k]: chosen expert, row in dispatch order
    buffer<int> token_of;              // [dispatch rows]: a row's token (padded: -1 for an empty slot)
    buffer<T> y;                       // [dispatch rows, C]: expert outputs in dispatch order (Partial on TP)
    buffer<T> x_exp, pre, h;           // [R, C], [R, F/TP] (gated: [R, 2F/TP]), [R, F/TP]: this rank's experts' rows
    buffer<stat_t> daux;               // [E]: the balancing loss's gradient per score
    buffer<stat_t> loads;              // [E]: rows kept per expert, this rank's tokens (device memory)
    buffer<stat_t> balance;            // [2E]: rows kept and score sums per expert, over the replica
    std::vector<int> counts;           // [E]: loads in host memory (dropless: they size the exchange)
    std::vector<std::int64_t> from;    // [EP·El]: rows from peer p for local expert j
    std::vector<std::size_t> send, recv;  // elements to / from each EP peer
    int kept = 0, received = 0;

    void reserve(ops_type& ops, std::size_t N, std::size_t C) {
      if constexpr (S::sp) x_full = ops.template make_buffer<T>(N * C);
      scores = ops.template make_buffer<stat_t>(N * E);
      gate = ops.template make_buffer<stat_t>(N * K);
      expert = ops.template make_buffer<int>(N * K);
      pos = ops.template make_buffer<int>(N * K);
      token_of = ops.template make_buffer<int>(dispatch_rows(N));
      y = ops.template make_buffer<T>(dispatch_rows(N) * C);
      daux = ops.template make_buffer<stat_t>(E);
      loads = ops.template make_buffer<stat_t>(E);
      balance = ops.template make_buffer<stat_t>(2 * E);
      counts.assign(E, 0);
      from.assign(static_cast<std::size_t>(EP) * El, 0);
      send.assign(EP, 0);
      recv.assign(EP, 0);
    }
  };
  // Shared by the slots: what one forward or backward uses and leaves behind.
  struct Work {
    buffer<T> logits;    // [N, E]: the router's logits, then their gradient
    buffer<stat_t> dgate;  // [N·k]
    buffer<T> rows;      // [dispatch rows, C]: rows in dispatch order (to send, or d(y), dx)
    buffer<T> staging, y_exp, dh, dgu;  // [R, C] x2, [R, F/TP], gated: [R, 2F/TP]
    void reserve(ops_type& ops, std::size_t N, std::size_t C) {
      logits = ops.template make_buffer<T>(N * E);
      dgate = ops.template make_buffer<stat_t>(N * K);
      rows = ops.template make_buffer<T>(dispatch_rows(N) * C);
    }
  };

  // The balancing loss of a forward from its statistics (Saved::balance, read to the host)
  // over N tokens of this rank: 0 without one.
  static double aux_loss(std::span<const stat_t> balance, int N) {
    if constexpr (coef <= 0) return 0;
    const double tokens = static_cast<double>(N) * S::cp, assignments = tokens * K;
    double aux = 0;
    for (int e = 0; e < E; ++e)
      aux += coef * E * (static_cast<double>(balance[static_cast<std::size_t>(e)]) / assignments) *
             (static_cast<double>(balance[static_cast<std::size_t>(E + e)]) / tokens);
    return aux;
  }

  // y (the stream's rows, "=") from x (the stream's rows). bias: [E] selection bias or null.
  // partial: [N, C] scratch when SP.
  static void forward(S& s, Saved& a, Work& w, T* y, const T* x, Params p, const float* bias, int C, int F,
                      T* partial) {
    const int N = s.rows(), Fl = F / S::tp;
    ops_type& ops = s.ops;
    const T* xf = s.gather_rows(x, a.x_full.data(), C);
    ops.matmul(w.logits.data(), xf, p.router, static_cast<const T*>(nullptr), N, E, C, false, RouterW::transposed);
    ops.router_scores(a.scores.data(), w.logits.data(), N, E, sigmoid);
    ops.router_topk(a.expert.data(), a.gate.data(), a.scores.data(), bias, N, E, K, renormalize);
    ops.dispatch_plan(a.token_of.data(), a.pos.data(), a.loads.data(), padded ? nullptr : a.counts.data(),
                      a.expert.data(), N, K, E, capacity(N), padded);
    balancing_loss(s, a, N);
    exchange_counts(s, a, N, C);
    // With a capacity the bound, the same every step (the rows that arrived never exceed it while
    // every EP rank has N tokens; more would grow the buffers, as dropless does, not overflow them).
    const int R = std::max(expert_rows(N), a.received);
    grow(ops, a.x_exp, R, C), grow(ops, a.pre, R, act_width(Fl)), grow(ops, a.h, R, Fl);
    grow(ops, w.staging, R, C), grow(ops, w.y_exp, R, C), grow(ops, w.dh, R, Fl);
    if constexpr (Gated) grow(ops, w.dgu, R, 2 * Fl);

    // the rows to their experts: [E][...] here, [El][EP] there
    if constexpr (EP == 1) {
      ops.gather_rows(a.x_exp.data(), xf, a.token_of.data(), a.kept, C);
    } else {
      ops.gather_rows(w.rows.data(), xf, a.token_of.data(), a.kept, C);
      to_experts(s, a, w, w.rows.data(), a.x_exp.data(), C);
    }
    T* y_exp = EP == 1 ? a.y.data() : w.y_exp.data();
    // Experts j .. j+count-1, n rows each from row `off`: one GEMM per weight for them all.
    for_each_expert(a, [&](int j, int count, std::size_t off, int n) {
      const T* none = nullptr;
      const std::int64_t r = n;
      const std::size_t rows = static_cast<std::size_t>(count) * static_cast<std::size_t>(n);
      constexpr auto plain = ops_type::Epilogue::none;
      if constexpr (Gated) {  // h = silu(x Wg^T) * (x Wu^T); y = h Wd^T
        T* gu = a.pre.data() + off * 2 * Fl;
        ops.matmul(gu, a.x_exp.data() + off * C, p.fc_w + j * std::size_t(2 * Fl) * C, none, n, 2 * Fl, C, false, true,
                   false, plain, nullptr, {.count = count, .out = r * 2 * Fl, .a = r * C, .b = 2 * Fl * C});
        ops.swiglu_forward(a.h.data() + off * Fl, gu, static_cast<int>(rows), Fl);
        ops.matmul(y_exp + off * C, a.h.data() + off * Fl, p.proj_w + j * std::size_t(C) * Fl, none, n, C, Fl, false,
                   true, false, plain, nullptr, {.count = count, .out = r * C, .a = r * Fl, .b = C * Fl});
      } else {
        ops.matmul(a.h.data() + off * Fl, a.x_exp.data() + off * C, p.fc_w + j * std::size_t(C) * Fl,
                   p.fc_b + j * std::size_t(Fl), n, Fl, C, false, false, false, ops_type::Epilogue::gelu,
                   a.pre.data() + off * Fl,
                   {.count = count, .out = r * Fl, .a = r * C, .b = C * Fl, .bias = Fl, .pre_act = r * Fl});
        ops.matmul(y_exp + off * C, a.h.data() + off * Fl, p.proj_w + j * std::size_t(Fl) * C,
                   s.rank() == 0 ? p.proj_b + j * std::size_t(C) : none, n, C, Fl, false, false, false, plain, nullptr,
                   {.count = count, .out = r * C, .a = r * Fl, .b = Fl * C, .bias = C});
      }
    });
    if constexpr (EP > 1) from_experts(s, a, w, y_exp, a.y.data(), C);

    T* out = s.partial_buffer(y, partial);
    ops.moe_combine(out, a.y.data(), a.pos.data(), a.gate.data(), N, K, C);
    s.reduce_rows(out, y, C);
  }

  // dx (the stream's rows, "=") from dy; router and expert gradients "+=". x: the forward's
  // input (the stream's rows); full: [N, C] scratch when SP.
  static void backward(S& s, Saved& a, Work& w, T* dx, Params g, const T* dy, const T* x, Params p, int C, int F,
                       T* full) {
    const int N = s.rows(), Fl = F / S::tp;
    ops_type& ops = s.ops;
    const T* xf = S::sp ? a.x_full.data() : x;
    const T* dyf = s.gather_rows(dy, full, C);
    if constexpr (padded) ops.zero(w.rows.data(), static_cast<std::size_t>(a.kept) * C);  // empty slots: d(y) = 0
    ops.moe_combine_backward(w.rows.data(), w.dgate.data(), dyf, a.y.data(), a.pos.data(), a.gate.data(), N, K, C);
    s.comm.all_reduce(std::span<stat_t>(w.dgate.data(), static_cast<std::size_t>(N) * K));  // Partial over TP

    // d(y) to the experts; their backward leaves dx of their rows in place of d(y)
    T* d_exp = EP == 1 ? w.rows.data() : w.y_exp.data();
    if constexpr (EP > 1) to_experts(s, a, w, w.rows.data(), d_exp, C);
    // Each expert's input gradient now, its weights' as the weight half (Step::weight_grad):
    // the rows' d(y), dh and d(gate|up) are held (their buffers are reused), its rows' input
    // and activations stay in the slot.
    for_each_expert(a, [&](int j, int count, std::size_t off, int n) {
      T* dyj = d_exp + off * C;
      T* dh = w.dh.data() + off * Fl;
      const T* none = nullptr;
      const std::int64_t r = n;
      const std::size_t rows = static_cast<std::size_t>(count) * static_cast<std::size_t>(n);
      constexpr auto plain = ops_type::Epilogue::none;
      const T* xj = s.hold_saved(a.x_exp.data() + off * C, rows * C);
      const T* hj = s.hold_saved(a.h.data() + off * Fl, rows * Fl);
      if constexpr (Gated) {
        const T* wgu = p.fc_w + j * std::size_t(2 * Fl) * C;
        const T* wd = p.proj_w + j * std::size_t(C) * Fl;
        const T* gu = a.pre.data() + off * 2 * Fl;
        T* dgu = w.dgu.data() + off * 2 * Fl;
        T* nobias = nullptr;
        ops.matmul(dh, dyj, wd, none, n, Fl, C, false, false, false, plain, nullptr,  // dh = dy Wd
                   {.count = count, .out = r * Fl, .a = r * C, .b = C * Fl});
        linear_weight_grad<TorchLinear>(s, g.proj_w + j * std::size_t(C) * Fl, nobias, s.hold(dyj, rows * C), hj, n,
                                        Fl, C, {.count = count, .dw = C * Fl, .dy = r * C, .x = r * Fl});
        ops.swiglu_backward(dgu, dh, gu, static_cast<int>(rows), Fl);
        linear_weight_grad<TorchLinear>(s, g.fc_w + j * std::size_t(2 * Fl) * C, nobias, s.hold(dgu, rows * 2 * Fl),
                                        xj, n, C, 2 * Fl, {.count = count, .dw = 2 * Fl * C, .dy = r * 2 * Fl, .x = r * C});
        ops.matmul(dyj, dgu, wgu, none, n, C, 2 * Fl, false, false, false, plain, nullptr,  // dx of the rows
                   {.count = count, .out = r * C, .a = r * 2 * Fl, .b = 2 * Fl * C});
        return;
      }
      const T* w1 = p.fc_w + j * std::size_t(C) * Fl;
      // dh: the gradient at the GELU's input (its backward in the GEMM)
      ops.matmul_dgelu(dh, dyj, p.proj_w + j * std::size_t(Fl) * C, a.pre.data() + off * Fl, n, Fl, C, false, true,
                       {.count = count, .out = r * Fl, .a = r * C, .b = Fl * C, .pre_act = r * Fl});
      linear_weight_grad<Conv1D>(s, g.proj_w + j * std::size_t(Fl) * C, g.proj_b + j * std::size_t(C),
                                 s.hold(dyj, rows * C), hj, n, Fl, C,
                                 {.count = count, .dw = Fl * C, .db = C, .dy = r * C, .x = r * Fl});
      linear_weight_grad<Conv1D>(s, g.fc_w + j * std::size_t(C) * Fl, g.fc_b + j * std::size_t(Fl),
                                 s.hold(dh, rows * Fl), xj, n, C, Fl,
                                 {.count = count, .dw = C * Fl, .db = Fl, .dy = r * Fl, .x = r * C});
      ops.matmul(dyj, dh, w1, none, n, C, Fl, false, true, false, plain, nullptr,  // dx of the rows
                 {.count = count, .out = r * C, .a = r * Fl, .b = C * Fl});
    });
    if constexpr (EP > 1) from_experts(s, a, w, d_exp, w.rows.data(), C);

    // the router, then every token's rows added up
    T* out = s.partial_buffer(dx, full);
    T* dlogits = w.logits.data();
    ops.router_backward(dlogits, w.dgate.data(), a.scores.data(), a.expert.data(), a.gate.data(),
                        coef > 0 ? a.daux.data() : static_cast<const stat_t*>(nullptr), N, E, K, renormalize, sigmoid);
    linear_weight_grad<RouterW>(s, g.router, static_cast<T*>(nullptr), s.hold(dlogits, static_cast<std::size_t>(N) * E),
                                s.hold_saved(xf, static_cast<std::size_t>(N) * C), N, C, E);
    if (s.rank() == 0)
      ops.matmul(out, dlogits, p.router, static_cast<const T*>(nullptr), N, C, E, false, !RouterW::transposed);
    else ops.zero(out, static_cast<std::size_t>(N) * C);
    ops.moe_dispatch_backward(out, w.rows.data(), a.pos.data(), N, K, C);
    s.reduce_rows(out, dx, C);
  }

 private:
  template <class U>
  static void grow(ops_type& ops, buffer<U>& b, int rows, int width) {
    const std::size_t n = static_cast<std::size_t>(std::max(rows, 1)) * static_cast<std::size_t>(width);
    if (b.size() < n) b = ops.template make_buffer<U>(n);
  }

  // f(first local expert j, count, first row, rows each) over the local experts with rows
  // ([El][EP] order): padded, all El at once, each EP·capacity rows (their GEMMs one strided
  // batch: Ops::Batch); else one expert at a time, as many rows as it got.
  template <class F>
  static void for_each_expert(const Saved& a, F&& f) {
    if constexpr (padded) {
      const int n = static_cast<int>(a.received / El);  // every peer sends each expert `capacity` rows
      if (n > 0) f(0, El, std::size_t{0}, n);
      return;
    }
    std::size_t off = 0;
    for (int j = 0; j < El; ++j) {
      std::int64_t n = 0;
      for (int q = 0; q < EP; ++q) n += a.from[static_cast<std::size_t>(q) * El + j];
      if (n > 0) f(j, 1, off, static_cast<int>(n));
      off += static_cast<std::size_t>(n);
    }
  }

  // The balancing loss's gradient from this micro-batch's kept rows and score sums per
  // expert, summed over CP (the replica's tokens) in device memory: balance, which also
  // gives the loss's value when it is read (aux_loss).
  static void balancing_loss(S& s, Saved& a, int N) {
    if constexpr (coef > 0) {
      s.ops.copy(a.balance.data(), a.loads.data(), E);
      s.ops.router_score_sums(a.balance.data() + E, a.scores.data(), N, E);
      s.cp_comm.all_reduce(std::span<stat_t>(a.balance.data(), 2 * static_cast<std::size_t>(E)));
      // d aux / d score = coef · E · f_e / N, times CP: the replica's gradient is averaged over CP
      const double assignments = static_cast<double>(N) * S::cp * K;
      s.ops.scale_acc(a.daux.data(), a.balance.data(), E, coef * E / (assignments * N));
    }
  }

  // Counts first: how many rows of each of its experts every peer sends (padded: capacity).
  static void exchange_counts(S& s, Saved& a, int N, int C) {
    if constexpr (padded) {
      const int cap = capacity(N);
      std::fill(a.from.begin(), a.from.end(), cap);
      std::fill(a.send.begin(), a.send.end(), static_cast<std::size_t>(El) * cap * C);
      std::fill(a.recv.begin(), a.recv.end(), static_cast<std::size_t>(El) * cap * C);
      a.kept = E * cap;
    } else if constexpr (EP == 1) {
      a.kept = 0;
      for (int c : a.counts) a.kept += c;
      for (int e = 0; e < E; ++e) a.from[static_cast<std::size_t>(e)] = a.counts[static_cast<std::size_t>(e)];
    } else {
      a.kept = 0;
      for (int c : a.counts) a.kept += c;
      std::array<std::int64_t, E> mine{};
      for (int e = 0; e < E; ++e) mine[static_cast<std::size_t>(e)] = a.counts[static_cast<std::size_t>(e)];
      s.ep_comm->all_to_all_host(std::span<const std::int64_t>(mine), std::span<std::int64_t>(a.from));
      for (int q = 0; q < EP; ++q) {
        std::int64_t out = 0, in = 0;
        for (int j = 0; j < El; ++j) out += mine[static_cast<std::size_t>(q) * El + j], in += a.from[static_cast<std::size_t>(q) * El + j];
        a.send[static_cast<std::size_t>(q)] = static_cast<std::size_t>(out) * C;
        a.recv[static_cast<std::size_t>(q)] = static_cast<std::size_t>(in) * C;
      }
    }
    a.received = 0;
    for (std::int64_t n : a.from) a.received += static_cast<int>(n);
  }

  // [peer][j] blocks (as they arrive) <-> [j][peer] (each expert's rows together). Block
  // (q, j) starts at the sum of the blocks before it in either order; `at[j]` walks the
  // expert-major starts while q advances.
  static void regroup(S& s, const Saved& a, T* dst, const T* src, int C, bool to_expert_major) {
    std::array<std::size_t, El> at{};
    for (int j = 1; j < El; ++j)
      for (int q = 0; q < EP; ++q) at[static_cast<std::size_t>(j)] += static_cast<std::size_t>(a.from[static_cast<std::size_t>(q) * El + j - 1]);
    for (int j = 1; j < El; ++j) at[static_cast<std::size_t>(j)] += at[static_cast<std::size_t>(j - 1)];
    std::size_t peer_major = 0;
    for (int q = 0; q < EP; ++q)
      for (int j = 0; j < El; ++j) {
        const std::size_t rows = static_cast<std::size_t>(a.from[static_cast<std::size_t>(q) * El + j]);
        std::size_t& expert_major = at[static_cast<std::size_t>(j)];
        if (to_expert_major) s.ops.copy(dst + expert_major * C, src + peer_major * C, rows * C);
        else s.ops.copy(dst + peer_major * C, src + expert_major * C, rows * C);
        expert_major += rows, peer_major += rows;
      }
  }
  // rows in dispatch order -> the experts' rows on their ranks ([El][EP]).
  static void to_experts(S& s, Saved& a, Work& w, const T* rows, T* dst, int C) {
    s.ep_comm->template all_to_all_v<T>(std::span<const T>(rows, static_cast<std::size_t>(a.kept) * C), a.send,
                                        std::span<T>(w.staging.data(), static_cast<std::size_t>(a.received) * C), a.recv);
    regroup(s, a, dst, w.staging.data(), C, true);
  }
  // ... and back.
  static void from_experts(S& s, Saved& a, Work& w, const T* src, T* rows, int C) {
    regroup(s, a, w.staging.data(), src, C, false);
    s.ep_comm->template all_to_all_v<T>(std::span<const T>(w.staging.data(), static_cast<std::size_t>(a.received) * C),
                                        a.recv, std::span<T>(rows, static_cast<std::size_t>(a.kept) * C), a.send);
  }
};

}  // namespace fived
