#!/usr/bin/env bash
# What proving a pipeline schedule costs the compiler.
#
# One translation unit per schedule and size that names the schedule type (so
# every proof of pipeline/proven.hpp runs) and prints its bubble; compiled with
# each compiler found, at its default constexpr limits, -O0 -c. Prints
#
#   schedule P M V compiler seconds peak_MB
#
# per unit (seconds: wall time of the compiler; peak_MB: its peak resident
# memory), "fails" where the compiler refuses. Usage:
#
#   bench/schedule_compile_cost.sh [quick]     # quick: the sizes issue 34 names only
#
# Environment: CXX_LIST (default "g++ clang++", those found), CXXFLAGS_EXTRA, REPEAT (default 1:
# compile each unit that many times and print the fastest, for a machine whose speed varies).
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

compilers=()
for c in ${CXX_LIST:-g++ clang++}; do command -v "$c" >/dev/null && compilers+=("$c"); done

# name P M V: the schedule type's template arguments.
cases=(
  "OneFOneB 4 8 1" "OneFOneB 16 128 1" "Interleaved1F1B 16 128 4" "ZBH1 16 128 1" "ZBV 16 128 2"
  "DualPipeV 16 128 2" "OneFOneB 32 256 1" "ZBV 16 120 2" "Interleaved1F1B 16 64 4"
)
if [ "${1:-}" != quick ]; then
  for P in 4 8 16 32; do
    for M in $((2 * P)) $((4 * P)) 256; do
      [ "$M" -gt 256 ] && continue
      cases+=("OneFOneB $P $M 1" "ZBH1 $P $M 1" "Interleaved1F1B $P $M 2" "ZBV $P $M 2")
    done
  done
fi

printf '%-16s %3s %4s %2s %-8s %8s %8s\n' schedule P M V compiler seconds peak_MB
for c in "${compilers[@]}"; do
  for spec in "${cases[@]}"; do
    read -r name P M V <<<"$spec"
    args="$P, $M"
    [ "$name" = Interleaved1F1B ] && args="$P, $M, $V"
    tu="$work/$name-$P-$M-$V.cpp"
    cat >"$tu" <<CPP
#include <cstdio>
#include "fived/pipeline/schedules.hpp"
using schedule = fived::pipeline::$name<$args>;
int main() { std::printf("%.4f\n", schedule::figures.bubble); }
CPP
    best=""
    for ((k = 0; k < ${REPEAT:-1}; ++k)); do
      start=$(date +%s.%N)
      if ! /usr/bin/time -f '%M' -o "$work/mem" "$c" -std=c++20 -O0 ${CXXFLAGS_EXTRA:-} -I"$root/include" -c "$tu" \
        -o "$work/out.o" 2>"$work/err"; then
        best=fails
        break
      fi
      seconds=$(echo "$(date +%s.%N) - $start" | bc)
      if [ -z "$best" ] || [ "$(echo "$seconds < $best" | bc)" = 1 ]; then best=$seconds; fi
    done
    if [ "$best" != fails ]; then
      mb=$(( $(tail -1 "$work/mem") / 1024 ))
      printf '%-16s %3s %4s %2s %-8s %8.2f %8s\n' "$name" "$P" "$M" "$V" "$c" "$best" "$mb"
    else
      printf '%-16s %3s %4s %2s %-8s %8s %8s   %s\n' "$name" "$P" "$M" "$V" "$c" fails - \
        "$(grep -m1 -E 'error' "$work/err" | cut -c1-120)"
    fi
  done
done
