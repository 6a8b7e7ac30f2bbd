#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run, over an existing CUDA build
# (scripts/build.sh): every test that skips without a GPU, run where one is,
# then `bench offload --device cuda` beside the simulated device.
#   scripts/gpu_check.sh [BUILD_DIR] [RESULTS_DIR]
# Results (JSON) go to RESULTS_DIR (default: a fresh directory under /tmp).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$here/build}
results=${2:-$(mktemp -d /tmp/tierflow-gpu-XXXXXX)}
mkdir -p "$results"
bin=$build/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$bin/tierflow" info --json >"$results/info.json" || true

failed=0
check() {
  echo "== $*"
  "$@" || { echo "FAILED: $*"; failed=1; }
}
check "$bin/optim_test" --gtest_filter='zenflow_cuda.*'
check "$bin/store_test" --gtest_filter='*cuda*'
check "$bin/bench_offload_test" --gtest_filter='*Cuda*'

scratch=$(mktemp -d /tmp/tierflow-gpu-nvme-XXXXXX)
for device in cuda sim; do
  check "$bin/tierflow" bench offload --device "$device" --model gpt2-small --nvme-dir "$scratch" \
    --host-memory 4G --strategy sync,pipelined,zenflow --steps 12 --batch-tokens 262144 \
    --update-interval 4 --json >"$results/offload_$device.json"
  jq -c '.runs[] | {strategy, step_seconds, stall_fraction, max_step_seconds, compute_seconds_per_step,
         device_model}' "$results/offload_$device.json" 2>/dev/null || true
done
rm -rf "$scratch"
echo "results in $results"
exit $failed
