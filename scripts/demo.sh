#!/usr/bin/env bash
# The README's demo command: builds and runs the GPT training example
# (build/examples/train_gpt) when the project has it, else the mesh tour
# (build/examples/mesh_tour). Arguments go to the example; whether it uses a GPU
# is the example's business.
#
#   scripts/demo.sh [example arguments]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

fived_configure
# The build system's target list ("help"), in the formats of both Ninja
# ("train_gpt: phony") and Makefiles ("... train_gpt").
targets="$(cmake --build "$build_dir" --target help)"
example=mesh_tour
if grep -Eq '^(\.\.\. )?train_gpt(:| |$)' <<<"$targets"; then
  example=train_gpt
fi
fived_build --target "$example"
exec "$build_dir/examples/$example" "$@"
