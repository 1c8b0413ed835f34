#pragma once
// ZeRO-3 gathers a unit's parameters only when the model says so (model/unit_hooks.hpp): a
// model that accepts UnitHooks and never calls them would train on released ranges without a
// word. So the hooks of the first micro-batch are noted and, after its backward, every unit
// that holds parameters must have had all four.
//
//   UnitHookCheck check(units);                // 0 units: checks nothing
//   check.saw(u, UnitHookCheck::before_forward);  ... in each hook
//   check.check(range_of_unit);                // after the first backward: throws naming the missing hook

#include <stdexcept>
#include <string>
#include <vector>

#include "fived/optim/flat_range.hpp"

namespace fived {

class UnitHookCheck {
 public:
  enum Hook : unsigned { before_forward, after_forward, before_backward, after_backward };

  explicit UnitHookCheck(int units) : seen_(static_cast<std::size_t>(units), 0) {}

  void saw(int u, Hook h) {
    if (!checked_ && u >= 0 && u < static_cast<int>(seen_.size())) seen_[static_cast<std::size_t>(u)] |= 1u << h;
  }
  // Once: every unit whose range (range_of(u), flat offsets) holds parameters had all four.
  template <class RangeOf>
  void check(RangeOf&& range_of) {
    if (checked_) return;
    checked_ = true;
    static constexpr const char* names[] = {"before_forward", "after_forward", "before_backward", "after_backward"};
    for (int u = 0; u < static_cast<int>(seen_.size()); ++u) {
      const FlatRange r = range_of(u);
      if (r.size() == 0) continue;
      for (unsigned h = 0; h < 4; ++h)
        if ((seen_[static_cast<std::size_t>(u)] & (1u << h)) == 0)
          throw std::logic_error("fived::DataParallel<ZeRO<3>>: the model's first micro-batch never called UnitHooks::" +
                                 std::string(names[h]) + "(" + std::to_string(u) + "), so unit " + std::to_string(u) +
                                 "'s parameters (elements [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                 ") of its layout) were not gathered before use or released after; call each hook "
                                 "around every unit's use in forward and backward (docs/model.md)");
    }
  }

 private:
  std::vector<unsigned> seen_;  // per unit: a bit per hook
  bool checked_ = false;
};

}  // namespace fived
