#!/usr/bin/env bash
# Sets up, builds and runs tierflow's main job: report what this machine
# offers (`tierflow info`), a short I/O benchmark on a temporary file, and a
# short offloaded-training run (on this machine's GPU when it has one, else
# on the simulated device) comparing ZeRO-Offload (state in host memory) and
# ZeRO-Infinity (state on NVMe) with ZenFlow (state on NVMe), ratios against
# ZeRO-Offload.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh"
"$here/scripts/build.sh" build
scratch=$(mktemp -d "${TMPDIR:-/var/tmp}/tierflow-run-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
"$here/build/bin/tierflow" info --path "$scratch"
# A short I/O benchmark through tierflow's engine: 256 MiB of 1 MiB reads at queue depth 32.
"$here/build/bin/tierflow" bench io --path "$scratch/bench.dat" --size 256M --block-size 1M --queue-depth 32 --pattern read
# Offloaded training of a small GPT-2-shaped model: ZeRO-Offload with its optimizer state in host
# memory, ZeRO-Infinity and ZenFlow with it on NVMe files, side by side.
device=sim
"$here/build/bin/tierflow" info --json | jq -e '.cuda.available' >/dev/null && device=cuda
"$here/build/bin/tierflow" bench offload --device "$device" --model 6x512x8000 --nvme-dir "$scratch" \
  --strategy zero-offload,zero-infinity,zenflow --steps 12 --update-interval 4 --batch-tokens 480000 \
  --sub-group 512K
