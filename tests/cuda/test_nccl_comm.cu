// fived::nccl::Comm in a world of one process: every collective, split, the
// bootstrap, and the errors that misuse gets. Exits 77 (skipped) without a GPU.
// Several ranks are covered by nccl_ranks_check.cpp + launch-local.sh.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "collective_checks.hpp"
#include "fived/comm/nccl.hpp"
#include "fived/comm/nccl_bootstrap.hpp"
#include "gpu_support.hpp"

using fived::CommError;
using fived::ReduceOp;
using fived::nccl::Comm;
using fived::test::DeviceBuffer;

namespace {

Comm world_of_one(std::string name = "world") {
  ncclUniqueId id{};
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  return Comm::init(1, 0, id, std::move(name));
}

}  // namespace

TEST_CASE("a world of one runs every collective") {
  Comm world = world_of_one();
  CHECK(world.rank() == 0);
  CHECK(world.size() == 1);
  CHECK(world.name() == "world");
  CHECK_NOTHROW(fived::test::check_collectives(world));
}

TEST_CASE("split") {
  Comm world = world_of_one();
  CHECK_NOTHROW(fived::test::check_split(world));
  CHECK_THROWS_WITH_AS(world.split(-1, 0, "none"),
                       "fived::nccl: rank 0 of 1 in split on group 'world': color -1 is negative: every rank must "
                       "join a group, pass a color >= 0",
                       CommError);
}

TEST_CASE("init_world without a launcher is a world of one") {
  Comm world = fived::nccl::init_world(fived::LaunchEnv{}, "solo");
  CHECK(world.size() == 1);
  CHECK(world.name() == "solo");
  CHECK_NOTHROW(world.barrier());
}

TEST_CASE("misuse is reported before NCCL is called and the communicator stays usable") {
  Comm c = world_of_one("tp");
  const cudaStream_t s = c.compute_stream();
  DeviceBuffer<float> a(std::vector<float>(6, 1.f), s), b(std::vector<float>(4, 0.f), s);
  const std::vector<std::size_t> two{2, 2}, one{6}, six{6};
  // "fived::nccl: rank 0 of 1 in <op> on group 'tp': <what is wrong>"
  const std::string at = "fived::nccl: rank 0 of 1 in ";
  const std::string where = " on group 'tp': ";

  CHECK_THROWS_WITH_AS(c.all_reduce(a.cspan(), b.span()),
                       (at + "all_reduce" + where + "send has 6 elements but recv has 4: they must be equal").c_str(),
                       CommError);
  CHECK_THROWS_WITH_AS(c.reduce_scatter(a.cspan(), b.span()),
                       (at + "reduce_scatter" + where +
                        "send has 6 elements but must have size() * recv.size() = 1 * 4 = 4")
                           .c_str(),
                       CommError);
  CHECK_THROWS_WITH_AS(c.all_gather(b.cspan(), a.span()),
                       (at + "all_gather" + where + "recv has 6 elements but must have size() * send.size() = 1 * 4 = 4")
                           .c_str(),
                       CommError);
  CHECK_THROWS_WITH_AS(c.all_to_all(a.cspan(), b.span()),
                       (at + "all_to_all" + where +
                        "send has 6 and recv 4 elements: they must be equal and a multiple of size() = 1")
                           .c_str(),
                       CommError);
  CHECK_THROWS_WITH_AS(c.all_to_all_v(a.cspan(), two, b.span(), one),
                       (at + "all_to_all_v" + where +
                        "send_counts has 2 and recv_counts 1 entries: give one per rank, size() = 1")
                           .c_str(),
                       CommError);
  CHECK_THROWS_WITH_AS(c.all_to_all_v(a.cspan(), six, b.span(), six),
                       (at + "all_to_all_v" + where +
                        "the counts add up to 6 sent / 6 received but the buffers hold 6 / 4: pass spans of exactly "
                        "the packed blocks")
                           .c_str(),
                       CommError);
  CHECK_THROWS_WITH_AS(c.broadcast(a.span(), 1),
                       (at + "broadcast" + where + "root 1 is not a rank of this group of 1: pass a group rank in [0, 1)")
                           .c_str(),
                       CommError);
  const fived::SendOp<float> to_two[] = {{a.cspan(), 2}};
  CHECK_THROWS_WITH_AS(c.send_recv(std::span<const fived::SendOp<float>>(to_two), {}),
                       (at + "send_recv" + where + "send peer 2 is not a rank of this group of 1: pass a group rank in [0, 1)")
                           .c_str(),
                       CommError);

  std::vector<float> host(4, 0.f);
  CHECK_THROWS_WITH_AS(c.all_reduce(b.cspan(), std::span<float>(host)),
                       (at + "all_reduce" + where +
                        "recv buffer is not device memory: the NCCL communicator moves memory from cudaMalloc (use "
                        "fived::host::Comm for host buffers)")
                           .c_str(),
                       CommError);
  CHECK_THROWS_WITH_AS(c.all_reduce(a.cspan().first(4), a.span().subspan(1, 4)),
                       (at + "all_reduce" + where +
                        "send and recv overlap without being the same buffer: pass recv == send for an in-place "
                        "all_reduce, or buffers that do not overlap")
                           .c_str(),
                       CommError);
  CHECK_THROWS_WITH_AS(c.all_to_all(a.cspan(), a.span()),
                       (at + "all_to_all" + where +
                        "send and recv overlap: all_to_all has no in-place form, use buffers that do not overlap")
                           .c_str(),
                       CommError);

  const fived::RecvOp<float> twice[] = {{b.span(), 0}, {b.span().first(2), 0}};
  CHECK_THROWS_WITH_AS(c.send_recv(std::span<const fived::SendOp<float>>{}, std::span<const fived::RecvOp<float>>(twice)),
                       doctest::Contains("receive buffers from peers 0 and 0"), CommError);

  // NCCL's in-place layouts are accepted (for rank 0 of 1: recv == send).
  CHECK_NOTHROW(c.reduce_scatter(b.cspan(), b.span()));
  CHECK_NOTHROW(c.all_gather(b.cspan(), b.span()));

  // None of that reached NCCL: the communicator still works.
  c.all_reduce(a.span(), ReduceOp::max);
  CHECK_NOTHROW(c.barrier());
  CHECK(a.download(s) == std::vector<float>(6, 1.f));
}

TEST_CASE("a moved-from communicator says so") {
  Comm c = world_of_one();
  Comm d = std::move(c);
  CHECK_THROWS_WITH_AS(c.barrier(), doctest::Contains("this communicator was moved from"), CommError);
  CHECK_NOTHROW(d.barrier());
  c = std::move(d);
  CHECK_NOTHROW(c.barrier());
}

TEST_CASE("collectives are ordered against a compute stream of the caller's") {
  Comm c = world_of_one();
  cudaStream_t mine = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking) == cudaSuccess);
  c.set_compute_stream(mine);
  CHECK(c.compute_stream() == mine);
  {
    const std::vector<std::int32_t> values{1, 2, 3, 4};
    DeviceBuffer<std::int32_t> buf(std::vector<std::int32_t>(4, 0), mine);
    DeviceBuffer<std::int32_t> out(std::vector<std::int32_t>(4, 0), mine);
    // Not synchronised: the collective must wait for this copy on `mine`.
    REQUIRE(cudaMemcpyAsync(buf.span().data(), values.data(), sizeof(std::int32_t) * 4, cudaMemcpyHostToDevice, mine) ==
            cudaSuccess);
    c.all_reduce(buf.cspan(), out.span());
    CHECK(out.download(mine) == values);
  }
  CHECK(cudaStreamDestroy(mine) == cudaSuccess);
}

TEST_CASE("an exchange begun (send_recv_begin) is the compute stream's after join()") {
  Comm c = world_of_one();
  cudaStream_t mine = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking) == cudaSuccess);
  c.set_compute_stream(mine);
  {
    // 64 MiB: an exchange that long is still running when a copy not ordered after it would
    // start (a few elements would arrive before any copy could look).
    constexpr std::size_t n = std::size_t{16} << 20;
    std::vector<float> values(n);
    for (std::size_t i = 0; i < n; ++i) values[i] = static_cast<float>(i % 1000 + 1);
    DeviceBuffer<float> from(values, mine), to(std::vector<float>(n, 0.0f), mine), seen(std::vector<float>(n, 0.0f), mine);
    const fived::SendOp<float> send{from.cspan(), 0};
    const fived::RecvOp<float> recv{to.span(), 0};
    c.send_recv_begin(std::span<const fived::SendOp<float>>(&send, 1), std::span<const fived::RecvOp<float>>(&recv, 1));
    c.join();
    // Queued on `mine` after join: it reads what arrived.
    REQUIRE(cudaMemcpyAsync(seen.span().data(), to.cspan().data(), sizeof(float) * n, cudaMemcpyDeviceToDevice, mine) ==
            cudaSuccess);
    CHECK(seen.download(mine) == values);
  }
  CHECK(cudaStreamDestroy(mine) == cudaSuccess);
}

TEST_CASE("bad arguments to init and a bad timeout are refused") {
  ncclUniqueId id{};
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  CHECK_THROWS_WITH_AS(Comm::init(2, 2, id, "w"),
                       "fived::nccl: rank 2 of 2 in init on group 'w': the rank must lie in [0, world_size) and "
                       "world_size must be positive",
                       CommError);
  ::setenv("FIVED_NCCL_TIMEOUT_S", "soon", 1);
  CHECK_THROWS_WITH_AS(world_of_one(),
                       "fived::nccl: FIVED_NCCL_TIMEOUT_S=soon is not a number of seconds: set it to a positive "
                       "number of seconds such as 600, or unset it for the default (600 s)",
                       CommError);
  ::setenv("FIVED_NCCL_TIMEOUT_S", "0", 1);
  CHECK_THROWS_WITH_AS(world_of_one(), doctest::Contains("FIVED_NCCL_TIMEOUT_S=0 is not a positive"), CommError);
  ::unsetenv("FIVED_NCCL_TIMEOUT_S");
}

TEST_CASE("a communicator destroyed while an exception unwinds is aborted, not waited for") {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    Comm c = world_of_one();
    c.barrier();
    throw std::runtime_error("this rank failed");
  } catch (const std::runtime_error&) {
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  CHECK_NOTHROW(world_of_one().barrier());  // NCCL is still usable afterwards
}

// Generic code can synchronize any Communicator.
static_assert(fived::Communicator<Comm>);
static_assert(std::is_same_v<decltype(std::declval<const Comm&>().name()), const std::string&>);

int main(int argc, char** argv) {
  if (fived::test::gpu_count() == 0) {
    std::puts("test_nccl_comm: no CUDA device found, skipping (exit 77)");
    return fived::test::skip_code;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
