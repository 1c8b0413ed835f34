#pragma once
// Where this process sits in the job, read from the launcher's environment.
//
// fived starts no processes of its own: a job is launched by torchrun (or any
// launcher exporting RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE /
// MASTER_ADDR / MASTER_PORT), by mpirun (Open MPI's OMPI_COMM_WORLD_*) or by
// srun (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID), checked in that order.
// With none of them set the process runs alone: rank 0 of 1.
//
// Pure host C++: a misconfigured launch is reported here, with what to set,
// before any GPU or network is touched.

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

namespace fived {

struct LaunchEnv {
  int rank = 0;              // in the whole job
  int world_size = 1;
  int local_rank = 0;        // on this node: picks the GPU
  int local_world_size = 1;  // processes on this node
  std::string master_addr;   // host of rank 0 for the NCCL rendezvous; empty if not given
  int master_port = 0;       // 0 if not given
  std::string source;        // "torchrun", "mpirun", "srun" or "single process"
  // torchrun's own rendezvous store already listens on MASTER_PORT (it sets
  // TORCHELASTIC_RUN_ID), so NCCL's bootstrap must use another port.
  bool master_port_taken = false;
};

namespace detail {

using GetEnv = std::function<const char*(const char*)>;

// A variable's value, or nothing when unset or empty.
inline std::optional<std::string> env_value(const GetEnv& getenv, const char* name) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

inline int env_int(const char* name, const std::string& value, int min) {
  int out = 0;
  const char* first = value.data();
  const char* last = first + value.size();
  auto [end, ec] = std::from_chars(first, last, out);
  if (ec != std::errc{} || end != last || out < min)
    throw std::runtime_error(std::string(name) + "='" + value + "' is not " +
                             (min > 0 ? "a positive integer" : "a non-negative integer") +
                             ": fix or unset it in the launch environment");
  return out;
}

inline std::optional<int> env_int(const GetEnv& getenv, const char* name, int min) {
  auto v = env_value(getenv, name);
  if (!v) return std::nullopt;
  return env_int(name, *v, min);
}

// Number of tasks on node `node` from Slurm's compressed list, e.g. "4(x2),3".
inline std::optional<int> slurm_tasks_on_node(const std::string& list, int node) {
  std::string_view rest = list;
  while (!rest.empty()) {
    std::string_view item = rest.substr(0, rest.find(','));
    rest.remove_prefix(std::min(rest.size(), item.size() + 1));
    int tasks = 0, repeat = 1;
    auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), tasks);
    if (ec != std::errc{}) return std::nullopt;
    std::string_view tail(p, static_cast<std::size_t>(item.data() + item.size() - p));
    if (!tail.empty()) {
      if (tail.size() < 4 || tail.substr(0, 2) != "(x" || tail.back() != ')') return std::nullopt;
      auto [q, ec2] = std::from_chars(tail.data() + 2, tail.data() + tail.size() - 1, repeat);
      if (ec2 != std::errc{} || q != tail.data() + tail.size() - 1) return std::nullopt;
    }
    if (node < repeat) return tasks;
    node -= repeat;
  }
  return std::nullopt;
}

// The variables one launcher exports, and how to fix a launch that lacks some.
struct LauncherVars {
  const char* source;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;  // null for srun: derived from the task layout
  const char* hint;        // how to launch properly
};

inline constexpr LauncherVars torchrun_vars{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                            "launch with torchrun"};
inline constexpr LauncherVars mpirun_vars{"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                          "launch with Open MPI's mpirun"};
inline constexpr LauncherVars srun_vars{"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr,
                                        "launch with srun"};

inline void require_pair(const GetEnv& getenv, const char* set, const char* missing, const char* hint,
                         const std::string& what_missing) {
  if (env_value(getenv, set) && !env_value(getenv, missing))
    throw std::runtime_error(std::string(set) + " is set but " + missing + " is not: " + hint + ", or export " +
                             missing + "=<" + what_missing + ">");
}

// Reads one launcher's variables; nothing when that launcher did not start us.
inline std::optional<LaunchEnv> read_launcher(const GetEnv& getenv, const LauncherVars& v) {
  require_pair(getenv, v.rank, v.size, v.hint, "number of processes");
  require_pair(getenv, v.size, v.rank, v.hint, std::string("rank of this process, 0 to ") + v.size + "-1");
  auto rank = env_int(getenv, v.rank, 0);
  if (!rank) return std::nullopt;

  LaunchEnv e;
  e.source = v.source;
  e.rank = *rank;
  e.world_size = *env_int(getenv, v.size, 1);
  if (e.rank >= e.world_size)
    throw std::runtime_error(std::string(v.rank) + "=" + std::to_string(e.rank) + " is not below " + v.size + "=" +
                             std::to_string(e.world_size) + ": ranks run from 0 to " + v.size + "-1");

  // Without node-local variables, assume a single node (the job's GPUs are this node's).
  e.local_rank = env_int(getenv, v.local_rank, 0).value_or(e.rank);
  std::optional<int> local_size = v.local_size ? env_int(getenv, v.local_size, 1) : std::nullopt;
  // Slurm gives the per-node count only with --ntasks-per-node; otherwise
  // it is read from the task layout, e.g. SLURM_TASKS_PER_NODE=4(x2),3.
  if (!local_size && std::string_view(v.source) == "srun") {
    local_size = env_int(getenv, "SLURM_NTASKS_PER_NODE", 1);
    if (!local_size)
      if (auto list = env_value(getenv, "SLURM_TASKS_PER_NODE"))
        local_size = slurm_tasks_on_node(*list, env_int(getenv, "SLURM_NODEID", 0).value_or(0));
  }
  e.local_world_size = local_size.value_or(e.world_size);
  if (e.local_rank >= e.local_world_size)
    throw std::runtime_error(std::string(v.local_rank) + "=" + std::to_string(e.local_rank) +
                             " is not below the number of processes on this node (" +
                             std::to_string(e.local_world_size) + "): " + v.hint + ", or fix " + v.local_rank);
  return e;
}

}  // namespace detail

// The launch environment as seen through `getenv` (a parameter so tests can
// pass a fake environment). Throws std::runtime_error naming the variable to
// set or fix.
inline LaunchEnv launch_env_from(const std::function<const char*(const char*)>& getenv) {
  using namespace detail;
  std::optional<LaunchEnv> env;
  for (const LauncherVars* v : {&torchrun_vars, &mpirun_vars, &srun_vars})
    if ((env = read_launcher(getenv, *v))) break;
  if (!env) {
    env.emplace();
    env->source = "single process";
  }

  // The rendezvous address is the same for every launcher (torchrun sets it;
  // with mpirun or srun it may be exported by hand).
  require_pair(getenv, "MASTER_ADDR", "MASTER_PORT", "launch with torchrun",
               "free TCP port on MASTER_ADDR, 1024-65535");
  require_pair(getenv, "MASTER_PORT", "MASTER_ADDR", "launch with torchrun", "host name or address of rank 0");
  if (auto addr = env_value(getenv, "MASTER_ADDR")) {
    env->master_addr = *addr;
    env->master_port = *env_int(getenv, "MASTER_PORT", 1);
    if (env->master_port > 65535)
      throw std::runtime_error("MASTER_PORT=" + std::to_string(env->master_port) +
                               " is not a TCP port: choose a free port from 1024 to 65535");
    env->master_port_taken = env_value(getenv, "TORCHELASTIC_RUN_ID").has_value();
  }
  return *env;
}

// The launch environment of this process.
inline LaunchEnv launch_env() {
  return launch_env_from([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace fived
