#!/usr/bin/env bash
# The checks fived owes a GPU, for a session that is lent one (the device tool: 15 minutes
# of device time in all, a machine start included, 10 minutes a command, 8 files back, no
# network there). Spend it in one call: build here, carry the programs, run `check` there.
#
#   here, once:        pip install nvidia-cudnn-frontend==1.32.0   # the cuDNN attention's headers
#                      bash scripts/gpu-checks.sh prepare          # doctest and those headers into
#                                                                  # .gpu/, which git ignores (the
#                                                                  # GPU machine has neither, nor a network)
#                      bash scripts/gpu-checks.sh build gpu-out   # sm_90, the CUDA programs only,
#                                                                  # into build-gpu (long on 2 cores)
#                      bash scripts/gpu-checks.sh pack             # them and their ctest files into
#                                                                  # .gpu/build.tgz (~25 MB)
#   on the GPU, one call, carry [".gpu/build.tgz"], timeout_s 600:
#                      bash scripts/gpu-checks.sh check "$OUT"
#     check unpacks, then runs, most needed first, each part cut off where the call's budget
#     (FIVED_GPU_BUDGET_S, 540 s from its start) would be passed and the rest skipped, so the
#     files always come back:
#       1. ctest -L cuda                                  -> ctest-cuda.log
#       2. compute-sanitizer memcheck on the kernel tests -> memcheck.log
#          (at most FIVED_MEMCHECK_S, 150 s; FIVED_MEMCHECK_CASES: doctest -tc patterns, by
#          default the cases of kernels changed since the last GPU run, memcheck_changed below)
#       3. bench/kernels, the ring on one GPU (--local); bench/train_step beside PyTorch (eager
#          and torch.compile) and as a graph        -> bench-kernels.txt, bench-train-step.txt
#       4. the example trainers on meshes of processes    -> trainers.txt
#       5. NCCL benches (overlap, ring attention, collectives) -> bench-comm.txt
#       6. the step on text-like ids, fived and torch.compile -> bench-train-step.txt, which then
#          ends with the line issue 26 asks for
#     and summary.txt: each part's seconds and exit status. Seven files: the device returns 8.
#
#   the stages alone (a log each under OUT; each goes on after a failure):
#                      bash scripts/gpu-checks.sh build "$OUT"   # configure for sm_90 and build there
#                      bash scripts/gpu-checks.sh test "$OUT"    # ctest -L cuda
#                      bash scripts/gpu-checks.sh bench "$OUT"   # parts 3 to 6 above
#                      bash scripts/gpu-checks.sh memcheck "$OUT" ["case*,other*"]
#                      bash scripts/gpu-checks.sh unpack         # after carrying .gpu/build.tgz: puts the
#                      # programs where the ctest files name them, and points the loader at the
#                      # GPU machine's NCCL and cuDNN (written to .gpu/env, which test and bench read)
#
# The exit status is that of the last failure. Build folder: build-gpu (BUILD_DIR to change).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
usage="gpu-checks.sh prepare | build OUT | pack | unpack | check OUT | test OUT | bench OUT | memcheck OUT [cases] | all OUT"
stage=${1:?usage: $usage}
out=${2:-gpu-out}
# After unpack, test and bench run the carried programs (.gpu/env names them).
[[ $stage == test || $stage == bench || $stage == memcheck ]] && [ -f .gpu/env ] && source .gpu/env
build=${BUILD_DIR:-${FIVED_GPU_BUILD:-build-gpu}}
status=0
cuda_targets="train_moe_cuda test_cuda_pages test_nccl_comm nccl_ranks_check test_nccl_mesh_context test_kernels_cuda test_gpt_cuda test_llama_cuda
  test_mesh_cuda test_pipeline_cuda test_context_cuda test_moe_cuda test_trainer_cuda test_checkpoint_cuda bench_kernels bench_train_step bench_overlap
  bench_collectives_nccl bench_ring_attention train_gpt_cuda"

# A deadline (seconds since the epoch) for the check stage: each command is cut off where it
# would pass it, and a command that would start with less than min_left seconds is skipped.
deadline=0
min_left=20
cap=0  # > 0: this command's own limit too, in seconds (memcheck's)
# Line-buffered output where a command is cut off (its block-buffered stdio would be lost).
unbuffered=()
command -v stdbuf >/dev/null && unbuffered=(stdbuf -oL -eL)

run() {  # run LOG COMMAND...: the command's output appended to LOG, its status remembered
  local log=$1
  shift
  echo "\$ $*" >>"$log"
  local limit=()
  if ((deadline > 0)); then
    local left=$((deadline - $(date +%s)))
    if ((left < min_left)); then
      echo "[skipped: ${left} s left of the call's budget]" >>"$log"
      status=124
      return
    fi
    ((cap > 0 && cap < left)) && left=$cap
    limit=(timeout -k 10 "$left" "${unbuffered[@]}")
  fi
  "${limit[@]}" "$@" >>"$log" 2>&1
  local rc=$?
  echo "[exit $rc]" >>"$log"
  ((rc == 0)) || status=$rc
}

# part NAME FUNCTION...: a part of the check stage, its seconds and status in summary.txt.
part() {
  local name=$1
  shift
  local t0 before=$status
  t0=$(date +%s)
  status=0
  "$@"
  printf '%-14s %5d s  exit %d\n' "$name" $(($(date +%s) - t0)) "$status" >>"$out/summary.txt"
  ((status == 0)) && status=$before
}

# The programs the GPU runs, as built here (relative to the build folder).
packed_programs() {
  local t
  for t in $cuda_targets; do
    case $t in
      bench_*) echo "bench/${t#bench_}" ;;
      train_gpt_cuda | train_moe_cuda) echo "examples/$t" ;;
      *) echo "tests/cuda/$t" ;;
    esac
  done
}

# .gpu/ holds what the GPU machine needs and no commit should: git ignores it here.
ignore_gpu_folder() {
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
}

pack() {
  ignore_gpu_folder
  rm -rf .gpu/build .gpu/env && mkdir -p .gpu/build/tests/cuda .gpu/build/bench .gpu/build/examples
  local p
  for p in $(packed_programs); do cp "$build/$p" ".gpu/build/$p" || status=1; done
  cp "$build/tests/cuda/CTestTestfile.cmake" .gpu/build/tests/cuda/
  echo "$PWD/$build" >.gpu/build/origin  # where the ctest files expect the programs
  tar czf .gpu/build.tgz -C .gpu build
  du -sh .gpu/build .gpu/build.tgz
  rm -rf .gpu/build  # what travels is the tarball (the folder would pass the 64 MiB a call carries)
}

unpack() {
  local origin
  [ -d .gpu/build ] || tar xzf .gpu/build.tgz -C .gpu || return 1
  [ -s .gpu/build/origin ] || { echo "gpu-checks: .gpu/build/origin missing: pack again" >&2; return 1; }
  origin=$(cat .gpu/build/origin)
  mkdir -p "$(dirname "$origin")"
  [ -e "$origin" ] || ln -s "$PWD/.gpu/build" "$origin"
  [ -e "$(dirname "$origin")/scripts" ] || ln -s "$PWD/scripts" "$(dirname "$origin")/scripts"
  [ -e "$(dirname "$origin")/tests" ] || ln -s "$PWD/tests" "$(dirname "$origin")/tests"
  [ -e "$(dirname "$origin")/bench" ] || ln -s "$PWD/bench" "$(dirname "$origin")/bench"
  local libs
  libs=$(python3 -c '
import importlib
dirs = []
for name in ("nvidia.nccl", "nvidia.cudnn", "nvidia.cublas", "nvidia.cuda_runtime"):
    try:
        dirs.append(list(importlib.import_module(name).__path__)[0] + "/lib")
    except ImportError:
        pass
print(":".join(dirs))')
  printf 'export LD_LIBRARY_PATH=%s:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}\nexport FIVED_GPU_BUILD=.gpu/build\n' "$libs" >.gpu/env
  cat .gpu/env
}

prepare() {
  mkdir -p .gpu/doctest
  cp -r /usr/include/doctest .gpu/doctest/include
  cp -r /usr/lib/cmake/doctest .gpu/doctest/cmake
  # The cudnn-frontend headers (the GPU machine has cuDNN but not them): from the folder
  # CUDNN_FRONTEND_ROOT names, or the nvidia-cudnn-frontend wheel here.
  local fe=${CUDNN_FRONTEND_ROOT:-}
  [ -n "$fe" ] || fe=$(python3 -c 'import importlib.util as u, os; print(os.path.dirname(list(u.find_spec("cudnn").submodule_search_locations)[0]))' 2>/dev/null)
  if [ -n "$fe" ] && [ -f "$fe/include/cudnn_frontend.h" ]; then
    rm -rf .gpu/cudnn-frontend && mkdir -p .gpu/cudnn-frontend && cp -r "$fe/include" .gpu/cudnn-frontend/
  else
    echo "gpu-checks: no cudnn-frontend headers here (pip install nvidia-cudnn-frontend==1.32.0): attention will run fived's own kernel there" >&2
  fi
  ignore_gpu_folder
  echo "gpu-checks: doctest copied to .gpu/doctest; then build and pack here, and carry \".gpu/build.tgz\" in the device call"
}

build() {
  mkdir -p "$out"
  if [ -d .gpu/doctest ] && [ ! -d /usr/include/doctest ]; then  # as root on the GPU machine
    cp -r .gpu/doctest/include /usr/include/doctest && cp -r .gpu/doctest/cmake /usr/lib/cmake/doctest
  fi
  command -v nvidia-smi >/dev/null && run "$out/build.log" nvidia-smi
  local fe=()
  [ -d .gpu/cudnn-frontend ] && fe=(-DCUDNN_FRONTEND_ROOT="$PWD/.gpu/cudnn-frontend")
  run "$out/build.log" cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 "${fe[@]}"
  # Only what the GPU runs: the host programs are CI's, and device time is short.
  # -k 0: a target that fails to build leaves the others built (its tests then fail "Not Run").
  run "$out/build.log" cmake --build "$build" --parallel "$(nproc)" --target ${GPU_TARGETS:-$cuda_targets} -- -k 0
}

test_cuda() {
  mkdir -p "$out"
  # A hung rank ends in 90 s, not launch-local's 300 (the longest test took 18.5 s on an H200);
  # a test of one process in 120 s (its TIMEOUT, tests/cuda/CMakeLists.txt).
  # A graph test that hangs at a launch or replay: NCCL's documentation has seen CUDA deadlock
  # with graphs of several communicators launched from one thread under its default graph
  # mixing; rerun it with NCCL_GRAPH_MIXING_SUPPORT=0 (fived joins every graph before a
  # collective outside it on the same communicator, so that is safe).
  run "$out/ctest-cuda.log" env FIVED_TEST_RANK_TIMEOUT_S="${FIVED_TEST_RANK_TIMEOUT_S:-90}" \
    FIVED_NCCL_TIMEOUT_S="${FIVED_NCCL_TIMEOUT_S:-45}" ctest --test-dir "$build/tests/cuda" -L cuda --output-on-failure --timeout 300
}

memcheck() {  # compute-sanitizer's memcheck on the kernel tests (cases: doctest -tc patterns)
  mkdir -p "$out"
  local cases=${1:-}
  # exit 86: a memory error (doctest's own failures exit 1)
  local sanitizer
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  cap=${FIVED_MEMCHECK_S:-150}  # in check: what is left after it goes to the benches
  run "$out/memcheck.log" "$sanitizer" --tool memcheck --error-exitcode 86 "$build/tests/cuda/test_kernels_cuda" \
    ${cases:+"-tc=$cases"}
  cap=0
}

# bench/kernels, and the training step beside PyTorch's (eager and torch.compile) on one GPU.
bench_step() {
  mkdir -p "$out"
  local b=$build/bench
  run "$out/bench-kernels.txt" "$b/kernels"
  # CP 2's ring on one GPU, each rank's side alone (its exchange a device copy): issue 26's
  # "at most 1.3x the plain kernel", which the two processes of bench-comm cannot show.
  run "$out/bench-kernels.txt" "$b/ring_attention" --local
  run "$out/bench-train-step.txt" "$b/train_step"
  run "$out/bench-train-step.txt" python3 bench/train_step_pytorch.py
  run "$out/bench-train-step.txt" python3 bench/train_step_pytorch.py --compile
  # The step replayed as a CUDA graph (nn/step_graph.hpp), uniform ids.
  run "$out/bench-train-step.txt" "$b/train_step" --graph
}
# The same step on ids drawn as in text (a few ids frequent: the embedding's backward sums their rows).
bench_text_ids() {
  mkdir -p "$out"
  run "$out/bench-train-step.txt" "$build/bench/train_step" --ids text
  run "$out/bench-train-step.txt" python3 bench/train_step_pytorch.py --compile --ids text
}
# The line issue 26 asks for: the three median step times and fived's MFU, from this run.
step_summary() {
  [ -f "$out/bench-train-step.txt" ] || return 0
  awk '/fived bench\/train_step/ {m = "fived"} /compile=False/ {m = "eager"} /compile=True/ {m = "compile"}
       /text-like ids/ {m = m "_text"} /step graph/ {m = m "_graph"}
       /^median step/ {ms[m] = $3} m == "fived" && / fived +[0-9]+ +[0-9]+ / {mfu = $NF}
       END {printf "fived_ms=%s eager_ms=%s compile_ms=%s mfu=%s\n", ms["fived"], ms["eager"], ms["compile"], mfu
            printf "text-like ids: fived_ms=%s compile_ms=%s\n", ms["fived_text"], ms["compile_text"]
            printf "step graph: fived_ms=%s\n", ms["fived_graph"]}' \
    "$out/bench-train-step.txt" >>"$out/bench-train-step.txt"
}

# The NCCL benches, ranks as processes on the one GPU.
bench_comm() {
  mkdir -p "$out"
  local b=$build/bench
  run "$out/bench-comm.txt" bash scripts/launch-local.sh 2 "$b/overlap"
  run "$out/bench-comm.txt" bash scripts/launch-local.sh 2 "$b/ring_attention"
  run "$out/bench-comm.txt" bash scripts/launch-local.sh 4 "$b/collectives_nccl"
}

# The example trainers, ranks as processes on the one GPU.
trainers() {
  mkdir -p "$out"
  local t=$out/trainers.txt
  run "$t" bash scripts/launch-local.sh 4 "$build/examples/train_gpt_cuda" --steps 60
  # The same on dp2.tp2 with each step replayed as a CUDA graph, its collectives included: the same losses.
  run "$t" bash scripts/launch-local.sh 4 "$build/examples/train_gpt_cuda" --steps 60 --step-graph
  # A pipeline (PP 2 x DP 2, 1F1B, ZeRO-1), plain and as a graph, its transfers included: the same losses.
  run "$t" bash scripts/launch-local.sh 4 "$build/examples/train_gpt_cuda" --mesh pp2.dp2 --steps 60
  run "$t" bash scripts/launch-local.sh 4 "$build/examples/train_gpt_cuda" --mesh pp2.dp2 --steps 60 --step-graph
  # The trainer's progress lines (tok/s, MFU) on Mesh<DP<2>> as two processes, and on one rank (plain, and as a graph).
  run "$t" bash scripts/launch-local.sh 2 "$build/examples/train_gpt_cuda" --mesh dp2 --steps 100 --batch 16 --seq 128
  run "$t" "$build/examples/train_gpt_cuda" --mesh serial --steps 100 --batch 16 --seq 128
  run "$t" "$build/examples/train_gpt_cuda" --mesh serial --steps 100 --batch 16 --seq 128 --step-graph
  # A mixture of experts on Mesh<DP<2>, TP<2>, EP<2>> as four processes: loss, balance, tokens per expert.
  run "$t" bash scripts/launch-local.sh 4 "$build/examples/train_moe_cuda" --steps 60
}

bench() {
  bench_step
  bench_text_ids
  step_summary
  bench_comm
  trainers
}

# The whole device session in one call, on the programs `pack` carried (see the top).
# memcheck's default cases: the kernels changed since the last GPU run (3f586e5).
memcheck_changed='matmul_weight_grad*,a strided batch*,layernorm*,residual add*,embedding*,cross-entropy*,AdamW over chunks*,gradient norm over chunks*,attention forward and backward*,attention blocks*,mixture of experts*'
check() {
  mkdir -p "$out"
  deadline=$(($(date +%s) + ${FIVED_GPU_BUDGET_S:-540}))
  export PYTHONUNBUFFERED=1  # PyTorch's lines kept where a part is cut off
  { command -v nvidia-smi >/dev/null && nvidia-smi; } >"$out/summary.txt" 2>&1
  part unpack unpack_quiet
  [ -f .gpu/env ] && source .gpu/env
  build=${FIVED_GPU_BUILD:-$build}
  part ctest test_cuda
  part memcheck memcheck "${FIVED_MEMCHECK_CASES:-$memcheck_changed}"
  part bench-step bench_step
  part trainers trainers
  part bench-comm bench_comm
  part text-ids bench_text_ids
  step_summary
}
unpack_quiet() { unpack >>"$out/summary.txt" 2>&1 || status=1; }

case $stage in
  prepare) prepare ;;
  pack) pack ;;
  unpack) unpack ;;
  check) check ;;
  build) build ;;
  test) test_cuda ;;
  bench) bench ;;
  memcheck) memcheck "${3:-}" ;;
  all) build; test_cuda; bench ;;
  *) echo "gpu-checks.sh: unknown stage '$stage': $usage" >&2; exit 2 ;;
esac
exit $status
