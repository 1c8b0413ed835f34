# Sourced by scripts/test.sh and scripts/demo.sh: the shared "install what is
# missing, configure, build" steps, so both build the same tree the same way.
#
# Environment knobs:
#   BUILD_DIR         build folder (default: build, under the repository root)
#   JOBS              parallel build/test jobs (default: all cores)
#   FIVED_CMAKE_ARGS  extra configure arguments, e.g. "-DCMAKE_CUDA_ARCHITECTURES=80"

fived_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$fived_root"
build_dir="${BUILD_DIR:-build}"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

# Dependencies (root only; see install-deps.sh), the CUDA toolkit on PATH where
# the usual install left it off, and a Release configuration of build_dir.
fived_configure() {
  bash "$fived_root/scripts/install-deps.sh"
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  local args=(-S "$fived_root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release)
  # The generator of an existing build folder cannot change; pick one only for a new one.
  if [ ! -f "$build_dir/CMakeCache.txt" ] && command -v ninja >/dev/null; then
    args+=(-G Ninja)
  fi
  local extra=()
  read -r -a extra <<<"${FIVED_CMAKE_ARGS:-}"
  cmake "${args[@]}" "${extra[@]}"
}

# fived_build [cmake --build arguments, e.g. --target mesh_tour]
fived_build() {
  cmake --build "$build_dir" --parallel "$jobs" "$@"
}
