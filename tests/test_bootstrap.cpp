// launch_env_from: how each launcher's environment is read, and what a broken
// launch is told to fix. Fake environments only: no process is started.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <map>
#include <stdexcept>
#include <string>

#include "fived/comm/bootstrap.hpp"

using fived::LaunchEnv;
using fived::launch_env_from;

namespace {

using Vars = std::map<std::string, std::string>;

LaunchEnv read(const Vars& vars) {
  return launch_env_from([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const Vars& vars) {
  try {
    read(vars);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(no error)";
}

void check_env(const LaunchEnv& e, int rank, int world, int local_rank, int local_world, const std::string& source) {
  CHECK(e.rank == rank);
  CHECK(e.world_size == world);
  CHECK(e.local_rank == local_rank);
  CHECK(e.local_world_size == local_world);
  CHECK(e.source == source);
}

}  // namespace

TEST_CASE("nothing set: a single process") {
  LaunchEnv e = read({});
  check_env(e, 0, 1, 0, 1, "single process");
  CHECK(e.master_addr.empty());
  CHECK(e.master_port == 0);
}

TEST_CASE("torchrun-style variables") {
  LaunchEnv e = read({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                      {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
  check_env(e, 3, 8, 1, 2, "torchrun");
  CHECK(e.master_addr == "node0");
  CHECK(e.master_port == 29500);

  SUBCASE("without node-local variables the job is taken to be one node") {
    check_env(read({{"RANK", "3"}, {"WORLD_SIZE", "8"}}), 3, 8, 3, 8, "torchrun");
  }
  SUBCASE("an empty value counts as unset") {
    check_env(read({{"RANK", ""}, {"WORLD_SIZE", ""}}), 0, 1, 0, 1, "single process");
  }
}

TEST_CASE("torchrun-style mistakes say what to set") {
  CHECK(error_of({{"RANK", "1"}}) ==
        "RANK is set but WORLD_SIZE is not: launch with torchrun, or export WORLD_SIZE=<number of processes>");
  CHECK(error_of({{"WORLD_SIZE", "4"}}) ==
        "WORLD_SIZE is set but RANK is not: launch with torchrun, or export RANK=<rank of this process, 0 to "
        "WORLD_SIZE-1>");
  CHECK(error_of({{"RANK", "5"}, {"WORLD_SIZE", "4"}}) ==
        "RANK=5 is not below WORLD_SIZE=4: ranks run from 0 to WORLD_SIZE-1");
  CHECK(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}) ==
        "RANK=4 is not below WORLD_SIZE=4: ranks run from 0 to WORLD_SIZE-1");
  CHECK(error_of({{"RANK", "abc"}, {"WORLD_SIZE", "4"}}) ==
        "RANK='abc' is not a non-negative integer: fix or unset it in the launch environment");
  CHECK(error_of({{"RANK", "1x"}, {"WORLD_SIZE", "4"}}) ==
        "RANK='1x' is not a non-negative integer: fix or unset it in the launch environment");
  CHECK(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}) ==
        "RANK='-1' is not a non-negative integer: fix or unset it in the launch environment");
  CHECK(error_of({{"RANK", " 1"}, {"WORLD_SIZE", "4"}}) ==
        "RANK=' 1' is not a non-negative integer: fix or unset it in the launch environment");
  CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}) ==
        "WORLD_SIZE='0' is not a positive integer: fix or unset it in the launch environment");
  CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}) ==
        "WORLD_SIZE='99999999999' is not a positive integer: fix or unset it in the launch environment");
  CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "two"}}) ==
        "LOCAL_RANK='two' is not a non-negative integer: fix or unset it in the launch environment");
  CHECK(error_of({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}) ==
        "LOCAL_RANK=2 is not below the number of processes on this node (2): launch with torchrun, or fix "
        "LOCAL_RANK");
}

TEST_CASE("rendezvous address") {
  CHECK(error_of({{"MASTER_ADDR", "node0"}}) ==
        "MASTER_ADDR is set but MASTER_PORT is not: launch with torchrun, or export MASTER_PORT=<free TCP port on "
        "MASTER_ADDR, 1024-65535>");
  CHECK(error_of({{"MASTER_PORT", "29500"}}) ==
        "MASTER_PORT is set but MASTER_ADDR is not: launch with torchrun, or export MASTER_ADDR=<host name or "
        "address of rank 0>");
  CHECK(error_of({{"MASTER_ADDR", "node0"}, {"MASTER_PORT", "http"}}) ==
        "MASTER_PORT='http' is not a positive integer: fix or unset it in the launch environment");
  CHECK(error_of({{"MASTER_ADDR", "node0"}, {"MASTER_PORT", "0"}}) ==
        "MASTER_PORT='0' is not a positive integer: fix or unset it in the launch environment");
  CHECK(error_of({{"MASTER_ADDR", "node0"}, {"MASTER_PORT", "70000"}}) ==
        "MASTER_PORT=70000 is not a TCP port: choose a free port from 1024 to 65535");

  SUBCASE("read with any launcher, e.g. exported by hand under mpirun") {
    LaunchEnv e = read({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                        {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}});
    CHECK(e.source == "mpirun");
    CHECK(e.master_addr == "127.0.0.1");
    CHECK(e.master_port == 1234);
    CHECK_FALSE(e.master_port_taken);
  }
  SUBCASE("under real torchrun its store holds MASTER_PORT") {
    LaunchEnv e = read({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"},
                        {"TORCHELASTIC_RUN_ID", "none"}});
    CHECK(e.master_port == 29500);
    CHECK(e.master_port_taken);
  }
}

TEST_CASE("mpirun (Open MPI) variables") {
  check_env(read({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}),
            5, 8, 1, 4, "mpirun");
  CHECK(error_of({{"OMPI_COMM_WORLD_RANK", "1"}}) ==
        "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not: launch with Open MPI's mpirun, or export "
        "OMPI_COMM_WORLD_SIZE=<number of processes>");
  CHECK(error_of({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}}) ==
        "OMPI_COMM_WORLD_RANK=2 is not below OMPI_COMM_WORLD_SIZE=2: ranks run from 0 to OMPI_COMM_WORLD_SIZE-1");
}

TEST_CASE("srun (Slurm) variables") {
  const Vars base{{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}};
  auto with = [&](Vars extra) {
    extra.insert(base.begin(), base.end());
    return read(extra);
  };
  check_env(with({{"SLURM_NTASKS_PER_NODE", "4"}}), 5, 8, 1, 4, "srun");
  check_env(with({{"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_NODEID", "1"}}), 5, 8, 1, 4, "srun");
  check_env(with({{"SLURM_TASKS_PER_NODE", "3,5"}, {"SLURM_NODEID", "1"}}), 5, 8, 1, 5, "srun");
  check_env(with({{"SLURM_TASKS_PER_NODE", "2(x3),2"}, {"SLURM_NODEID", "3"}}), 5, 8, 1, 2, "srun");
  SUBCASE("an unreadable task layout falls back to one node") {
    check_env(with({{"SLURM_TASKS_PER_NODE", "4(y2)"}}), 5, 8, 1, 8, "srun");
    check_env(with({}), 5, 8, 1, 8, "srun");
  }
  CHECK(error_of({{"SLURM_NTASKS", "8"}}) ==
        "SLURM_NTASKS is set but SLURM_PROCID is not: launch with srun, or export SLURM_PROCID=<rank of this "
        "process, 0 to SLURM_NTASKS-1>");
}

TEST_CASE("launchers are tried in order: torchrun, mpirun, srun") {
  const Vars all{{"RANK", "1"},         {"WORLD_SIZE", "2"},    {"OMPI_COMM_WORLD_RANK", "3"},
                 {"OMPI_COMM_WORLD_SIZE", "4"}, {"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}};
  check_env(read(all), 1, 2, 1, 2, "torchrun");
  Vars no_torchrun = all;
  no_torchrun.erase("RANK"), no_torchrun.erase("WORLD_SIZE");
  check_env(read(no_torchrun), 3, 4, 3, 4, "mpirun");
  Vars only_slurm = no_torchrun;
  only_slurm.erase("OMPI_COMM_WORLD_RANK"), only_slurm.erase("OMPI_COMM_WORLD_SIZE");
  check_env(read(only_slurm), 5, 6, 5, 6, "srun");
}

TEST_CASE("Slurm's compressed task list") {
  using fived::detail::slurm_tasks_on_node;
  CHECK(slurm_tasks_on_node("4", 0) == 4);
  CHECK(slurm_tasks_on_node("4(x2)", 1) == 4);
  CHECK(slurm_tasks_on_node("4(x2)", 2) == std::nullopt);
  CHECK(slurm_tasks_on_node("4(x2),1", 2) == 1);
  CHECK(slurm_tasks_on_node("", 0) == std::nullopt);
  CHECK(slurm_tasks_on_node("x", 0) == std::nullopt);
  CHECK(slurm_tasks_on_node("4(x)", 0) == std::nullopt);
  CHECK(slurm_tasks_on_node("4(x2", 0) == std::nullopt);
}
