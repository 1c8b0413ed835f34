#pragma once
// A decoder's activations (nn/decoder.hpp), sized for B*T at run time: one Slot per
// micro-batch in flight, holding what its backward needs of its forward, and the Work every
// forward and backward shares. Each is allocated on the first forward that needs it and
// again only when a larger B*T comes, never inside a steady-state step.
//
//   DecoderSlot<Step, Block, Norm, Head, Part> slot;   slot.reserve(ops, N, n)
//   DecoderWork<Step, Block, Part> work;               work.reserve(ops, N, n)
//
// N: the rows of the micro-batch on this rank (B*T, or B*T/CP); n: the stream's rows this
// rank holds (N, or N/TP under sequence parallelism). Part says which blocks, whether the
// part has the head, the width and the recompute policy.

#include <cstddef>
#include <vector>

#include "fived/device/buffer.hpp"

namespace fived {

// What sizes a part's activations: its blocks [first, first + blocks), whether it ends the
// model, its width C and padded vocabulary Vp, and whether whole blocks are recomputed.
struct SlotShape {
  int first = 0, blocks = 0;
  bool head = false, whole_block = false;
  std::size_t C = 0, Vp = 0;
  std::size_t balance = 0;  // the balancing statistics of the part's MoE blocks (stat_t elements)
  bool documents = false;   // rows of packed documents: each token's document start is kept
};

template <class Step, class Block, class Norm, class Head>
struct DecoderSlot {
  using T = typename Step::value_type;
  using Device = typename Step::device;

  std::size_t capacity = 0;  // B*T the buffers hold
  Buffer<int, Device> tokens, targets;
  Buffer<int, Device> doc_first;  // packed documents: each row's document start (context/documents.hpp)
  Buffer<T, Device> encoded;
  std::vector<typename Block::Saved> blocks;  // none under FullRecompute: one shared in the Work
  std::vector<Buffer<T, Device>> out;         // each block's output: the next block's input
  typename Norm::Saved lnf;
  typename Head::Saved head;
  Buffer<typename Step::stat_t, Device> balance;  // the MoE blocks' balancing statistics, read for aux_loss
  int B = 0, T_ = 0;
  const T* output = nullptr;  // the stream leaving the part (parts without the head)
  bool has_dlogits = false;   // forward done, backward may run (d-logits written, with a head)
  mutable bool loss_pending = false;  // the statistics of the last forward are not summed yet
  mutable double loss = 0;
  int tape = -1;  // the tape holding backward_input's weight gradients, until backward_weight

  template <class Ops>
  void reserve(Ops& ops, std::size_t N, std::size_t n, const SlotShape& sh) {
    if (N <= capacity) return;
    DecoderSlot s;
    s.capacity = N;
    s.tokens = ops.template make_buffer<int>(N);
    s.targets = ops.template make_buffer<int>(N);
    if (sh.documents) s.doc_first = ops.template make_buffer<int>(N);
    s.encoded = ops.template make_buffer<T>(n * sh.C);
    if (!sh.whole_block) s.blocks.resize(static_cast<std::size_t>(sh.blocks));
    if (sh.balance > 0) s.balance = ops.template make_buffer<typename Step::stat_t>(sh.balance);
    for (int l = 0; l < sh.blocks; ++l) {
      if (!sh.whole_block) s.blocks[static_cast<std::size_t>(l)].reserve(ops, N, n, sh.first + l, 1);
      s.out.push_back(ops.template make_buffer<T>(n * sh.C));
    }
    if (sh.head) {
      s.lnf.reserve(ops, n, sh.C);
      s.head.reserve(ops, N, sh.C, sh.Vp);
    }
    *this = std::move(s);
  }
};

// Shared by every slot: what one forward or backward uses and leaves behind.
template <class Step, class Block>
struct DecoderWork {
  using T = typename Step::value_type;
  using Device = typename Step::device;

  std::size_t capacity = 0;
  Buffer<T, Device> out, dres, dln;  // the stream's rows [n, C]
  Buffer<T, Device> partial;         // SP: [N, C] gathered rows or partial sums
  typename Block::Work block;        // the blocks' own (shared) buffers
  typename Block::Saved rerun;       // FullRecompute: the block being run again,
  Buffer<T, Device> rerun_out;       // and its output

  template <class Ops>
  void reserve(Ops& ops, std::size_t N, std::size_t n, const SlotShape& sh) {
    if (N <= capacity) return;
    DecoderWork w;
    w.capacity = N;
    w.out = ops.template make_buffer<T>(n * sh.C);
    w.dres = ops.template make_buffer<T>(n * sh.C);
    w.dln = ops.template make_buffer<T>(n * sh.C);
    if (Step::sp) w.partial = ops.template make_buffer<T>(N * sh.C);
    w.block.reserve(ops, N, n, sh.first, sh.blocks);
    if (sh.whole_block) {
      w.rerun.reserve(ops, N, n, sh.first, sh.blocks);
      w.rerun_out = ops.template make_buffer<T>(n * sh.C);
    }
    *this = std::move(w);
  }
};

}  // namespace fived
