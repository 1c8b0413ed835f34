#pragma once
// Ring attention: causal self-attention of sequences split over the CP axis (context
// parallelism), forward and backward.
//
// Each rank holds two chunks of every sequence (the zig-zag split, context/zigzag.hpp),
// chunk-major: its q, k and v are [2, B, n] blocks of rows of qkv. The keys and values
// travel round the CP ring: at step s a rank holds those of rank r - s, computes the blocks
// ring_blocks lists (full for chunks in the past, causal on the diagonal, none for the
// future) and merges each into its queries' output with the block's log-sum-exp, in
// stat_t (ops: attention_block_forward). After CP steps every query has met every key in
// its past, and the output is rounded to T once.
//
// Backward: the keys and values go round again (the forward kept only the merged output and
// its log-sum-exp, as flash attention does), with an accumulator of their gradient that
// each rank adds its queries' share to and passes on. After the CP-th hop the accumulator
// is back with the rank that owns those keys and values, complete. dq stays local.
//
//   forward:  the packed [k | v] of the local rows (copy_rows), then per step: send the
//             block in hand on and receive the next (double buffer), compute this step's
//             blocks
//   backward: per step: the same for [k | v], and the accumulator the last step finished
//             sent on while the one for the block in hand arrives; this step's blocks
//             computed into a share of their own, added to the arrived accumulator; after
//             the last step, one more hop brings each rank its own
//
// Each exchange is one grouped send_recv to the next rank and from the previous one over
// the CP communicator (AxisComm<M, Axis::cp>). Both travel while this step's blocks run
// (send_recv_begin; on a device the compute stream waits for them only at the step's end:
// MeshComm::join): the blocks read the [k | v] in hand and write their own share, and leave
// the buffers in flight alone. The next step's exchange writes into this step's buffers only
// after its blocks (a communicator's call follows the compute queued before it). The
// buffers are allocated once (Work, with the model's other work buffers); no step reuses a
// block it did not just receive.
//
// Why a share of its own: the accumulator for the block in hand is finished by the
// previous rank in the same step, so adding into it directly would wait for its arrival
// before the blocks could start. The share costs a zero and an add of [N, 2 Ckv] a step.

#include <cstddef>
#include <span>

#include "fived/comm/types.hpp"
#include "fived/context/zigzag.hpp"
#include "fived/device/buffer.hpp"
#include "fived/nn/context_rows.hpp"

namespace fived {

template <class S, int Heads, int KVHeads = Heads>
struct RingAttention {
  using T = typename S::value_type;
  using stat_t = typename S::stat_t;
  using Device = typename S::device;
  using Shape = ContextRows<S, Heads, KVHeads>;

  // Shared by every micro-batch slot: the ring's buffers for N local rows, Cl channels of the
  // query heads and Ckv of the key/value heads, beside the accumulators (o, dq, Dd, dqkv).
  struct Work : Shape::Accumulators {
    Buffer<T, Device> kv[2];         // packed [k | v], [N, 2 Ckv]: the block in hand and the next
    Buffer<stat_t, Device> dkv[2];   // the travelling d[k | v], [N, 2 Ckv]: the one sent on and the one arriving
    Buffer<stat_t, Device> share;    // this step's blocks' part of d[k | v] for the block in hand, [N, 2 Ckv]
    std::size_t capacity = 0;

    void reserve(typename S::ops_type& ops, std::size_t N, std::size_t Cl) {
      if (N <= capacity) return;
      capacity = N;
      Shape::Accumulators::reserve(ops, N, Cl);
      const std::size_t kv_n = N * 2 * static_cast<std::size_t>(Shape::kv_channels(static_cast<int>(Cl)));
      for (auto& b : kv) b = ops.template make_buffer<T>(kv_n);
      for (auto& b : dkv) b = ops.template make_buffer<stat_t>(kv_n);
      share = ops.template make_buffer<stat_t>(kv_n);
    }
  };

  // atty [N, Cl] and lse [2, B, Heads, n] from qkv [N, Cl + 2 Ckv] (this rank's rows, chunk-major).
  static void forward(S& s, Work& w, T* atty, stat_t* lse, const T* qkv, int Cl) {
    const Shape z(s, Cl);
    bool seen[2] = {false, false};
    walk_ring(s, w, z, qkv, Cl, [](int) { return false; }, [&](const RingBlock& b, const T* k, int step) {
      s.ops.attention_block_forward(w.o.data() + z.chunk(b.q) * Cl, lse + z.stats(b.q), qkv + z.chunk(b.q) * z.ld_qkv,
                                    k, k + z.Ckv, z.ld_qkv, z.ld_kv, s.B, z.n, Cl, Heads, KVHeads, b.causal,
                                    documents(s, z, b, step), !seen[b.q]);
      seen[b.q] = true;
    }, [](int) {});
    s.ops.from_acc(atty, w.o.data(), z.N * static_cast<std::size_t>(Cl));
  }

  // dqkv [N, Cl + 2 Ckv] ("=") from datty, with the forward's qkv, atty and lse.
  static void backward(S& s, Work& w, T* dqkv, const T* datty, const T* qkv, const T* atty, const stat_t* lse, int Cl) {
    const Shape z(s, Cl);
    auto& ops = s.ops;
    z.row_dots(s, w.Dd.data(), datty, atty);
    ops.zero(w.dq);
    const std::size_t kv_n = z.N * z.ld_kv;
    // Step 0's blocks (this rank's own keys and values) start their accumulator; each later
    // step's blocks write the share that is added to the accumulator arriving beside them.
    auto into = [&](int step) { return step == 0 ? w.dkv[0].data() : w.share.data(); };
    walk_ring(s, w, z, qkv, Cl, [&](int step) {
      ops.zero(into(step), kv_n);
      if (step == 0) return false;
      pass_on(s, w.dkv[(step + 1) % 2], w.dkv[step % 2], kv_n, true);  // the last step's on, this one's in
      return true;
    }, [&](const RingBlock& b, const T* k, int step) {
      stat_t* dk = into(step) + z.chunk(b.k) * z.ld_kv;
      ops.attention_block_backward(w.dq.data() + z.chunk(b.q) * Cl, dk, dk + z.Ckv, z.ld_kv,
                                   datty + z.chunk(b.q) * Cl, w.Dd.data() + z.stats(b.q), lse + z.stats(b.q),
                                   qkv + z.chunk(b.q) * z.ld_qkv, k, k + z.Ckv, z.ld_qkv, z.ld_kv, s.B, z.n, Cl, Heads,
                                   KVHeads, b.causal, documents(s, z, b, step));
    }, [&](int step) {
      if (step > 0) ops.add_acc(w.dkv[step % 2].data(), w.share.data(), kv_n);
    });
    // the last hop: each rank's own d[k | v] comes back, complete
    pass_on(s, w.dkv[(S::cp + 1) % 2], w.dkv[S::cp % 2], kv_n);
    z.assemble_dqkv(s, dqkv, w.dqkv.data(), w.dq.data(), w.dkv[S::cp % 2].data());
  }

 private:
  // Block b's documents' mask at ring step `step`, whose keys are those of rank r - step.
  static DocumentMask documents(const S& s, const Shape& z, const RingBlock& b, int step) {
    const int r = s.cp_comm.rank(), owner = (r - step + S::cp) % S::cp;
    return z.documents(s, b.q, S::split::chunks_of(owner)[static_cast<std::size_t>(b.k)]);
  }

  // The ring, shared by forward and backward: this rank's [k | v] packed into kv[0], then per
  // step the block in hand passed on and begin_step(step) (which returns whether it began an
  // exchange of its own) while block(b, k of b's key chunk, step) runs over the step's blocks
  // (ring_blocks); after_step(step) once what travelled has arrived.
  template <class BeginStep, class Block, class AfterStep>
  static void walk_ring(S& s, Work& w, const Shape& z, const T* qkv, int Cl, BeginStep&& begin_step, Block&& block,
                        AfterStep&& after_step) {
    s.ops.copy_rows(w.kv[0].data(), z.ld_kv, qkv + Cl, z.ld_qkv, z.ld_kv, z.N);
    for (int step = 0; step < S::cp; ++step) {
      const int cur = step % 2;
      const bool kv_on = step + 1 < S::cp;
      if (kv_on) pass_on(s, w.kv[cur], w.kv[1 - cur], z.N * z.ld_kv, true);  // beside the blocks
      const bool own = begin_step(step);
      const RingStep plan = ring_blocks<typename S::split>(s.cp_comm.rank(), step);
      for (int i = 0; i < plan.count; ++i) {
        const RingBlock& b = plan.blocks[static_cast<std::size_t>(i)];
        block(b, static_cast<const T*>(w.kv[cur].data() + z.chunk(b.k) * z.ld_kv), step);
      }
      if (kv_on || own) s.cp_comm.join();  // what travelled beside the blocks has arrived
      after_step(step);
    }
  }

  // Sends the first `count` elements of `held` to the next rank of the ring and receives the
  // previous rank's into `next`; begin: waited for at the next join.
  template <class E>
  static void pass_on(S& s, Buffer<E, Device>& held, Buffer<E, Device>& next, std::size_t count, bool begin = false) {
    const int P = S::cp, r = s.cp_comm.rank();
    const SendOp<E> send{std::span<const E>(held.data(), count), (r + 1) % P};
    const RecvOp<E> recv{std::span<E>(next.data(), count), (r + P - 1) % P};
    const std::span<const SendOp<E>> sends(&send, 1);
    const std::span<const RecvOp<E>> recvs(&recv, 1);
    if (begin) s.cp_comm.send_recv_begin(sends, recvs);
    else s.cp_comm.send_recv(sends, recvs);
  }
};

}  // namespace fived
