#pragma once
// fived::nccl::init_world(): the world communicator of a launched job.
//
// Every rank needs the same ncclUniqueId. Where it comes from, first match:
//   * world size 1: made locally, nothing to share;
//   * NCCL_COMM_ID=host:port already in the environment: NCCL's own rendezvous;
//   * MASTER_ADDR / MASTER_PORT (torchrun-style): init_world sets
//     NCCL_COMM_ID=MASTER_ADDR:MASTER_PORT on every rank while the
//     communicator is created. ncclGetUniqueId then encodes that address
//     instead of a random one, so all ranks compute the same id with no
//     exchange, and rank 0 listens on it inside ncclCommInitRank;
//   * with FIVED_WITH_MPI: an MPI broadcast from rank 0 (mpi_bootstrap.hpp);
//   * otherwise a clear error saying what to export.
// The port must be free on MASTER_ADDR. Under a real torchrun its own store
// already listens on MASTER_PORT: export NCCL_COMM_ID=<MASTER_ADDR>:<another
// port> there.

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "fived/comm/bootstrap.hpp"
#include "fived/comm/nccl.hpp"
#include "fived/comm/types.hpp"

#if defined(FIVED_WITH_MPI)
#include "fived/comm/mpi_bootstrap.hpp"
#endif

namespace fived::nccl {

namespace detail {

inline std::string init_context(const LaunchEnv& env) {
  return "fived::nccl::init_world (rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
         ", launched by " + env.source + ")";
}

// Each process drives the GPU its node-local rank names (wrapping around when
// there are fewer GPUs than processes, as when testing several ranks on one).
inline int select_device(const LaunchEnv& env) {
  int count = 0;  // untouched by a failing call
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    throw CommError(init_context(env) + ": no CUDA device found (cudaGetDeviceCount: " +
                    (e != cudaSuccess ? std::string(cudaGetErrorString(e)) : std::string("0 devices")) +
                    "): the NCCL communicator needs a GPU; on a machine without one use the host backend");
  }
  const int device = env.local_rank % count;
  if (cudaError_t s = cudaSetDevice(device); s != cudaSuccess)
    throw CommError(init_context(env) + ": cudaSetDevice(" + std::to_string(device) +
                    ") failed: " + cudaGetErrorString(s));
  return device;
}

// NCCL_COMM_ID's format: host:port, with IPv6 addresses in brackets.
inline std::string comm_id_address(const std::string& addr, int port) {
  const bool ipv6 = addr.find(':') != std::string::npos && addr.front() != '[';
  return (ipv6 ? "[" + addr + "]" : addr) + ":" + std::to_string(port);
}

// Sets an environment variable while alive, then puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

inline ncclUniqueId local_unique_id(const LaunchEnv& env) {
  ncclUniqueId id{};
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
    throw CommError(init_context(env) + ": ncclGetUniqueId failed: " + ncclGetErrorString(r));
  return id;
}

}  // namespace detail

// The world communicator for the launch environment `env` (see launch_env()):
// selects this process's GPU, agrees on the unique id, creates the
// communicator. Collective: every rank of the job calls it.
inline Comm init_world(const LaunchEnv& env, std::string name = "world") {
  detail::select_device(env);
  const char* user_comm_id = std::getenv("NCCL_COMM_ID");
  if (env.world_size == 1 || (user_comm_id != nullptr && *user_comm_id != '\0'))
    return Comm::init(env.world_size, env.rank, detail::local_unique_id(env), std::move(name));
  if (!env.master_addr.empty()) {
    // Under torchrun its store holds MASTER_PORT: NCCL's root listens on the
    // next port (export NCCL_COMM_ID=<addr>:<port> to choose another).
    const int port = env.master_port + (env.master_port_taken ? 1 : 0);
    if (port > 65535)
      throw CommError(detail::init_context(env) + ": MASTER_PORT=65535 leaves no port for NCCL next to torchrun's "
                                                  "store: choose a lower MASTER_PORT or export NCCL_COMM_ID=<addr>:<port>");
    // Must stay set through ncclCommInitRank, where rank 0 starts listening.
    detail::ScopedEnv comm_id("NCCL_COMM_ID", detail::comm_id_address(env.master_addr, port));
    return Comm::init(env.world_size, env.rank, detail::local_unique_id(env), std::move(name));
  }
#if defined(FIVED_WITH_MPI)
  return Comm::init(env.world_size, env.rank, mpi::broadcast_unique_id(env.rank, env.world_size), std::move(name));
#else
  throw CommError(detail::init_context(env) +
                  ": the ranks have no way to agree on NCCL's unique id: export MASTER_ADDR=<host of rank 0> and "
                  "MASTER_PORT=<free port> on every rank (torchrun does), or build with MPI (FIVED_WITH_MPI) and "
                  "launch with mpirun");
#endif
}

// The world communicator of this process's launch (launch_env()).
inline Comm init_world(std::string name = "world") { return init_world(launch_env(), std::move(name)); }

}  // namespace fived::nccl
