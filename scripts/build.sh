#!/usr/bin/env bash
# Configures and builds one flavour of tierflow into a build folder.
#   scripts/build.sh [BUILD_DIR] [extra cmake -D options...]
# Defaults to build/ in Release: every executable lands in build/bin/.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-build}
shift || true
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f $here/$dir/CMakeCache.txt ]]; then
  cmake -S "$here" -B "$here/$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
else
  cmake -S "$here" -B "$here/$dir" "$@" >/dev/null
fi
cmake --build "$here/$dir" -j "$(nproc)"
