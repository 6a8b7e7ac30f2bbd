#!/usr/bin/env bash
# Sets up, builds and runs tierflow's main job: report what this machine
# offers (`tierflow info`), then a short I/O benchmark on a temporary file.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh"
"$here/scripts/build.sh" build
scratch=$(mktemp -d "${TMPDIR:-/var/tmp}/tierflow-run-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
"$here/build/bin/tierflow" info --path "$scratch"
