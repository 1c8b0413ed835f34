#pragma once
// The host backend: every rank is a thread of one process, collectives read
// each other's buffers through shared memory. It exists so that every parallel
// configuration can be tested without a GPU.
//
//   fived::host::run(8, [](fived::host::Comm& world) { ... });
//
// Or every rank is a process: built with FIVED_WITH_MPI (link fived::mpi) and
// started by mpirun, mpiexec or srun as n processes, run(n, fn) runs fn once in
// each, over MPI (comm/mpi.hpp), with the same results and the same checks.
// Results are deterministic: reductions add contributions in group-rank order,
// so every rank gets bit-identical values, run after run.
//
// Misuse never hangs. Each collective is a rendezvous on its group; the last
// rank to arrive checks that all ranks called the same collective with fitting
// sizes. A mismatch, an exception escaping a rank's function, a deadlock (every
// live rank waiting on a rendezvous that cannot complete) or a timeout aborts
// the run: every rank that waits or calls a collective afterwards gets a
// CommError naming itself, the collective, the group and the cause.
//
// Arguments are checked by the rules in comm/arguments.hpp, the same ones the
// NCCL backend applies, aliasing included: a call this backend accepts is not
// refused by NCCL for its buffers' layout.
//
// Messages name ranks by world rank: "fived host backend: rank 3 in all_reduce
// on group tp {2,3}: ...".
//
// The parts: host_world.hpp (what the threads of a run share), host_comm.hpp
// (host::Comm), mpi.hpp (a rank as a process); this file runs them.

#include <algorithm>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "fived/comm/host_comm.hpp"
#include "fived/comm/types.hpp"
#include "fived/device/buffer.hpp"

namespace fived::host {

namespace detail {

// run() in a process that an MPI launcher started as one of several: this
// process is one rank, fn runs once, on the world of the job's processes. A rank
// whose fn throws tells its peers (comm/mpi_process.hpp), so that each of them
// stops with a CommError naming it, and rethrows.
#if defined(FIVED_WITH_MPI)
template <class F>
void run_as_process(int n, F& fn, const RunOptions& opts) {
  auto& process = mpi::detail::Process::get();
  process.timeout = resolve_timeout(opts, 60.0);
  if (process.size != n)
    throw CommError("fived::host::run: this run has " + std::to_string(n) + " ranks but the launcher started " +
                    std::to_string(process.size) + " processes: start one process per rank (mpirun -np " +
                    std::to_string(n) + "), or one process to run the ranks as its threads");
  const std::string me = "rank " + std::to_string(process.rank);
  try {
    Comm world(mpi::Group::world());
    fn(world);
  } catch (const CommError& e) {
    process.fail(me + " failed: " + e.what(), /*tell_peers=*/true);  // told only when it is the first cause
    throw;
  } catch (const std::exception& e) {
    process.fail(me + " threw: " + e.what(), /*tell_peers=*/true);
    throw;
  } catch (...) {
    process.fail(me + " threw an exception that is not a std::exception", /*tell_peers=*/true);
    throw;
  }
}
#endif

}  // namespace detail

// Whether run() runs this program's ranks as processes: built with MPI and
// started by an MPI launcher as more than one process.
inline bool ranks_are_processes() {
#if defined(FIVED_WITH_MPI)
  const std::optional<int> processes = mpi::launched_size();
  return processes && *processes > 1;
#else
  return false;
#endif
}

// Runs fn(world) on n threads, one per rank, and waits for all of them. A
// message sent and never received makes it throw CommError at the end. If any
// rank throws, the run is aborted (peers blocked in collectives get a
// CommError) and, once every thread has ended, the first rank's exception in
// rank order whose cause is not another rank's failure is rethrown. A bad
// RunOptions::timeout or FIVED_HOST_TIMEOUT_S throws std::invalid_argument
// before any rank starts. Launched by mpirun (or mpiexec, srun) as n processes
// and built with FIVED_WITH_MPI, it runs fn once in this process, as its rank
// (detail::run_as_process above).
// "ranks as processes (MPI)" or "ranks as threads": what progress lines say of the backend.
inline const char* ranks_are() { return ranks_are_processes() ? "ranks as processes (MPI)" : "ranks as threads"; }

template <class F>
void run(int n, F&& fn, RunOptions opts = {}) {
  if (n < 1) throw std::invalid_argument("fived::host::run needs at least one rank, got " + std::to_string(n));
#if defined(FIVED_WITH_MPI)
  if (ranks_are_processes()) return detail::run_as_process(n, fn, opts);
#endif
  auto world = std::make_shared<detail::World>(n, detail::resolve_timeout(opts));
  auto group = std::make_shared<detail::Group>();
  world->groups.push_back(group);
  group->name = "world";
  for (int r = 0; r < n; ++r) group->members.push_back(r);

  // The ranks share this process's count of held bytes while they run (device/buffer.hpp).
  struct Sharing {
    int before;
    explicit Sharing(int n) : before(host_ranks_in_process().exchange(n)) {}
    ~Sharing() { host_ranks_in_process() = before; }
  } sharing(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<bool> origin(n, false);  // this rank's error is the cause, not a consequence
  std::vector<std::thread> threads;
  threads.reserve(n);
  // A thread that cannot be started ends the run: the started ranks are aborted and joined
  // (a std::thread destroyed while joinable would terminate the process), then a sentence.
  auto could_not_start = [&](int r, const std::exception& e) {
    {
      std::lock_guard lk(world->mu);
      for (int q = r; q < n; ++q) world->finished[q] = true;
      world->abort("the thread of rank " + std::to_string(r) + " could not be started (" + e.what() + ")");
    }
    for (auto& t : threads) t.join();
    throw CommError("fived::host::run: could not start the thread of rank " + std::to_string(r) + " of " +
                    std::to_string(n) + " (" + e.what() + "): run fewer ranks as threads of one process");
  };
  for (int r = 0; r < n; ++r) {
    try {
      threads.emplace_back([&, r] {
        {
          std::lock_guard lk(world->mu);
          world->own_thread[static_cast<std::size_t>(r)] = std::this_thread::get_id();
          (void)world->slot_of(r);  // the rank's own thread counts from the start (see World::wait)
        }
        Comm comm(world, group, r);
        try {
          fn(comm);
        } catch (const CommError& e) {
          errors[r] = std::current_exception();
          std::lock_guard lk(world->mu);
          origin[r] = world->abort_reason.empty();
          world->abort("rank " + std::to_string(r) + " failed: " + e.what());
        } catch (const std::exception& e) {
          errors[r] = std::current_exception();
          std::lock_guard lk(world->mu);
          origin[r] = true;
          world->abort("rank " + std::to_string(r) + " threw: " + e.what());
        } catch (...) {
          errors[r] = std::current_exception();
          std::lock_guard lk(world->mu);
          origin[r] = true;
          world->abort("rank " + std::to_string(r) + " threw an exception that is not a std::exception");
        }
        std::lock_guard lk(world->mu);
        world->finished[r] = true;
        world->check_deadlock();
      });
    } catch (const std::system_error& e) {
      could_not_start(r, e);
    } catch (const std::bad_alloc& e) {
      could_not_start(r, e);
    }
  }
  for (auto& t : threads) t.join();
  {
    std::lock_guard lk(world->mu);
    world->ended = true;
  }
  if (std::none_of(errors.begin(), errors.end(), [](const auto& e) { return e != nullptr; }))
    if (auto why = world->undelivered(); !why.empty())
      throw CommError("fived host backend: the run ended with point-to-point messages nobody received "
                      "(every send needs a matching receive):" + why);
  for (int r = 0; r < n; ++r)
    if (errors[r] && origin[r]) std::rethrow_exception(errors[r]);
  for (int r = 0; r < n; ++r)
    if (errors[r]) std::rethrow_exception(errors[r]);
}


}  // namespace fived::host