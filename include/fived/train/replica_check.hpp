#pragma once
// Every rank of a data-parallel group must start from the same weights, or the replicas
// drift apart silently (ranks initialised from different seeds). PyTorch's DDP broadcasts
// rank 0's; a fived model initialises each rank's piece alone from the seed, so a
// difference is a mistake to report: a 64-bit hash of the parameters, compared over the
// group (its halves as doubles: max and max of the negation agree only if every rank has
// the same).
//
//   check_replicas_agree_over(grad_comm, params_in_host_memory);   // a collective; throws on a difference

#include <array>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "fived/comm/types.hpp"
#include "fived/mesh/mesh_comm.hpp"
#include "fived/util/fnv.hpp"

namespace fived {

template <GroupView G, class T>
void check_replicas_agree_over(MeshComm<G>& comm, std::span<const T> params) {
  util::Fnv1a64 hash;
  hash.add(std::as_bytes(params));
  const std::uint64_t h = hash.value();
  const double hi = static_cast<double>(h >> 32), lo = static_cast<double>(h & 0xffffffffu);
  std::array<double, 4> v{hi, lo, -hi, -lo};
  comm.all_reduce_host(std::span<double>(v), ReduceOp::max);
  if (v[0] != -v[2] || v[1] != -v[3])
    throw std::invalid_argument("fived::DataParallel: the ranks of the data-parallel group " + G::name() +
                                " hold different initial weights, so their replicas would drift apart: give every "
                                "rank the same GptInit seed (or load the same weights) before making the trainer");
}

}  // namespace fived
