#pragma once
// NCCL's unique id shared over MPI, as NCCL's own examples do: rank 0 makes
// it, MPI_Bcast hands it to the others. init_world() (nccl_bootstrap.hpp) uses
// this when the job was started by mpirun without MASTER_ADDR/MASTER_PORT.
//
// A header of its own so that everything else compiles without <mpi.h>;
// nccl_bootstrap.hpp includes it when FIVED_WITH_MPI is defined (link the
// program with MPI, e.g. CMake's MPI::MPI_CXX).

// Only MPI's C API is used: keep the deprecated C++ bindings (and their
// warnings) out.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#include <nccl.h>

#include <cstdlib>
#include <string>

#include "fived/comm/types.hpp"

namespace fived::nccl::mpi {

namespace detail {

inline void check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError("fived::nccl::init_world: " + std::string(call) + " failed: " + std::string(text, len));
}

// MPI_Init unless the program already did; then MPI is finalised at exit.
inline void ensure_initialized() {
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (initialized) return;
  int provided = 0;  // MPI_THREAD_MULTIPLE, as the host backend's processes start it (comm/mpi_process.hpp)
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  std::atexit([] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  });
}

}  // namespace detail

// The unique id made by MPI rank 0, on every rank. `rank` and `world_size`
// are what the launch environment says; MPI_COMM_WORLD must agree (it does
// not when, say, srun started processes without MPI support).
inline ncclUniqueId broadcast_unique_id(int rank, int world_size) {
  detail::ensure_initialized();
  int mpi_rank = 0, mpi_size = 0;
  detail::check(MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank), "MPI_Comm_rank");
  detail::check(MPI_Comm_size(MPI_COMM_WORLD, &mpi_size), "MPI_Comm_size");
  if (mpi_rank != rank || mpi_size != world_size)
    throw CommError("fived::nccl::init_world: the launch environment says rank " + std::to_string(rank) + " of " +
                    std::to_string(world_size) + " but MPI_COMM_WORLD says rank " + std::to_string(mpi_rank) +
                    " of " + std::to_string(mpi_size) +
                    ": launch with mpirun, or export MASTER_ADDR and MASTER_PORT to rendezvous without MPI");
  // The result travels with the id, so that no rank waits for an id rank 0 failed to make.
  struct {
    ncclResult_t result;
    ncclUniqueId id;
  } made{ncclSuccess, {}};
  if (rank == 0) made.result = ncclGetUniqueId(&made.id);
  detail::check(MPI_Bcast(&made, sizeof made, MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast of the NCCL unique id");
  if (made.result != ncclSuccess)
    throw CommError("fived::nccl::init_world: ncclGetUniqueId failed on rank 0: " +
                    std::string(ncclGetErrorString(made.result)));
  return made.id;
}

}  // namespace fived::nccl::mpi
