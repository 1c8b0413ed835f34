// The host backend with its ranks as processes (comm/mpi.hpp), driven by tests/mpi/check.sh:
//
//   mpi_ranks collectives    every collective on 4 ranks, rank 0 prints the bits of what it got:
//                            the same program started once (threads) prints the same lines
//   mpi_ranks throw          rank 2 throws in its fourth step; the others are in an all_reduce
//   mpi_ranks mismatch       rank 1 passes 3 elements to an all_reduce, the others 4
//   mpi_ranks message        rank 1 sends rank 0 3 floats where it expects 4 (only rank 0 can see
//                            it: the others, in their all_reduce, must be told)
//   mpi_ranks stuck          rank 2 sleeps for 10 minutes before its all_reduce (run with a short
//                            FIVED_HOST_TIMEOUT_S)
//   mpi_ranks loop           all_reduces until killed (the test kills a rank)
//
// Each rank that fails prints "mpi_ranks: <what>" on stderr and exits 1.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fived/comm/host.hpp"

using fived::host::Comm;

namespace {

// Bits, not decimals: processes and threads must agree exactly.
template <class T>
void print(Comm& c, const char* what, const std::vector<T>& v) {
  if (c.world_rank() != 0) return;
  std::printf("%s:", what);
  for (const T& x : v) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &x, sizeof x);
    std::printf(" %llx", static_cast<unsigned long long>(bits));
  }
  std::printf("\n");
}

// Values whose sums depend on the order they are added in.
template <class T>
std::vector<T> values(int rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(1.0 / (3.0 + rank * 7.0 + i) * (rank % 2 ? 1e6 : 1e-3));
  return v;
}

void collectives(Comm& world) {
  const int r = world.rank(), n = world.size();
  for (auto op : {fived::ReduceOp::sum, fived::ReduceOp::avg, fived::ReduceOp::max}) {
    std::vector<float> f = values<float>(r, 5);
    world.all_reduce<float>(f, op);
    print(world, "all_reduce float", f);
  }
  std::vector<double> d = values<double>(r, 4), d_out(4);
  world.all_reduce<double>(d, d_out);
  print(world, "all_reduce double", d_out);
  std::vector<fived::bf16> h(3);
  for (int i = 0; i < 3; ++i) h[i] = fived::bf16(values<float>(r, 3)[i]);
  world.all_reduce<fived::bf16>(h);
  print(world, "all_reduce bf16", h);

  std::vector<float> rs_in = values<float>(r, 2 * n), rs(2);
  world.reduce_scatter<float>(rs_in, rs);
  world.all_gather<float>(std::vector<float>(rs), rs_in);  // everyone's piece, to print on rank 0
  print(world, "reduce_scatter", rs_in);

  std::vector<std::int32_t> a2a(n), a2a_out(n);
  for (int j = 0; j < n; ++j) a2a[j] = 100 * r + j;
  world.all_to_all<std::int32_t>(a2a, a2a_out);
  std::vector<std::int32_t> every(n * n);
  world.all_gather<std::int32_t>(a2a_out, every);
  print(world, "all_to_all", every);

  // all_to_all_v: rank r sends j+1 values to rank j.
  std::vector<std::size_t> sc(n), rc(n, static_cast<std::size_t>(r + 1));
  std::vector<std::int64_t> sv;
  for (int j = 0; j < n; ++j) {
    sc[j] = static_cast<std::size_t>(j + 1);
    for (int k = 0; k <= j; ++k) sv.push_back(1000 * r + 10 * j + k);
  }
  std::vector<std::int64_t> rv(static_cast<std::size_t>(n * (r + 1)));
  world.all_to_all_v<std::int64_t>(sv, sc, rv, rc);
  std::vector<std::int64_t> sizes{static_cast<std::int64_t>(rv.size())}, first(1, rv.empty() ? -1 : rv.back());
  world.all_reduce<std::int64_t>(first);
  print(world, "all_to_all_v", first);

  std::vector<double> b = values<double>(r, 3);
  world.broadcast<double>(b, 2);
  print(world, "broadcast", b);

  // A ring of point-to-point messages, both ways at once.
  std::vector<float> right = values<float>(r, 4), from_left(4), left = values<float>(r + 10, 2), from_right(2);
  const fived::SendOp<float> sends[] = {{right, (r + 1) % n}, {left, (r + n - 1) % n}};
  const fived::RecvOp<float> recvs[] = {{from_left, (r + n - 1) % n}, {from_right, (r + 1) % n}};
  world.send_recv<float>(sends, recvs);
  std::vector<float> ring(n * 6);
  from_left.insert(from_left.end(), from_right.begin(), from_right.end());
  world.all_gather<float>(from_left, ring);
  print(world, "send_recv", ring);

  // Groups: pairs {0,1} {2,3} keyed in reverse, then an all_reduce over each.
  Comm pair = world.split(r / 2, -r, "pair");
  std::vector<double> p = values<double>(r, 3);
  pair.all_reduce<double>(p);
  std::vector<double> both(3 * n);
  world.all_gather<double>(p, both);
  print(world, "split", both);
  std::vector<std::int64_t> ranks{pair.rank(), pair.world_rank(), pair.size()}, all_ranks(3 * n);
  world.all_gather<std::int64_t>(ranks, all_ranks);
  print(world, "split ranks", all_ranks);
  if (world.world_rank() == 0) std::printf("group: %s\n", pair.name().c_str());
  world.barrier();
}

void loop(Comm& world, int failing_rank, const std::string& how) {
  for (int step = 0;; ++step) {
    if (world.rank() == failing_rank && step == 3) {
      if (how == "throw") throw std::runtime_error("boom in step 3");
      if (how == "stuck") std::this_thread::sleep_for(std::chrono::minutes(10));
    }
    if (how == "message" && step == 3 && world.rank() < 2) {
      std::vector<float> out(3, 1.0f), in(4);
      const fived::SendOp<float> send[] = {{out, 0}};
      const fived::RecvOp<float> recv[] = {{in, 1}};
      if (world.rank() == 1) world.send_recv<float>(send, {});
      else world.send_recv<float>({}, recv);
    }
    std::vector<float> v(4 - (how == "mismatch" && world.rank() == 1 && step == 3), 1.0f);
    world.all_reduce<float>(v);
    if (how == "loop") std::this_thread::sleep_for(std::chrono::milliseconds(20));
    else if (step > 100) return;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "collectives";
  try {
    fived::host::run(4, [&](Comm& world) {
      if (mode == "collectives") collectives(world);
      else loop(world, 2, mode);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_ranks: %s\n", e.what());
    return 1;
  }
  return 0;
}
