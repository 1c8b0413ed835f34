#pragma once
// The weight half of a split backward: what a zero-bubble pipeline runs at W
// (pipeline/action.hpp), after the input half it runs at I.
//
// A layer's backward makes two kinds of gradient: its input's, which the layer before it
// (and the stage before this one) waits for, and its weights', which nobody needs until
// the optimizer step. A model's backward_input runs the first and leaves the second on a
// tape, as kernel calls not yet made; backward_weight makes them in the order they were
// left, so the gradients are bit for bit those of the whole backward, which makes each call
// where it stands (Megatron's WeightGradStore, with no closure on the heap).
//
// A deferred call reads its operands when it runs. What the micro-batch's activation slot
// keeps until then (its saved activations, the d-logits) it reads in place; what backward
// leaves in buffers that the next layer or micro-batch overwrites (a layer's output
// gradient, activations recomputed into shared buffers) it reads from a snapshot, taken
// when the call is left: keep(ops, p, n) copies n elements into the tape's arena, in stream
// order, and returns where they are. Layers do not see the tape: they call Step::weight_grad
// and Step::hold (nn/stream.hpp).
//
// A model keeps a pool of tapes, one for each micro-batch between its I and its W (the
// schedule's "awaiting W" count: 1 on ZB-H1's first stage, P on its last). A tape's arena
// grows on the first steps (a chunk more when one runs out, never moved, so snapshots stay
// where they are; after the run, one chunk of the bytes taken, each snapshot rounded up to
// 256) and is reused after: a steady-state step allocates nothing. (A mixture of experts'
// snapshots depend on the routing: its tapes grow to the largest backward seen, as its
// saved rows do.)

#include <algorithm>
#include <cstddef>
#include <functional>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace fived {

template <class Ops>
class WeightGradTape {
 public:
  // The most a deferred call may capture: a few pointers and sizes.
  static constexpr std::size_t capture_bytes = 128;

  // Unit u's deferred calls start here (units run from the last to 0, as in backward).
  void begin_unit(int u) { units_.push_back({u, calls_.size()}); }

  // f(ops) at run(): a lambda that captures by value, pointers and sizes only.
  template <class F>
  void add(const F& f) {
    static_assert(std::is_trivially_copyable_v<F> && std::is_trivially_destructible_v<F>,
                  "a deferred weight gradient captures pointers and sizes by value ([=]), nothing that owns memory");
    static_assert(sizeof(F) <= capture_bytes && alignof(F) <= alignof(std::max_align_t),
                  "a deferred weight gradient captures at most WeightGradTape::capture_bytes");
    if (units_.empty()) throw std::logic_error("WeightGradTape: a weight gradient left outside any unit");
    Call& c = calls_.emplace_back();
    ::new (static_cast<void*>(c.capture)) F(f);
    c.run = [](Ops& ops, void* p) { (*std::launder(static_cast<F*>(p)))(ops); };
  }

  // A snapshot of n elements at p, in the arena until run() is done.
  template <class U>
  const U* keep(Ops& ops, const U* p, std::size_t n) {
    if (n == 0) return p;
    U* dst = reinterpret_cast<U*>(take(ops, n * sizeof(U)));
    ops.copy(dst, p, n);
    return dst;
  }

  // Every deferred call, unit by unit: begin(u), u's calls, end(u). Then the tape is empty
  // and its arena free for the next backward.
  template <class Begin, class End>
  void run(Ops& ops, Begin&& begin, End&& end) {
    for (std::size_t i = 0; i < units_.size(); ++i) {
      const std::size_t last = i + 1 < units_.size() ? units_[i + 1].first : calls_.size();
      begin(units_[i].unit);
      for (std::size_t j = units_[i].first; j < last; ++j) calls_[j].run(ops, calls_[j].capture);
      end(units_[i].unit);
    }
    units_.clear();
    calls_.clear();
    // One chunk of what this backward took (never less than before), for the next. (On a device
    // the calls just queued still read the old chunks: cudaFree waits for the device first.)
    if (chunks_.size() > 1) {
      const std::size_t bytes = std::max(taken_, chunks_.front().size());
      chunks_.clear();
      chunks_.push_back(ops.template make_buffer<std::byte>(bytes));
    }
    chunk_ = 0, used_ = 0, taken_ = 0;
  }

  // Bytes the arena holds (all chunks).
  std::size_t arena_bytes() const {
    std::size_t n = 0;
    for (const auto& c : chunks_) n += c.size();
    return n;
  }

 private:
  using Chunk = typename Ops::template buffer<std::byte>;
  static constexpr std::size_t alignment = 256;  // plan/activations.hpp's deferred_bytes rounds alike

  struct Call {
    void (*run)(Ops&, void*) = nullptr;
    alignas(std::max_align_t) std::byte capture[capture_bytes];
  };
  struct Unit {
    int unit;
    std::size_t first;  // its first call
  };

  std::byte* take(Ops& ops, std::size_t bytes) {
    bytes = (bytes + alignment - 1) / alignment * alignment;
    while (chunk_ < chunks_.size() && used_ + bytes > chunks_[chunk_].size()) ++chunk_, used_ = 0;
    if (chunk_ == chunks_.size()) {  // a chunk as large as all before it (or the request)
      chunks_.push_back(ops.template make_buffer<std::byte>(std::max(bytes, arena_bytes())));
      used_ = 0;
    }
    std::byte* p = chunks_[chunk_].data() + used_;
    used_ += bytes, taken_ += bytes;
    return p;
  }

  std::vector<Unit> units_;
  std::vector<Call> calls_;
  std::vector<Chunk> chunks_;
  std::size_t chunk_ = 0, used_ = 0;  // where the next snapshot goes
  std::size_t taken_ = 0;             // bytes of snapshots since the last run
};

// The tapes of the micro-batches between their backward_input and backward_weight: a tape is
// taken by one and given back by the other, and a given-back tape keeps its arena for the
// next (no allocation in a steady step). take() hands out the lowest free tape, a new one
// when none is free: the first step, which makes them, and every step after hand the same
// tape to the same micro-batch, so a step replayed as a graph (nn/step_graph.hpp) finds its
// snapshots where the captured step left them.
template <class Ops>
class WeightGradTapes {
 public:
  int take() {
    if (free_.empty()) free_.push_back(static_cast<int>(tapes_.size())), tapes_.emplace_back();
    const int t = free_.back();  // the lowest: free_ is kept in falling order
    free_.pop_back();
    return t;
  }
  void give_back(int t) { free_.insert(std::upper_bound(free_.begin(), free_.end(), t, std::greater<>()), t); }
  WeightGradTape<Ops>& operator[](int t) { return tapes_[static_cast<std::size_t>(t)]; }

 private:
  std::vector<WeightGradTape<Ops>> tapes_;
  std::vector<int> free_;
};

}  // namespace fived
