#pragma once
// Which activation slot each micro-batch of a pipeline rank's chunks holds (the executor's,
// pipeline/executor.hpp).
//
// A slot is handed out at a micro-batch's forward (or at the receive that precedes it, or
// when the previous stage on this rank hands its activations over) and taken back once the
// micro-batch's backward is done (the full one, or the weight half) and its d(input) has
// been sent where the program sends it: the later of the two. A dry walk of the program by
// the same rule says how many slots each chunk needs: the most micro-batches it keeps in
// flight, no more.
//
//   SlotBook book(program, V, M, next_here);  // next_here(c): the chunk of this rank holding
//                                             // the stage after chunk c's, or -1
//   book.slots(c)                 // how many chunk c needs (Decoder::set_slots)
//   book.begin_step();            // every slot free
//   int k = book.slot(c, m, true);   // micro-batch m's slot in chunk c, handed out if need be
//   book.done_with(c, m);         // after its backward, and after its d(input) is sent

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/pipeline/action.hpp"

namespace fived::pipeline {

class SlotBook {
 public:
  template <class NextHere>
  SlotBook(std::span<const Action> program, int V, int M, NextHere&& next_here)
      : V_(V), M_(M), sends_back_(static_cast<std::size_t>(V * M), 0) {
    const std::size_t n = static_cast<std::size_t>(V * M);
    for (const Action& s : program)
      if (s.op == Op::send_grad) sends_back_[index(s.chunk, s.mb)] = 1;
    std::vector<int> live(static_cast<std::size_t>(V), 0), holds(n, 0);
    slots_.assign(static_cast<std::size_t>(V), 1);
    auto hand_out = [&](int c, int m) {
      if (holds[index(c, m)] == 0) holds[index(c, m)] = holds_at_start(c, m), ++live[static_cast<std::size_t>(c)];
      slots_[static_cast<std::size_t>(c)] = std::max(slots_[static_cast<std::size_t>(c)], live[static_cast<std::size_t>(c)]);
    };
    for (const Action& s : program) {
      if (s.op == Op::forward || s.op == Op::recv_act) hand_out(s.chunk, s.mb);
      if (s.op == Op::forward)  // a hand-over on this rank takes the next chunk's slot now
        if (const int next = next_here(s.chunk); next >= 0) hand_out(next, s.mb);
      if ((s.op == Op::backward || s.op == Op::weight_grad || s.op == Op::send_grad) && holds[index(s.chunk, s.mb)] > 0 &&
          --holds[index(s.chunk, s.mb)] == 0)
        --live[static_cast<std::size_t>(s.chunk)];
    }
    slot_of_.assign(n, -1);
    holds_.assign(n, 0);
    free_.assign(static_cast<std::size_t>(V), {});
  }

  // Activation slots chunk c needs.
  int slots(int c) const { return slots_.at(static_cast<std::size_t>(c)); }

  // Every slot free, for a new step.
  void begin_step() {
    std::fill(slot_of_.begin(), slot_of_.end(), -1);
    for (int c = 0; c < V_; ++c) {
      auto& free = free_[static_cast<std::size_t>(c)];
      free.clear();
      for (int k = slots(c); k-- > 0;) free.push_back(k);
    }
  }

  // Slot of micro-batch m in chunk c; `take`: hand one out if it has none yet.
  int slot(int c, int m, bool take) {
    int& k = slot_of_[index(c, m)];
    if (k < 0) {
      auto& free = free_[static_cast<std::size_t>(c)];
      if (!take || free.empty())
        throw std::logic_error("pipeline::Executor: micro-batch " + std::to_string(m) + " of chunk " +
                               std::to_string(c) + " has no activation slot here (the schedule uses it before its "
                               "forward, or keeps more in flight than it said)");
      k = free.back();
      free.pop_back();
      holds_[index(c, m)] = holds_at_start(c, m);
    }
    return k;
  }
  // Its backward is done, or its d(input) sent: the slot is free after the later of the two.
  void done_with(int c, int m) {
    if (--holds_[index(c, m)] > 0) return;
    int& k = slot_of_[index(c, m)];
    if (k >= 0) free_[static_cast<std::size_t>(c)].push_back(k);
    k = -1;
  }

 private:
  std::size_t index(int c, int m) const { return static_cast<std::size_t>(c * M_ + m); }
  int holds_at_start(int c, int m) const { return 1 + sends_back_[index(c, m)]; }

  int V_, M_;
  std::vector<int> sends_back_;  // [chunk * M + m]: 1 if the program sends its d(input)
  std::vector<int> slots_;       // per chunk: activation slots
  std::vector<int> slot_of_;     // [chunk * M + m]: the slot micro-batch m holds, or -1
  std::vector<int> holds_;       // [chunk * M + m]: what it still waits for before its slot is free
  std::vector<std::vector<int>> free_;
};

}  // namespace fived::pipeline
