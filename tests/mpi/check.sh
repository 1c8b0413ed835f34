#!/usr/bin/env bash
# The host backend's ranks as processes, checked against its ranks as threads
# (ctest -L mpi; tests/mpi/CMakeLists.txt names each case):
#
#   check.sh MPIEXEC collectives MPI_RANKS           every collective: the same bits as the threads
#   check.sh MPIEXEC fails MODE MPI_RANKS            rank 2 throws / is stuck, rank 1 miscalls or sends
#                                                    rank 0 a message of the wrong size: every
#                                                    rank exits non-zero, in bounded time, naming it
#   check.sh MPIEXEC killed TRAIN_GPT                SIGKILL to rank 2 of 4 mid-step: the other three
#                                                    stop within 60 s, each naming rank 2
#   check.sh MPIEXEC train TRAIN_GPT MESH RANKS      losses and held-out losses as the threads print them
#   check.sh MPIEXEC moe TRAIN_MOE                   a mixture of experts on DP 2 x TP 2 x EP 2: the threads'
#                                                    losses and tokens per expert (all_to_all_v, empty experts)
#   check.sh MPIEXEC resume TRAIN_GPT                a checkpoint written by processes resumes bit for bit
#                                                    (and processes write what threads write)
#   check.sh MPIEXEC reshard TRAIN_GPT               saved by 16 processes (5D mesh), resumed by 4 on
#                                                    DP 2 x TP 2: the same files as threads resuming it
#
# Runs in a fresh folder under the current one; prints what it compared.
set -euo pipefail

mpiexec="$1" case="$2"
shift 2
launch=("$mpiexec")
if "$mpiexec" --version 2>&1 | grep -q "Open MPI\|OpenRTE"; then
  launch+=(--oversubscribe)  # more ranks than cores: CI has two
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # CI runs as root
  export OMPI_MCA_btl_vader_single_copy_mechanism=none  # containers forbid cross-process memory access
fi
work="mpi-$case-$$"
rm -rf "$work" && mkdir "$work" && cd "$work"

fail() { echo "FAIL: $*" >&2; exit 1; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }
seconds_since() { local ms=$(($(now_ms) - $1)); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }
within_60_s() { [ $(($(now_ms) - $1)) -lt 60000 ]; }
# The numbers a run reports: its progress lines (step, loss, lr, gradient norm) and held-out losses.
losses() { awk '/^ +[0-9]+ +[0-9.]+ +[0-9.e+-]+ /{print $1, $2, $3, $4} /held-out loss/'; }
# train_moe's progress lines: all but tokens/s (loss, balancing loss, tokens per expert).
moe_rows() { awk '/^ +[0-9]+ +[0-9.]+ /{$4 = ""; print}'; }
args=(--batch 8 --seq 32 --log-every 1)

# Runs `program args` as threads and as `ranks` processes; the lines `filter` keeps (at
# least `lines` of them) must be the same.
same_as_threads() {
  local filter="$1" lines="$2" ranks="$3"
  shift 3
  "$@" | "$filter" >threads.txt
  "${launch[@]}" -np "$ranks" "$@" >processes.log
  "$filter" <processes.log >processes.txt
  grep -q "ranks as processes" processes.log || fail "the run did not say its ranks are processes"
  [ "$(wc -l <processes.txt)" -ge "$lines" ] || fail "fewer than $lines lines to compare"
  diff threads.txt processes.txt || fail "processes and threads printed different numbers"
  echo "$(basename "$1") ${*:2} on $ranks processes: the threads' numbers, to the printed digits:"
  cat processes.txt
}

case "$case" in
  collectives)
    "$1" collectives >threads.txt
    "${launch[@]}" -np 4 "$1" collectives >processes.txt
    diff threads.txt processes.txt || fail "processes and threads got different values"
    echo "$(wc -l <processes.txt) collectives: the same bits as processes and as threads"
    ;;

  fails)
    mode="$1" prog="$2"
    case "$mode" in
      throw) cause="rank 2 threw: boom in step 3" ;;
      stuck) cause="timed out after 2000 ms waiting in all_reduce" ;;
      mismatch) cause="rank 0 passed 4 elements but rank 1 passed 3" ;;
      message) cause="rank 1 sent 12 bytes of float32 but rank 0 expects 16 bytes of float32" ;;
    esac
    start=$(now_ms)
    if FIVED_HOST_TIMEOUT_S=2 timeout 120 "${launch[@]}" -np 4 "$prog" "$mode" >out.txt 2>&1; then
      cat out.txt; fail "the job exited 0"
    fi
    took=$(seconds_since "$start")
    for r in 0 1 3; do
      grep -q "rank $r in .*$cause" out.txt || { cat out.txt; fail "rank $r did not say: $cause"; }
    done
    echo "$mode: every rank stopped in ${took} s, naming the cause: $cause"
    within_60_s "$start" || fail "took ${took} s, more than 60"
    ;;

  killed)
    train="$1" tag="fived-kill-test-$$"
    FIVED_KILL_TEST_TAG="$tag" timeout 120 "${launch[@]}" -np 4 "$train" --mesh dp2.tp2 --steps 100000 "${args[@]}" \
      >out.txt 2>&1 &
    job=$!
    for _ in $(seq 600); do grep -q "^ *2 " out.txt && break; sleep 0.1; done  # training: step 2 printed
    victim=""
    for proc in /proc/[0-9]*; do  # the launcher's processes of this test, by their environment
      [ "$(cat "$proc/comm" 2>/dev/null)" = "$(basename "$train" | cut -c1-15)" ] || continue
      pid=${proc#/proc/}
      env_of=$(tr '\0' '\n' <"$proc/environ" 2>/dev/null || true)
      grep -q "^FIVED_KILL_TEST_TAG=$tag$" <<<"$env_of" &&
        grep -qE "^(OMPI_COMM_WORLD_RANK|PMI_RANK)=2$" <<<"$env_of" && victim=$pid
    done
    [ -n "$victim" ] || { kill "$job"; cat out.txt; fail "rank 2's process not found"; }
    start=$(now_ms)
    kill -9 "$victim"
    if wait "$job"; then fail "the job exited 0 after rank 2 was killed"; fi
    took=$(seconds_since "$start")
    for r in 0 1 3; do
      grep -qE "rank $r .*rank 2 \(pid $victim\) is gone" out.txt || { cat out.txt; fail "rank $r did not name rank 2"; }
    done
    echo "rank 2 (pid $victim) killed mid-step: ranks 0, 1 and 3 stopped within ${took} s, each naming it"
    grep -E "rank [013] .*is gone" out.txt
    within_60_s "$start" || fail "took ${took} s, more than 60"
    ;;

  train)
    train="$1" mesh="$2" ranks="$3"
    same_as_threads losses 4 "$ranks" "$train" --mesh "$mesh" --steps 3 "${args[@]}"
    ;;

  moe)
    same_as_threads moe_rows 4 4 "$1" --steps 4
    ;;

  resume)
    train="$1"
    run=(--mesh dp2.tp2 --steps 4 "${args[@]}" --save-every 2)
    "${launch[@]}" -np 4 "$train" "${run[@]}" --checkpoints straight >/dev/null
    mkdir resumed && cp -r straight/step-00000002 resumed/
    "${launch[@]}" -np 4 "$train" "${run[@]}" --checkpoints resumed --resume >resumed.log
    grep -q "resumed from resumed at step 2" resumed.log || fail "did not resume at step 2"
    diff -r straight/step-00000004 resumed/step-00000004 || fail "the resumed run's step 4 differs"
    "$train" "${run[@]}" --checkpoints threads >/dev/null
    diff -r straight/step-00000004 threads/step-00000004 || fail "processes and threads wrote different checkpoints"
    echo "step 4 after resuming at step 2 (4 processes): bit for bit the uninterrupted run's, and the threads'"
    ;;

  reshard)
    train="$1"
    "${launch[@]}" -np 16 "$train" --mesh dp2.pp2.cp2.tp2 --steps 2 "${args[@]}" --checkpoints by16 >/dev/null
    cp -r by16 by_threads
    run=(--mesh dp2.tp2 --steps 3 "${args[@]}" --resume)
    "${launch[@]}" -np 4 "$train" "${run[@]}" --checkpoints by16 | losses >processes.txt
    "$train" "${run[@]}" --checkpoints by_threads | losses >threads.txt
    diff threads.txt processes.txt || fail "losses differ"
    diff -r by16/step-00000003 by_threads/step-00000003 || fail "step 3 differs between processes and threads"
    echo "saved by 16 processes (dp2.pp2.cp2.tp2), resumed by 4 (dp2.tp2): the threads' losses and files"
    cat processes.txt
    ;;

  *) fail "unknown case $case" ;;
esac
