#!/usr/bin/env bash
# Usage: scripts/launch-local.sh <ranks> [--mpirun <mpiexec>] <program> [args...]
#
#   scripts/launch-local.sh 4 build/examples/train_gpt_cuda      # Mesh<DP<2>, TP<2>> on one GPU
#
# Starts <ranks> processes of <program> on this machine as one NCCL job, the
# way torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
# MASTER_ADDR=127.0.0.1, MASTER_PORT=<a free port>), or through mpirun with
# --mpirun. Each rank gets NCCL_HOSTID=h<rank>: NCCL (up to 2.29) refuses two
# ranks on one GPU, and distinct host ids make it treat them as separate hosts
# talking over loopback sockets — slow, but the real library.
#
# Exit status: 0 when every rank succeeds, 77 (skipped) when every rank
# reports 77 (no GPU), otherwise 1. If one rank fails, the others are stopped
# rather than left waiting for it.
set -u

n=${1:?usage: launch-local.sh <ranks> [--mpirun <mpiexec>] <program> [args...]}
shift
mpiexec=""
if [[ ${1:-} == --mpirun ]]; then
  mpiexec=${2:?--mpirun needs the mpiexec executable}
  shift 2
fi
(($# >= 1)) || { echo "launch-local.sh: no program given" >&2; exit 2; }

# Loopback only; a failed or hung peer becomes an error in bounded time.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export FIVED_NCCL_TIMEOUT_S=${FIVED_NCCL_TIMEOUT_S:-120}
limit=${FIVED_TEST_RANK_TIMEOUT_S:-300}

if [[ -n $mpiexec ]]; then
  # mpirun sets OMPI_COMM_WORLD_*; init_world shares the id with MPI_Bcast.
  "$mpiexec" --allow-run-as-root --oversubscribe -np "$n" \
    timeout "$limit" bash -c 'NCCL_HOSTID=h$OMPI_COMM_WORLD_RANK exec "$@"' rank "$@"
  status=$?
  # mpirun reports the first non-zero exit code of its processes.
  exit $((status == 0 || status == 77 ? status : 1))
fi

# A TCP port nothing listens on (bash's /dev/tcp connects, or fails), below the kernel's
# ephemeral range: NCCL's own connections take ports from that range, and one of them holding
# the chosen port makes the root's bind fail ("Address already in use").
read -r ephemeral _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || ephemeral=32768
((ephemeral > 12000)) || ephemeral=32768
port=""
for _ in $(seq 50); do
  candidate=$((10000 + RANDOM % (ephemeral - 10000)))
  if ! (exec 3<>"/dev/tcp/127.0.0.1/$candidate") 2>/dev/null; then
    port=$candidate
    break
  fi
done
[[ -n $port ]] || { echo "launch-local.sh: no free port found" >&2; exit 1; }

declare -A rank_of
for ((r = 0; r < n; ++r)); do
  RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    NCCL_HOSTID=h$r timeout "$limit" "$@" &
  rank_of[$!]=$r
done

# Collect ranks as they end (polling keeps this portable to bash < 5.1,
# which lacks `wait -n -p`); on the first failure stop the rest.
skipped=0 failed=0
while ((${#rank_of[@]} > 0)); do
  for pid in "${!rank_of[@]}"; do
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid"
    rc=$?
    rank=${rank_of[$pid]}
    unset "rank_of[$pid]"
    if ((rc == 77)); then
      skipped=$((skipped + 1))
    elif ((rc != 0 && !failed)); then
      echo "launch-local.sh: rank $rank exited with $rc; stopping the others" >&2
      failed=1
      # Each rank runs in its timeout's process group: end it whole, now (a rank catches
      # SIGTERM to stop after its step, which a rank waiting on a dead peer never ends).
      for other in "${!rank_of[@]}"; do kill -KILL -- "-$other" 2>/dev/null; done
    fi
  done
  sleep 0.1
done

if ((failed)); then exit 1; fi
if ((skipped == n)); then echo "launch-local.sh: no GPU, skipped"; exit 77; fi
if ((skipped > 0)); then echo "launch-local.sh: only some ranks found a GPU" >&2; exit 1; fi
echo "launch-local.sh: all $n ranks succeeded"
