#pragma once
// The residual stream of a GPT on one rank, and the two collectives that move it across
// the TP axis (Megatron's conjugate f and g).
//
// Activations are row-major [B*T, C]: one row per token, batch-major ([B, T, C]), which is
// what the attention and embedding kernels read. Sequence parallelism shards the stream's
// ROWS over TP: rank r holds rows [r*N/TP, (r+1)*N/TP) of the N = B*T tokens, i.e. the
// stream is placed Shard<0> on TP (Replicate without SP). That piece is contiguous, so the
// all-gather and reduce-scatter below move whole buffers with no pack or unpack kernel;
// LayerNorm, the residual adds and the position embedding are per token, so any split of
// the tokens serves them. (Megatron orders activations [T, B, C] to make its sequence
// shards contiguous; splitting the flattened tokens gets the same contiguity without
// reordering the kernels. Context parallelism splits each sequence itself, and its ring
// exchanges whole local blocks.)
//
//   gather_rows   the stream -> every row:   all-gather (SP)    identity (no SP, TP 1)
//   reduce_rows   a Partial sum -> stream:   reduce-scatter     all-reduce  (TP 1: nothing)
//
// These are redistribute's Shard<0> -> Replicate and Partial -> Shard<0> | Replicate
// (place/redistribute.hpp) on a leading dimension, and each is the other's backward:
// a column-parallel layer gathers forward and reduces its input gradient backward; a
// row-parallel one reduces forward and gathers its output gradient backward.
//
// Step<M, T, Device, SP> is what a layer's forward and backward work with: the device's
// kernels (Ops), the TP and CP communicators (and EP's, for a mixture of experts), and the micro-batch's shape on this rank. A
// layer writes a Partial sum into partial_buffer(out, scratch): `out` itself unless SP must
// scatter it.
//
// Context parallelism: the rank holds T_ = T / CP tokens of each sequence, two chunks of the
// zig-zag split (context/zigzag.hpp) stored chunk-major, [chunks, B, n]; each chunk is a
// batch of B sequences of n that starts at position chunk_position(c). At CP 1 that is one
// chunk, [1, B, T_], at position 0: the serial layout.

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fived/mesh/mesh_comm.hpp"
#include "fived/context/row_positions.hpp"
#include "fived/context/zigzag.hpp"
#include "fived/mesh/mesh.hpp"
#include "fived/nn/ops.hpp"
#include "fived/nn/weight_grads.hpp"
#include "fived/place/placement.hpp"
#include "fived/place/redistribute.hpp"

namespace fived {

// Sequence parallelism as a policy: the residual stream, LayerNorms and residual adds are
// split over TP by tokens.
struct SequenceParallel {
  static constexpr bool enabled = true;
};
struct NoSequenceParallel {
  static constexpr bool enabled = false;
};

template <MeshType M, class T, class Device, class SP>
struct Step {
  using ops_type = Ops<T, Device>;
  using value_type = T;
  using device = Device;
  using stat_t = typename ops_type::stat_t;
  static constexpr int tp = M::extent(Axis::tp);
  static constexpr int cp = M::extent(Axis::cp);
  static constexpr bool sp = SP::enabled && tp > 1;
  using split = ZigZag<cp>;
  static constexpr int chunks = cp > 1 ? 2 : 1;
  using stream_placement = std::conditional_t<sp, Shard<0>, Replicate>;
  static_assert(Transition<stream_placement, Replicate>::forward == (sp ? Collective::all_gather : Collective::none) &&
                Transition<Partial, stream_placement>::forward ==
                    (sp ? Collective::reduce_scatter : Collective::all_reduce));

  static constexpr int ep = M::ep;
  using ep_comm_type = MeshComm<typename M::expert_group>;

  ops_type& ops;
  AxisComm<M, Axis::tp>& comm;
  AxisComm<M, Axis::cp>& cp_comm;
  int B = 0, T_ = 0;  // T_: this rank's tokens of each sequence
  ep_comm_type* ep_comm = nullptr;  // a mixture of experts' all-to-all (EP > 1)
  // Documents packed into the rows (context/documents.hpp): each local row's document start
  // [N] (device memory, laid out as the rows), which attention keeps within; null: none.
  const int* doc_first = nullptr;
  // A split backward (the model's backward_input): weight gradients go on this tape and run
  // at backward_weight (nn/weight_grads.hpp). None: they run where they stand.
  WeightGradTape<ops_type>* tape = nullptr;
  bool recomputed = false;  // the block's saved activations live in buffers shared by every block (FullRecompute)

  // A layer's weight gradient, f(ops): now, or at backward_weight when the backward is split.
  // f captures by value ([=]); what it reads that backward overwrites, it reads through hold().
  template <class F>
  void weight_grad(const F& f) {
    if (tape != nullptr) tape->add(f);
    else f(ops);
  }
  // Whether weight gradients wait for backward_weight. When they do not, a layer whose two
  // halves read the same tensors (a norm's) runs them as one pass.
  bool defers_weight_grads() const { return tape != nullptr; }
  // What a deferred weight gradient reads of n elements at p that backward overwrites (a
  // layer's output gradient in a shared buffer): p itself, or a snapshot when the backward is split.
  template <class U>
  const U* hold(const U* p, std::size_t n) {
    return tape != nullptr ? tape->keep(ops, p, n) : p;
  }
  // The same for a saved activation: the slot keeps it, unless the block recomputes it.
  template <class U>
  const U* hold_saved(const U* p, std::size_t n) {
    return recomputed ? hold(p, n) : p;
  }

  int chunk_length() const { return T_ / chunks; }  // n
  // The position in the sequence of local chunk c's first token.
  int chunk_position(int c) const {
    if constexpr (cp == 1) return 0;
    else return split::chunks_of(cp_comm.rank())[static_cast<std::size_t>(c)] * chunk_length();
  }

  // Every row's position in its sequence (rotary embeddings): chunk-major, as above.
  RowPositions positions() const {
    return {B * chunk_length(), chunk_length(), {chunk_position(0), chunk_position(chunks - 1)}};
  }

  int rows() const { return B * T_; }                    // N: every token of the micro-batch
  int local_rows() const { return rows() / (sp ? tp : 1); }  // n: the stream's rows on this rank
  int rank() const { return comm.rank(); }

  // x: the stream's rows [n, C]. Returns every row [N, C]: x itself, or gathered into buf.
  const T* gather_rows(const T* x, T* buf, int C) {
    if constexpr (!sp) return x;
    else {
      comm.all_gather(span(x, local_rows(), C), span(buf, rows(), C));
      return buf;
    }
  }
  // partial: a Partial sum [N, C] (from partial_buffer(out, ...)) -> out, the stream's rows.
  void reduce_rows(T* partial, T* out, int C) {
    if constexpr (sp) comm.reduce_scatter(span(partial, rows(), C), span(out, local_rows(), C));
    else comm.all_reduce(span(partial, rows(), C));
  }
  T* partial_buffer(T* out, T* scratch) const { return sp ? scratch : out; }

 private:
  static std::span<T> span(T* p, int rows, int C) {
    return {p, static_cast<std::size_t>(rows) * static_cast<std::size_t>(C)};
  }
  static std::span<const T> span(const T* p, int rows, int C) {
    return {p, static_cast<std::size_t>(rows) * static_cast<std::size_t>(C)};
  }
};

// Pointers the decoder lends a block for one forward or backward: the stream-sized scratch
// rows ([n, C] each) and, under sequence parallelism, [N, C] for gathered rows or partial sums.
template <class T>
struct StreamScratch {
  T* out;      // forward: a sublayer's output before the residual add
  T* dln;      // backward: the gradient at a norm's output
  T* partial;  // SP only
};

}  // namespace fived
