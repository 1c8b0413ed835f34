#!/usr/bin/env bash
# Build fived and run every test: the README's "build and test" command.
#
#   scripts/test.sh [ctest arguments]      e.g. scripts/test.sh -R mesh
#
# Installs missing Debian packages when run as root, configures build/ (Release,
# Ninja when present), builds everything with all cores (a header that does not
# compile on its own fails here: see fived_add_header_checks), then runs ctest.
# Exits non-zero when anything fails. Knobs: see scripts/common.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

fived_configure
fived_build
# A default time limit for tests that set none (CTest's own is 25 minutes):
# a hung collective must fail, not stall the run.
exec ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 300 "$@"
