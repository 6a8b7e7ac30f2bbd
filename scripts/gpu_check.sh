#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run, over an existing CUDA build
# (scripts/build.sh) or a bundle of one (scripts/gpu_bundle.sh, for a machine
# without tierflow's packages): every test that skips without a GPU, run
# where one is, then `bench offload --device cuda` beside the simulated device.
#   scripts/gpu_check.sh [BUILD_DIR] [RESULTS_DIR]
# Results (JSON) go to RESULTS_DIR (default: a fresh directory under /tmp).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$here/build}
results=${2:-$(mktemp -d /tmp/tierflow-gpu-XXXXXX)}
mkdir -p "$results"
bin=$build/bin
export TIERFLOW_CLI_PATH=$bin/tierflow  # the CLI tests' program, wherever the binaries are
if [[ -d $build/lib ]]; then
  # A bundle: its libraries, then cuBLAS from the CUDA install or its pip wheel.
  libs=$build/lib
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    "$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null)"; do
    [[ -n $d && -d $d ]] && libs+=":$d"
  done
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$bin/tierflow" info --json >"$results/info.json" || true

failed=0
check() {  # runs "$@"; its own lines go to stderr, so stdout may be redirected to a file
  echo "== $*" >&2
  "$@" || { echo "FAILED: $*" >&2; failed=1; }
}
check "$bin/optim_test" --gtest_filter='zenflow_cuda.*'
check "$bin/store_test" --gtest_filter='*cuda*'
check "$bin/bench_offload_test" --gtest_filter='*Cuda*'

scratch=$(mktemp -d /tmp/tierflow-gpu-nvme-XXXXXX)
for device in cuda sim; do
  check "$bin/tierflow" bench offload --device "$device" --model gpt2-small --nvme-dir "$scratch" \
    --strategy zero-offload,zero-infinity,zenflow --steps 12 --batch-tokens 262144 \
    --update-interval 4 --json >"$results/offload_$device.json"
  python3 - "$results/offload_$device.json" 2>/dev/null <<'PY' || true
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print({k: r.get(k) for k in ("strategy", "step_seconds", "stall_fraction", "max_step_seconds",
                                 "cpu_wait_per_step_seconds", "compute_seconds_per_step", "device_model")})
PY
done
rm -rf "$scratch"
echo "results in $results"
exit $failed
