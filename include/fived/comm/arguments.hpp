#pragma once
// The argument rules every backend enforces, as pure functions: given the
// collective's arguments, this rank's group rank and the group size, each
// returns an empty string when the call is valid, or a sentence saying what is
// wrong and what to change. Backends call them before doing anything and throw
// CommError with their own prefix (backend, rank, collective, group).
//
// The aliasing rules are NCCL's, so that code tested on the host backend does
// not fail on NCCL:
//   all_reduce       in place when send == recv; no other overlap
//   reduce_scatter   in place when recv == send + rank * recv.size(); no other overlap
//   all_gather       in place when send == recv + rank * send.size(); no other overlap
//   all_to_all(_v)   send and recv must not overlap
//   send_recv        no receive buffer may overlap another receive or a send buffer
//   broadcast        one buffer: in place by definition
// Empty buffers overlap nothing. Checks that need the device (is this device
// memory, is the thread on the communicator's device) stay in the backend.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "fived/comm/types.hpp"

namespace fived::args {

// A buffer as the rules see it: where it starts, how many elements, how many
// bytes each.
struct Buf {
  const void* data = nullptr;
  std::size_t count = 0;  // elements
  std::size_t elem = 1;   // bytes per element

  Buf() = default;
  Buf(const void* d, std::size_t n, std::size_t e) : data(d), count(n), elem(e) {}
  template <class T, std::size_t E>
  Buf(std::span<T, E> s) : data(s.data()), count(s.size()), elem(sizeof(T)) {}  // NOLINT: implicit on purpose

  std::size_t bytes() const { return count * elem; }
  std::uintptr_t begin() const { return reinterpret_cast<std::uintptr_t>(data); }
  // The address of element i.
  std::uintptr_t at(std::size_t i) const { return begin() + i * elem; }
};

// True when the two byte ranges share at least one byte.
inline bool overlap(const Buf& a, const Buf& b) {
  return a.bytes() != 0 && b.bytes() != 0 && a.begin() < b.begin() + b.bytes() && b.begin() < a.begin() + a.bytes();
}

namespace detail {
inline std::string n(std::size_t v) { return std::to_string(v); }
inline std::string peer_range(int size) { return "[0, " + std::to_string(size) + ")"; }
}  // namespace detail

// `role` ("send peer", "recv peer", "root") names a rank of the group.
inline std::string peer(const char* role, int p, int size) {
  if (p >= 0 && p < size) return {};
  return std::string(role) + " " + std::to_string(p) + " is not a rank of this group of " + std::to_string(size) +
         ": pass a group rank in " + detail::peer_range(size);
}

inline std::string all_reduce(int /*rank*/, int /*size*/, Buf send, Buf recv) {
  if (send.count != recv.count)
    return "send has " + detail::n(send.count) + " elements but recv has " + detail::n(recv.count) +
           ": they must be equal";
  if (send.data != recv.data && overlap(send, recv))
    return "send and recv overlap without being the same buffer: pass recv == send for an in-place all_reduce, "
           "or buffers that do not overlap";
  return {};
}

inline std::string reduce_scatter(int rank, int size, Buf send, Buf recv) {
  const auto n = static_cast<std::size_t>(size);
  if (send.count != n * recv.count)
    return "send has " + detail::n(send.count) + " elements but must have size() * recv.size() = " + detail::n(n) +
           " * " + detail::n(recv.count) + " = " + detail::n(n * recv.count);
  const std::size_t at = static_cast<std::size_t>(rank) * recv.count;
  if (recv.begin() != send.at(at) && overlap(send, recv))
    return "send and recv overlap other than in the in-place layout: recv must start at element rank() * "
           "recv.size() = " + detail::n(at) + " of send, or not overlap send";
  return {};
}

inline std::string all_gather(int rank, int size, Buf send, Buf recv) {
  const auto n = static_cast<std::size_t>(size);
  if (recv.count != n * send.count)
    return "recv has " + detail::n(recv.count) + " elements but must have size() * send.size() = " + detail::n(n) +
           " * " + detail::n(send.count) + " = " + detail::n(n * send.count);
  const std::size_t at = static_cast<std::size_t>(rank) * send.count;
  if (send.begin() != recv.at(at) && overlap(send, recv))
    return "send and recv overlap other than in the in-place layout: send must start at element rank() * "
           "send.size() = " + detail::n(at) + " of recv, or not overlap recv";
  return {};
}

inline std::string apart(const char* op, Buf send, Buf recv) {
  if (!overlap(send, recv)) return {};
  return "send and recv overlap: " + std::string(op) + " has no in-place form, use buffers that do not overlap";
}

inline std::string all_to_all(int /*rank*/, int size, Buf send, Buf recv) {
  const auto n = static_cast<std::size_t>(size);
  if (send.count != recv.count || send.count % n != 0)
    return "send has " + detail::n(send.count) + " and recv " + detail::n(recv.count) +
           " elements: they must be equal and a multiple of size() = " + detail::n(n);
  return apart("all_to_all", send, recv);
}

inline std::string all_to_all_v(int rank, int size, Buf send, std::span<const std::size_t> send_counts, Buf recv,
                                std::span<const std::size_t> recv_counts) {
  const auto n = static_cast<std::size_t>(size);
  if (send_counts.size() != n || recv_counts.size() != n)
    return "send_counts has " + detail::n(send_counts.size()) + " and recv_counts " + detail::n(recv_counts.size()) +
           " entries: give one per rank, size() = " + detail::n(n);
  std::size_t sent = 0, received = 0;
  for (std::size_t i = 0; i < n; ++i) sent += send_counts[i], received += recv_counts[i];
  if (sent != send.count || received != recv.count)
    return "the counts add up to " + detail::n(sent) + " sent / " + detail::n(received) +
           " received but the buffers hold " + detail::n(send.count) + " / " + detail::n(recv.count) +
           ": pass spans of exactly the packed blocks";
  const auto me = static_cast<std::size_t>(rank);
  if (send_counts[me] != recv_counts[me])
    return "this rank sends itself " + detail::n(send_counts[me]) + " elements but expects to receive " +
           detail::n(recv_counts[me]) + ": send_counts[rank()] and recv_counts[rank()] must agree";
  return apart("all_to_all_v", send, recv);
}

// Peers in range; no receive buffer overlaps another receive buffer or a send
// buffer (sends may share memory: they are only read).
template <class T>
std::string send_recv(int /*rank*/, int size, std::span<const SendOp<T>> sends, std::span<const RecvOp<T>> recvs) {
  for (const auto& s : sends)
    if (auto why = peer("send peer", s.peer, size); !why.empty()) return why;
  for (const auto& r : recvs)
    if (auto why = peer("recv peer", r.peer, size); !why.empty()) return why;
  for (std::size_t i = 0; i < recvs.size(); ++i) {
    const Buf ri(recvs[i].buf);
    for (std::size_t j = i + 1; j < recvs.size(); ++j)
      if (overlap(ri, Buf(recvs[j].buf)))
        return "the receive buffers from peers " + std::to_string(recvs[i].peer) + " and " +
               std::to_string(recvs[j].peer) + " (receives " + detail::n(i) + " and " + detail::n(j) +
               ") overlap: give every receive a buffer of its own";
    for (std::size_t j = 0; j < sends.size(); ++j)
      if (overlap(ri, Buf(sends[j].buf)))
        return "the receive buffer from peer " + std::to_string(recvs[i].peer) + " (receive " + detail::n(i) +
               ") overlaps the send buffer to peer " + std::to_string(sends[j].peer) + " (send " + detail::n(j) +
               "): send_recv has no in-place form, use buffers that do not overlap";
  }
  return {};
}

inline std::string broadcast(int /*rank*/, int size, int root) { return peer("root", root, size); }

inline std::string split(int color) {
  if (color >= 0) return {};
  return "color " + std::to_string(color) + " is negative: every rank must join a group, pass a color >= 0";
}

}  // namespace fived::args
