#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages fived's build, tests and demo need. The one
# list of dependencies: scripts/test.sh, scripts/demo.sh and .ci/run all use it.
# The CUDA toolkit (nvcc, NCCL) is not an apt dependency: fived builds its CUDA
# parts when it finds one, and its host backend without.
#
#   scripts/install-deps.sh            install only what is missing (needs root then)
#   scripts/install-deps.sh --always   apt-get update + install the whole list (CI)
#
# An apt failure (offline machine, no root) is only a warning when the tools the
# build needs are present anyway; otherwise it is an error.
set -euo pipefail

packages=(cmake g++ make ninja-build doctest-dev libopenmpi-dev openmpi-bin)

always=0
case "${1:-}" in
  --always) always=1 ;;
  "") ;;
  *) echo "usage: $0 [--always]" >&2; exit 2 ;;
esac

# The build needs these, whichever way they were installed.
tools_present() {
  command -v cmake >/dev/null && command -v g++ >/dev/null &&
    { command -v ninja >/dev/null || command -v make >/dev/null; } &&
    command -v mpicxx >/dev/null && command -v mpirun >/dev/null &&
    { [ -f /usr/include/doctest/doctest.h ] || [ -f /usr/local/include/doctest/doctest.h ]; }
}

missing=()
if command -v dpkg-query >/dev/null; then
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
elif ! tools_present; then
  missing=("${packages[@]}")
fi
if [ "$always" = 1 ]; then
  missing=("${packages[@]}")
fi
[ "${#missing[@]}" -eq 0 ] && exit 0

install() {
  [ "$(id -u)" = 0 ] || { echo "install-deps: not root, cannot apt-get install ${missing[*]}" >&2; return 1; }
  command -v apt-get >/dev/null || { echo "install-deps: no apt-get, cannot install ${missing[*]}" >&2; return 1; }
  # Short network timeouts: an offline machine should fall through to the check below quickly.
  local apt=(apt-get -o Acquire::Retries=1 -o Acquire::http::Timeout=20 -o Acquire::https::Timeout=20)
  echo "install-deps: apt-get install ${missing[*]}"
  "${apt[@]}" update -q &&
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -q --no-install-recommends "${missing[@]}"
}

if ! install; then
  if tools_present; then
    echo "install-deps: WARNING: could not install ${missing[*]}; the build tools are present, continuing" >&2
  else
    echo "install-deps: ERROR: missing ${missing[*]} and could not install them" >&2
    exit 1
  fi
fi
