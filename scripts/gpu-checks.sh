#!/usr/bin/env bash
# The checks fived owes a GPU, for a session that is lent one (the device tool: 30 minutes
# of device time, 10 per command, 8 files back, no network there).
#
#   here, once:        bash scripts/gpu-checks.sh prepare
#                      (copies this machine's doctest into .gpu/, which git ignores: the
#                      GPU machine has no doctest and cannot fetch one)
#   on the GPU, with carry [".gpu"]:
#                      bash scripts/gpu-checks.sh build "$OUT"   # configure for sm_90, build everything
#                      bash scripts/gpu-checks.sh test "$OUT"    # ctest -L cuda
#                      bash scripts/gpu-checks.sh bench "$OUT"   # every GPU benchmark, one table file each
#                      bash scripts/gpu-checks.sh memcheck "$OUT" ["case*,other*"]
#                                          # compute-sanitizer memcheck on test_kernels_cuda's
#                                          # cases (doctest -tc patterns; default every case)
#                      (or "all", when the three fit one command)
#
#   or, to spend no device time on compiling (the GPU machine goes back after 30 s idle, so
#   each call would build again): build here, then carry the programs:
#   here:              bash scripts/gpu-checks.sh pack      # the built CUDA programs and their
#                                                           # ctest files into .gpu/build, and
#                                                           # .gpu/build.tgz (~24 MB; the programs
#                                                           # are ~70 MB, over what the device takes)
#   on the GPU, with carry [".gpu/build.tgz"] (unpack extracts it):
#                      bash scripts/gpu-checks.sh unpack "$OUT" && bash scripts/gpu-checks.sh test "$OUT"
#                      (unpack puts them where this machine's ctest files name them, and points
#                      the loader at the GPU machine's NCCL and cuDNN; source nothing: the
#                      library path is written to .gpu/env, which test and bench read)
#
# Each stage appends to a log under the given folder ($OUT on the device) and goes on
# after a failure, so one call brings back everything it could run; the exit status is
# that of the last failure. Build folder: build-gpu (BUILD_DIR to change).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stage=${1:?usage: gpu-checks.sh prepare | build OUT | test OUT | bench OUT | memcheck OUT [cases] | all OUT}
out=${2:-gpu-out}
# After unpack, test and bench run the carried programs (.gpu/env names them).
[[ $stage == test || $stage == bench || $stage == memcheck ]] && [ -f .gpu/env ] && source .gpu/env
build=${BUILD_DIR:-${FIVED_GPU_BUILD:-build-gpu}}
status=0
cuda_targets="train_moe_cuda test_cuda_pages test_nccl_comm nccl_ranks_check test_nccl_mesh_context test_kernels_cuda test_gpt_cuda test_llama_cuda
  test_mesh_cuda test_pipeline_cuda test_context_cuda test_moe_cuda test_trainer_cuda test_checkpoint_cuda bench_kernels bench_train_step bench_overlap
  bench_collectives_nccl bench_ring_attention train_gpt_cuda"

run() {  # run LOG COMMAND...: the command's output appended to LOG, its status remembered
  local log=$1
  shift
  echo "\$ $*" >>"$log"
  "$@" >>"$log" 2>&1
  local rc=$?
  echo "[exit $rc]" >>"$log"
  ((rc == 0)) || status=$rc
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

pack() {
  build=${BUILD_DIR:-build}
  rm -rf .gpu/build .gpu/env && mkdir -p .gpu/build/tests/cuda .gpu/build/bench .gpu/build/examples
  local p
  for p in $(packed_programs); do cp "$build/$p" ".gpu/build/$p" || status=1; done
  cp "$build/tests/cuda/CTestTestfile.cmake" .gpu/build/tests/cuda/
  echo "$PWD/$build" >.gpu/build/origin  # where the ctest files expect the programs
  tar czf .gpu/build.tgz -C .gpu build
  du -sh .gpu/build .gpu/build.tgz
}

unpack() {
  local origin
  [ -d .gpu/build ] || tar xzf .gpu/build.tgz -C .gpu
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
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
  echo "gpu-checks: doctest copied to .gpu/doctest; carry \".gpu\" in the device call"
}

build() {
  mkdir -p "$out"
  if [ -d .gpu/doctest ] && [ ! -d /usr/include/doctest ]; then  # as root on the GPU machine
    cp -r .gpu/doctest/include /usr/include/doctest && cp -r .gpu/doctest/cmake /usr/lib/cmake/doctest
  fi
  run "$out/build.log" nvidia-smi
  local fe=()
  [ -d .gpu/cudnn-frontend ] && fe=(-DCUDNN_FRONTEND_ROOT="$PWD/.gpu/cudnn-frontend")
  run "$out/build.log" cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 "${fe[@]}"
  # Only what the GPU runs: the host programs are CI's, and device time is short.
  # -k 0: a target that fails to build leaves the others built (its tests then fail "Not Run").
  run "$out/build.log" cmake --build "$build" --parallel "$(nproc)" --target ${GPU_TARGETS:-$cuda_targets} -- -k 0
}

test_cuda() {
  mkdir -p "$out"
  run "$out/ctest-cuda.log" ctest --test-dir "$build/tests/cuda" -L cuda --output-on-failure --timeout 300
}

memcheck() {  # compute-sanitizer's memcheck on the kernel tests (cases: doctest -tc patterns)
  mkdir -p "$out"
  local cases=${1:-}
  run "$out/memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/cuda/test_kernels_cuda" \
    ${cases:+"-tc=$cases"}
}

bench() {
  mkdir -p "$out"
  local b=$build/bench
  run "$out/bench-kernels.txt" "$b/kernels"
  run "$out/bench-train-step.txt" "$b/train_step"
  run "$out/bench-train-step.txt" python3 bench/train_step_pytorch.py
  run "$out/bench-train-step.txt" python3 bench/train_step_pytorch.py --compile
  # The same step on ids drawn as in text (a few ids frequent: the embedding's backward sums their rows).
  run "$out/bench-train-step.txt" "$b/train_step" --ids text
  run "$out/bench-train-step.txt" python3 bench/train_step_pytorch.py --compile --ids text
  # The step replayed as a CUDA graph (nn/step_graph.hpp), uniform ids.
  run "$out/bench-train-step.txt" "$b/train_step" --graph
  # The line issue 26 asks for: the three median step times and fived's MFU, from this run.
  awk '/fived bench\/train_step/ {m = "fived"} /compile=False/ {m = "eager"} /compile=True/ {m = "compile"}
       /text-like ids/ {m = m "_text"} /step graph/ {m = m "_graph"}
       /^median step/ {ms[m] = $3} m == "fived" && / fived +[0-9]+ +[0-9]+ / {mfu = $NF}
       END {printf "fived_ms=%s eager_ms=%s compile_ms=%s mfu=%s\n", ms["fived"], ms["eager"], ms["compile"], mfu
            printf "text-like ids: fived_ms=%s compile_ms=%s\n", ms["fived_text"], ms["compile_text"]
            printf "step graph: fived_ms=%s\n", ms["fived_graph"]}' \
    "$out/bench-train-step.txt" >>"$out/bench-train-step.txt"
  run "$out/bench-overlap.txt" bash scripts/launch-local.sh 2 "$b/overlap"
  run "$out/bench-ring-attention.txt" bash scripts/launch-local.sh 2 "$b/ring_attention"
  run "$out/bench-collectives.txt" bash scripts/launch-local.sh 4 "$b/collectives_nccl"
  run "$out/train-gpt-cuda.txt" bash scripts/launch-local.sh 4 "$build/examples/train_gpt_cuda" --steps 60
  # The same on dp2.tp2 with each step replayed as a CUDA graph, its collectives included: the same losses.
  run "$out/train-gpt-cuda.txt" bash scripts/launch-local.sh 4 "$build/examples/train_gpt_cuda" --steps 60 --step-graph
  # A pipeline (PP 2 x DP 2, 1F1B, ZeRO-1), plain and as a graph, its transfers included: the same losses.
  run "$out/train-gpt-cuda.txt" bash scripts/launch-local.sh 4 "$build/examples/train_gpt_cuda" --mesh pp2.dp2 --steps 60
  run "$out/train-gpt-cuda.txt" bash scripts/launch-local.sh 4 "$build/examples/train_gpt_cuda" --mesh pp2.dp2 --steps 60 --step-graph
  # The trainer's progress lines (tok/s, MFU) on Mesh<DP<2>> as two processes, and on one rank (plain, and as a graph).
  run "$out/trainer-cuda.txt" bash scripts/launch-local.sh 2 "$build/examples/train_gpt_cuda" --mesh dp2 --steps 100 --batch 16 --seq 128
  run "$out/trainer-cuda.txt" "$build/examples/train_gpt_cuda" --mesh serial --steps 100 --batch 16 --seq 128
  run "$out/trainer-cuda.txt" "$build/examples/train_gpt_cuda" --mesh serial --steps 100 --batch 16 --seq 128 --step-graph
  # A mixture of experts on Mesh<DP<2>, TP<2>, EP<2>> as four processes: loss, balance, tokens per expert.
  run "$out/train-moe-cuda.txt" bash scripts/launch-local.sh 4 "$build/examples/train_moe_cuda" --steps 60
}

case $stage in
  prepare) prepare ;;
  pack) pack ;;
  unpack) unpack ;;
  build) build ;;
  test) test_cuda ;;
  bench) bench ;;
  memcheck) memcheck "${3:-}" ;;
  all) build; test_cuda; bench ;;
  *) echo "gpu-checks.sh: unknown stage '$stage' (prepare, build, test, bench, memcheck, all)" >&2; exit 2 ;;
esac
exit $status
