#pragma once
// Every point-to-point connection a pipeline rank's program will use, made before its first
// step (the executor's, pipeline/executor.hpp).
//
// NCCL sets a point-to-point connection up the first time a pair uses it, with both hosts
// taking part: in a step, a group whose receive is new (1F1B's first gradient) waited for
// its peer's host, which could be blocked on its own device (a first allocation, a cudaFree)
// queued behind a receive from this very group: DP 2 x PP 2 x TP 2 hung there on one GPU. So
// one element goes each way with every rank the program exchanges with, all in one group.
// The relation is symmetric (a table's sends and receives pair up), so every peer issues the
// same group.
//
//   connect_peers<T>(peers_of(program), pp_comm, ops);   // T: the messages' element type; a
//                                                        // collective of the ranks named
// (the executor adds the peer of its tied gradient's swap: pipeline/tied_grads.hpp)

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "fived/comm/communicator.hpp"
#include "fived/pipeline/action.hpp"

namespace fived::pipeline {

// The ranks a program exchanges with.
inline std::vector<int> peers_of(std::span<const Action> program) {
  std::vector<int> peers;
  for (const Action& s : program)
    if (is_comm(s.op) && s.peer >= 0) peers.push_back(s.peer);
  return peers;
}

// peers: in any order, repeats allowed; the relation must be symmetric (each peer names this
// rank), so every pair issues the same group, in rank order.
template <class T, class C, class Ops>
void connect_peers(std::vector<int> peers, C& pp, Ops& ops) {
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  if (peers.empty()) return;
  auto out = ops.template make_buffer<T>(peers.size()), in = ops.template make_buffer<T>(peers.size());
  std::vector<SendOp<T>> sends;
  std::vector<RecvOp<T>> recvs;
  for (std::size_t k = 0; k < peers.size(); ++k) {
    sends.push_back({std::span<const T>(out.data() + k, 1), peers[k]});
    recvs.push_back({std::span<T>(in.data() + k, 1), peers[k]});
  }
  pp.send_recv(std::span<const SendOp<T>>(sends), std::span<const RecvOp<T>>(recvs));
  pp.synchronize();  // the buffers go at return
}

}  // namespace fived::pipeline
