#pragma once
// One rank of a group writes a file while the others wait for it: every rank learns whether
// the write succeeded, so a failure is an error on all of them instead of a hang in their
// next collective. The writer rethrows its own error; the others throw `failed`.
//
//   written_by_one(tp_rank() == 0, [&] { write_file(path); },
//                  [&](double x) { return comm.all_reduce_host(x, ReduceOp::max); },
//                  "TP rank 0 could not write " + path.string());

#include <exception>
#include <stdexcept>
#include <string>

namespace fived {

// max_over_group(double) -> double: the group's maximum of every rank's value (a collective).
template <class Write, class MaxOverGroup>
void written_by_one(bool writer, Write&& write, MaxOverGroup&& max_over_group, const std::string& failed) {
  std::exception_ptr error;
  if (writer) try {
      write();
    } catch (...) {
      error = std::current_exception();
    }
  const bool any_failed = max_over_group(error ? 1.0 : 0.0) > 0;
  if (error) std::rethrow_exception(error);
  if (any_failed) throw std::runtime_error(failed);
}

}  // namespace fived
