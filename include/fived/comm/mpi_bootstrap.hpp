#pragma once
// NCCL's unique id shared over MPI, as NCCL's own examples do: rank 0 makes
// it, MPI_Bcast hands it to the others. init_world() (nccl_bootstrap.hpp) uses
// this when the job was started by mpirun without MASTER_ADDR/MASTER_PORT.
//
// A header of its own so that everything else compiles without <mpi.h>;
// nccl_bootstrap.hpp includes it when FIVED_WITH_MPI is defined (link the
// program with fived::mpi).

#include <nccl.h>

#include <string>

#include "fived/comm/mpi_process.hpp"  // MPI started once per process, and ended at exit
#include "fived/comm/types.hpp"

namespace fived::nccl::mpi {

// The unique id made by MPI rank 0, on every rank. `rank` and `world_size`
// are what the launch environment says; MPI_COMM_WORLD must agree (it does
// not when, say, srun started processes without MPI support).
inline ncclUniqueId broadcast_unique_id(int rank, int world_size) {
  const auto& process = ::fived::mpi::detail::Process::get();
  const int mpi_rank = process.rank, mpi_size = process.size;
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
  ::fived::mpi::detail::check(MPI_Bcast(&made, sizeof made, MPI_BYTE, 0, MPI_COMM_WORLD),
                              "MPI_Bcast of the NCCL unique id", "fived::nccl::init_world");
  if (made.result != ncclSuccess)
    throw CommError("fived::nccl::init_world: ncclGetUniqueId failed on rank 0: " +
                    std::string(ncclGetErrorString(made.result)));
  return made.id;
}

}  // namespace fived::nccl::mpi
