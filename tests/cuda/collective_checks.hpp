#pragma once
// Every collective of fived::nccl::Comm on rank-valued integer data, checked
// with exact equality. Shared by the single-process doctest and the
// multi-process program, so both worlds run the same checks. Throws
// std::runtime_error naming the collective, group and first wrong element.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/comm/nccl.hpp"
#include "gpu_support.hpp"

namespace fived::test {

template <class T>
void expect_equal(const nccl::Comm& c, const std::string& what, const std::vector<T>& got,
                  const std::vector<T>& want) {
  if (got.size() != want.size())
    throw std::runtime_error(what + " on " + c.name() + ": got " + std::to_string(got.size()) + " elements, want " +
                             std::to_string(want.size()));
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      throw std::runtime_error(what + " on group " + c.name() + " (rank " + std::to_string(c.rank()) + " of " +
                               std::to_string(c.size()) + "): element " + std::to_string(i) + " is " +
                               std::to_string(got[i]) + ", want " + std::to_string(want[i]));
}

// Runs fn(i) for i in [0, n) into a vector.
template <class T, class F>
std::vector<T> make(std::size_t n, F fn) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(fn(i));
  return v;
}

inline void check_collectives(nccl::Comm& c) {
  const cudaStream_t s = c.compute_stream();
  const int n = c.size(), me = c.rank();
  const std::size_t k = 5;  // elements per block: not a power of two on purpose
  const long rank_sum = static_cast<long>(n) * (n - 1) / 2;

  {  // all_reduce sum, int32
    DeviceBuffer<std::int32_t> send(make<std::int32_t>(k, [&](auto i) { return 1000 * (me + 1) + i; }), s);
    DeviceBuffer<std::int32_t> recv(std::vector<std::int32_t>(k, -1), s);
    c.all_reduce(send.cspan(), recv.span(), ReduceOp::sum);
    expect_equal(c, "all_reduce(sum)", recv.download(s),
                 make<std::int32_t>(k, [&](auto i) { return 1000 * (rank_sum + n) + n * i; }));
  }
  {  // all_reduce max, int64, in place
    DeviceBuffer<std::int64_t> buf(make<std::int64_t>(k, [&](auto i) { return 7 * me - static_cast<long>(i); }), s);
    c.all_reduce(buf.span(), ReduceOp::max);
    expect_equal(c, "all_reduce(max, in place)", buf.download(s),
                 make<std::int64_t>(k, [&](auto i) { return 7 * (n - 1) - static_cast<long>(i); }));
  }
  {  // all_reduce avg, int32: contributions are multiples of n, so the mean is exact
    DeviceBuffer<std::int32_t> send(make<std::int32_t>(k, [&](auto i) { return n * (me + static_cast<long>(i)); }), s);
    DeviceBuffer<std::int32_t> recv(std::vector<std::int32_t>(k, -1), s);
    c.all_reduce(send.cspan(), recv.span(), ReduceOp::avg);
    expect_equal(c, "all_reduce(avg)", recv.download(s),
                 make<std::int32_t>(k, [&](auto i) { return rank_sum + n * static_cast<long>(i); }));
  }
  {  // reduce_scatter: block j of every rank's send is summed onto rank j
    DeviceBuffer<float> send(make<float>(n * k, [&](auto i) { return 100 * me + 10 * (i / k) + i % k; }), s);
    DeviceBuffer<float> recv(std::vector<float>(k, -1), s);
    c.reduce_scatter(send.cspan(), recv.span(), ReduceOp::sum);
    expect_equal(c, "reduce_scatter(sum)", recv.download(s),
                 make<float>(k, [&](auto i) { return 100 * rank_sum + n * (10 * me + static_cast<long>(i)); }));
  }
  {  // all_gather, float64
    DeviceBuffer<double> send(make<double>(k, [&](auto i) { return 1000 * me + i; }), s);
    DeviceBuffer<double> recv(std::vector<double>(n * k, -1), s);
    c.all_gather(send.cspan(), recv.span());
    expect_equal(c, "all_gather", recv.download(s), make<double>(n * k, [&](auto i) { return 1000 * (i / k) + i % k; }));
  }
  {  // all_to_all: block j of send goes to rank j
    DeviceBuffer<std::int32_t> send(make<std::int32_t>(n * k, [&](auto i) { return 10000 * me + 100 * (i / k) + i % k; }), s);
    DeviceBuffer<std::int32_t> recv(std::vector<std::int32_t>(n * k, -1), s);
    c.all_to_all(send.cspan(), recv.span());
    expect_equal(c, "all_to_all", recv.download(s),
                 make<std::int32_t>(n * k, [&](auto i) { return 10000 * (i / k) + 100 * me + i % k; }));
  }
  {  // all_to_all_v: rank a sends (a + b + 1) % 3 elements to rank b, some of them none
    std::vector<std::size_t> send_counts(n), recv_counts(n);
    std::vector<std::int64_t> host_send, want;
    for (int peer = 0; peer < n; ++peer) {
      send_counts[peer] = recv_counts[peer] = static_cast<std::size_t>((me + peer + 1) % 3);
      for (std::size_t i = 0; i < send_counts[peer]; ++i) host_send.push_back(10000 * me + 100 * peer + i);
      for (std::size_t i = 0; i < recv_counts[peer]; ++i) want.push_back(10000 * peer + 100 * me + i);
    }
    DeviceBuffer<std::int64_t> send(host_send, s);
    DeviceBuffer<std::int64_t> recv(std::vector<std::int64_t>(want.size(), -1), s);
    c.all_to_all_v(send.cspan(), std::span<const std::size_t>(send_counts), recv.span(),
                   std::span<const std::size_t>(recv_counts));
    expect_equal(c, "all_to_all_v", recv.download(s), want);
  }
  {  // send_recv: a ring, send right and receive from the left in one group
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    DeviceBuffer<std::int32_t> send(make<std::int32_t>(k, [&](auto i) { return 10 * me + i; }), s);
    DeviceBuffer<std::int32_t> recv(std::vector<std::int32_t>(k, -1), s);
    const SendOp<std::int32_t> sends[] = {{send.cspan(), right}};
    const RecvOp<std::int32_t> recvs[] = {{recv.span(), left}};
    c.send_recv(std::span<const SendOp<std::int32_t>>(sends), std::span<const RecvOp<std::int32_t>>(recvs));
    expect_equal(c, "send_recv (ring)", recv.download(s), make<std::int32_t>(k, [&](auto i) { return 10 * left + i; }));
  }
  {  // broadcast from the last rank, uint8
    const int root = n - 1;
    DeviceBuffer<std::uint8_t> buf(make<std::uint8_t>(k, [&](auto i) { return me == root ? 40 + i : 0; }), s);
    c.broadcast(buf.span(), root);
    expect_equal(c, "broadcast", buf.download(s), make<std::uint8_t>(k, [&](auto i) { return 40 + i; }));
  }
  c.barrier();
  c.synchronize();
}

// Splits into even and odd ranks, ordered by descending rank, and checks the
// groups' shape and an all_reduce over each.
inline void check_split(nccl::Comm& world) {
  const int n = world.size(), me = world.rank();
  nccl::Comm half = world.split(me % 2, -me, world.name() + "/parity");
  const int members = (n - me % 2 + 1) / 2;  // ranks with my parity
  const int index = (n - 1 - me) / 2;        // descending order among them
  if (half.size() != members || half.rank() != index || half.name() != world.name() + "/parity")
    throw std::runtime_error("split: world rank " + std::to_string(me) + " got rank " + std::to_string(half.rank()) +
                             " of " + std::to_string(half.size()) + " in '" + half.name() + "', want rank " +
                             std::to_string(index) + " of " + std::to_string(members));
  const cudaStream_t s = half.compute_stream();
  DeviceBuffer<std::int32_t> buf(std::vector<std::int32_t>{me, 1}, s);
  half.all_reduce(buf.span(), ReduceOp::sum);
  int parity_sum = 0;
  for (int r = me % 2; r < n; r += 2) parity_sum += r;
  expect_equal(half, "all_reduce after split", buf.download(s), std::vector<std::int32_t>{parity_sum, members});
  check_collectives(half);
}

}  // namespace fived::test
