#pragma once
// A training step captured once as a graph and replayed at every step after: the device's
// work is launched as one graph, while the step's host code still runs each time, so that
// everything the host keeps (the optimizer's step count, the trainers' bookkeeping) stays
// true without a second path through the step.
//
//   GraphStep graph(model.ops(), shape);   // plain, capturing or replaying (below)
//   ... the step: every kernel, copy and upload through the Ops ...
//   graph.launch();                        // the step's device work, queued
//   double loss = model.ops().loss_sum();  // the step's one wait
//
// The first step of a shape runs plain (it allocates activations and builds plans); the
// second is captured (on CUDA by stream capture; the host backend records the calls) and
// launched; every later step replays: each Ops call that queues device work is checked
// against the call the captured step made at the same place (its name and the bytes of its
// arguments) and not queued again, and each upload writes the new values into the host
// memory the graph copies from (its own slot, kept from the capture). What changes from
// step to step travels through those uploads (token ids, AdamW's learning rate and bias
// corrections: AdamWStep, read by the kernel from device memory); everything else must not
// change, and a call that does is refused with what it was. A step that waits for the
// device before its end (a read to the host, a mixture of experts' counts) cannot be a
// graph: those Ops calls throw while a step is captured or replayed. `shape` is what the
// caller knows the step by (sizes, hyperparameters): a new shape starts over with a plain
// step. A refusal comes where the step changed, mostly in its forward or backward, before
// the optimizer counts the step: on one rank the step can be run again (plainly). On a mesh
// every rank runs the same step and refuses the same call; a refusal on some ranks only (a
// rank that branched) leaves the others' collectives waiting for theirs: end the run. A
// capture or launch that the device fails comes after the host's pass, the optimizer's step
// count moved on without its update: go back to a checkpoint.
//
// Ops<T, Device> keeps a StepGraph (the bookkeeping here) and provides
//   bool use_step_graph                       off unless a trainer turns it on
//   begin_graph_step(shape), launch_graph_step(), abandon_graph_step()
// which GraphStep calls. Why: a GPT-2 step queues several hundred launches; replayed as one
// graph, the device starts each kernel without waiting for the host to have launched it.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fived/util/call_hash.hpp"

namespace fived {

enum class StepMode { plain, capturing, replaying };

// The device-independent part of a graph step: which mode, the calls of the captured step,
// and the host memory its uploads read. HostMemory(bytes) owns `bytes` of host memory with
// data(): on CUDA pinned, so that the graph's copies read it asynchronously. It is allocated
// before the capture (a capture may not allocate pinned memory), as large as the uploads of
// the plain step before it, which uploads at least what a later step does (it also starts
// the optimizer: its chunks, once).
template <class HostMemory>
class StepGraph {
 public:
  StepGraph() = default;
  // A moved Ops starts without a graph: the captured calls name the old one's memory.
  StepGraph(StepGraph&&) noexcept {}
  StepGraph& operator=(StepGraph&&) noexcept {
    forget();
    return *this;
  }

  StepMode mode() const { return mode_.load(std::memory_order_relaxed); }
  bool captured() const { return captured_; }

  // A step begins: plain until a step of this shape has run, then captured once, then replayed.
  StepMode begin(std::uint64_t shape) {
    if (mode_ != StepMode::plain) throw std::logic_error("fived::GraphStep: a step began inside another step");
    if (!warm_ || shape != shape_) {
      forget();
      shape_ = shape;
      warm_ = warming_ = true;  // this plain step warms it
      return mode_;
    }
    if (!captured_) {
      memory_.emplace(warm_bytes_ + 1);
      used_ = 0;
    }
    next_call_ = next_slot_ = 0;
    mode_ = captured_ ? StepMode::replaying : StepMode::capturing;
    return mode_;
  }

  // An Ops call that queues device work, while capturing or replaying: noted, or checked
  // against the captured step's call at the same place.
  void call(const char* what, std::uint64_t args) {
    if (mode_ == StepMode::capturing) {
      calls_.push_back({what, args});
      return;
    }
    const std::size_t k = next_call_++;
    if (k >= calls_.size()) refuse(k, what, "queues more device work than the captured step");
    if (std::strcmp(calls_[k].what, what) != 0) refuse(k, what, std::string("is not the captured step's ") + calls_[k].what);
    if (calls_[k].args != args) refuse(k, what, "has arguments other than the captured step's");
  }

  // A plain step's upload: the first step of a shape counts their bytes.
  void plain_upload(std::size_t bytes) {
    if (warming_) warm_bytes_ += padded(bytes);
  }

  // An upload of `bytes` from `host`, as call(): the host memory the graph copies it from,
  // filled with the values (a new slot while capturing, the same one after).
  const void* upload(const char* what, std::uint64_t args, const void* host, std::size_t bytes) {
    call(what, args);
    if (mode_ == StepMode::capturing) {
      if (used_ + padded(bytes) > warm_bytes_)
        refuse(calls_.size() - 1, what, "uploads more than the plain step before the capture did");
      slots_.push_back(used_);
      used_ += padded(bytes);
    }
    std::byte* slot = static_cast<std::byte*>(memory_->data()) + slots_[next_slot_++];
    std::memcpy(slot, host, bytes);
    return slot;
  }

  // Ops calls that wait for the device, allocate or map memory: refused inside a graph step.
  void no_wait(const char* what) const {
    if (mode_ != StepMode::plain)
      throw std::logic_error(std::string("fived::GraphStep: ") + what +
                             " inside a step captured as a graph: it waits for the device, allocates or maps memory, "
                             "which a graph cannot replay; turn the step graph off for this step");
  }

  // The step's work is queued: every captured call was made again.
  void end() {
    if (mode_ == StepMode::replaying && next_call_ != calls_.size())
      refuse(next_call_, "the step's end", "comes before the rest of the captured step's work");
    if (mode_ == StepMode::capturing) captured_ = true;
    mode_ = StepMode::plain;
    warming_ = false;
  }

  // Back to plain steps: after an error, or a new shape.
  void forget() noexcept {
    forget_calls();
    memory_.reset();
  }

 private:
  struct Call {
    const char* what;
    std::uint64_t args;
  };
  [[noreturn]] void refuse(std::size_t k, const char* what, const std::string& why) {
    const std::string msg = "fived::GraphStep: call " + std::to_string(k) + " of the step (" + what + ") " + why +
                            ": the step changed since it was captured. What changes from step to step must reach the "
                            "device through an upload; turn the step graph off for a step that branches";
    // The uploads' memory stays until the Ops give the step up (abandon_graph_step: forget),
    // after the capture has ended: freeing pinned memory inside a capture fails, and leaks it.
    forget_calls();
    throw std::logic_error(msg);
  }
  void forget_calls() noexcept {
    mode_ = StepMode::plain;
    captured_ = warm_ = warming_ = false;
    calls_.clear();
    slots_.clear();
    next_call_ = next_slot_ = 0;
    warm_bytes_ = used_ = 0;
  }

  // Slots start on 64-byte boundaries.
  static std::size_t padded(std::size_t bytes) { return (bytes + 63) / 64 * 64; }

  // Read by a trainer's communication thread too (its Ops follow this one's graph: Ops::queue
  // asks the mode of every call), while this thread may set it: at a step's start (a trainer
  // without graph steps forgets at every step) or when a step that threw is given up with
  // that thread's tasks still running. Those tasks run only in plain steps, and a plain step
  // only ever writes plain over plain, so what they read is right; atomic, so that reading
  // it there is defined (ThreadSanitizer found the race: test_data_parallel's ZeRO-3 error).
  std::atomic<StepMode> mode_ = StepMode::plain;
  bool warm_ = false, warming_ = false, captured_ = false;
  std::uint64_t shape_ = 0;
  std::vector<Call> calls_;
  std::optional<HostMemory> memory_;  // the uploads' slots
  std::vector<std::size_t> slots_;    // where each upload's slot starts in memory_
  std::size_t warm_bytes_ = 0, used_ = 0;
  std::size_t next_call_ = 0, next_slot_ = 0;
};

// One step's use of its Ops' graph (above): begins it, launches it, and gives it up when
// the step throws before launch(). Nothing for Ops without graph steps (a stand-in model's).
template <class Ops>
class GraphStep {
  static constexpr bool graphs = requires(Ops& o) { o.begin_graph_step(std::uint64_t{}); };

 public:
  GraphStep(Ops& ops, std::uint64_t shape) : ops_(ops) {
    if constexpr (graphs) ops_.begin_graph_step(shape);
  }
  GraphStep(const GraphStep&) = delete;
  GraphStep& operator=(const GraphStep&) = delete;
  ~GraphStep() {
    if constexpr (graphs)
      if (!launched_) ops_.abandon_graph_step();
  }
  void launch() {
    launched_ = true;  // a launch that throws has given the graph up itself
    if constexpr (graphs) ops_.launch_graph_step();
  }

 private:
  Ops& ops_;
  bool launched_ = false;
};

}  // namespace fived
