# Defines fived::mpi (fived::fived + MPI, with FIVED_WITH_MPI) when MPI is found: the
# host backend's ranks as processes under mpirun, mpiexec or srun (comm/mpi.hpp), and,
# with fived::cuda, the MPI bootstrap of the NCCL communicator (comm/mpi_bootstrap.hpp).
# Used by fived's own build and by fivedConfig.cmake for consumers; does nothing when
# MPI is missing.
if(TARGET fived::mpi)
  return()
endif()
if(NOT TARGET MPI::MPI_CXX)
  find_package(MPI COMPONENTS CXX QUIET)
endif()
if(NOT TARGET MPI::MPI_CXX)
  message(STATUS "fived: fived::mpi not available (MPI not found)")
  return()
endif()
add_library(fived_mpi INTERFACE IMPORTED GLOBAL)
target_link_libraries(fived_mpi INTERFACE fived::fived MPI::MPI_CXX)
target_compile_definitions(fived_mpi INTERFACE FIVED_WITH_MPI=1)
add_library(fived::mpi ALIAS fived_mpi)
