#pragma once
// What the ranks of a group must agree on when they call one collective, and the
// sentence that names the first two that do not: the same collective, element
// type, reduction, root and (but for all_to_all_v) count; one name for each group
// a split makes; all_to_all_v's counts matching pair by pair. Both host
// transports (threads, comm/host.hpp; processes, comm/mpi.hpp) check every call
// with it, so a misuse reads the same on both.
//
// `calls[r]` is group rank r's call: anything with `op` and `name` (string-like),
// `dtype`, `reduce`, `root`, `count` and `color`; `members[r]` its world rank.

#include <cstddef>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>

#include "fived/comm/types.hpp"

namespace fived::detail {

// "tp {2,3}": a group's name and its members' world ranks, as every message names it.
inline std::string describe_group(const std::string& name, std::span<const int> members) {
  std::string s = name + " {";
  for (std::size_t i = 0; i < members.size(); ++i) s += (i ? "," : "") + std::to_string(members[i]);
  return s + "}";
}

template <class Call>
std::string call_mismatch(std::span<const Call> calls, std::span<const int> members) {
  const auto& p = calls;
  const int n = static_cast<int>(p.size());
  auto who = [&](int r) { return "rank " + std::to_string(members[r]); };
  const std::string_view op = p[0].op;
  for (int r = 1; r < n; ++r) {
    if (std::string_view(p[r].op) != op)
      return "the ranks called different collectives: " + who(0) + " called " + std::string(op) + ", " + who(r) +
             " called " + std::string(std::string_view(p[r].op));
    if (p[r].dtype != p[0].dtype)
      return who(0) + " passed " + std::string(dtype_name(p[0].dtype)) + " but " + who(r) + " passed " +
             std::string(dtype_name(p[r].dtype));
    if (p[r].reduce != p[0].reduce)
      return who(0) + " reduces with " + std::string(reduce_op_name(p[0].reduce)) + " but " + who(r) + " with " +
             std::string(reduce_op_name(p[r].reduce));
    if (p[r].root != p[0].root)
      return who(0) + " names root " + std::to_string(p[0].root) + " but " + who(r) + " names root " +
             std::to_string(p[r].root);
    if (op != "all_to_all_v" && p[r].count != p[0].count)
      return who(0) + " passed " + std::to_string(p[0].count) + " elements but " + who(r) + " passed " +
             std::to_string(p[r].count);
  }
  if (op == "split") {         // the ranks of one new group give it one name
    std::map<int, int> first;  // color -> the first rank with it
    for (int r = 0; r < n; ++r)
      if (const auto [at, fresh] = first.try_emplace(p[r].color, r);
          !fresh && std::string_view(p[at->second].name) != std::string_view(p[r].name))
        return who(at->second) + " names its new group \"" + std::string(std::string_view(p[at->second].name)) +
               "\" but " + who(r) + " names the same group (color " + std::to_string(p[r].color) + ") \"" +
               std::string(std::string_view(p[r].name)) + "\"";
  }
  return {};
}

// all_to_all_v: what rank s sends rank d (`sends(s, d)`) is what d expects from s (`expects(d, s)`).
inline std::string counts_mismatch(std::span<const int> members,
                                   const std::function<std::size_t(int, int)>& sends,
                                   const std::function<std::size_t(int, int)>& expects) {
  const int n = static_cast<int>(members.size());
  for (int s = 0; s < n; ++s)
    for (int d = 0; d < n; ++d)
      if (sends(s, d) != expects(d, s))
        return "rank " + std::to_string(members[s]) + " sends " + std::to_string(sends(s, d)) + " elements to rank " +
               std::to_string(members[d]) + ", which expects " + std::to_string(expects(d, s));
  return {};
}

}  // namespace fived::detail
