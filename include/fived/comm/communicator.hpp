#pragma once
// The communicator concept. Each backend (host threads, NCCL) provides these
// operations over one group of ranks; buffers are in the memory the backend
// works on (host memory for the thread backend, device memory for NCCL).
//
// Shapes of the calls, for a group of n ranks:
//   all_reduce(send, recv, op)        send.size() == recv.size(); send may alias recv
//   reduce_scatter(send, recv, op)    send.size() == n * recv.size(); rank i gets block i
//   all_gather(send, recv)            recv.size() == n * send.size(); block i from rank i
//   all_to_all(send, recv)            equal blocks: block j of send goes to rank j
//   all_to_all_v(send, send_counts, recv, recv_counts)
//                                     per-peer counts, blocks packed in rank order
//   send_recv(sends, recvs)           grouped point-to-point, completes as one
//   broadcast(buf, root)
//   barrier()
//   synchronize()                     returns when this rank's communication so far has
//                                     completed (a no-op where calls complete on return)
//   split(color, key, name)           a communicator per color, ordered by key
//   name()                            the group's name, as const std::string&
//
// Which buffers may overlap, and every other argument rule, is in
// comm/arguments.hpp; all backends enforce the same rules.

#include <concepts>
#include <span>
#include <string>

#include "fived/comm/types.hpp"

namespace fived {

template <class C>
concept Communicator = requires(C& c, const C& cc, std::span<const float> in, std::span<float> out,
                                std::span<const std::size_t> counts, std::span<const SendOp<float>> sends,
                                std::span<const RecvOp<float>> recvs, ReduceOp op, int i, std::string name) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  { cc.name() } -> std::same_as<const std::string&>;
  c.all_reduce(in, out, op);
  c.reduce_scatter(in, out, op);
  c.all_gather(in, out);
  c.all_to_all(in, out);
  c.all_to_all_v(in, counts, out, counts);
  c.send_recv(sends, recvs);
  c.broadcast(out, i);
  c.barrier();
  c.synchronize();
  { c.split(i, i, name) } -> std::same_as<C>;
};

}  // namespace fived
