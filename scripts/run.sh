#!/usr/bin/env bash
# Sets up, builds and runs tierflow's main job: report what this machine
# offers (`tierflow info`, with the filesystem of a temporary directory), then
# train a small GPT on the Python standard library's source with tierflow's
# ZeRO-3 engine (examples/train_gpt.py: parameters and AdamW state on NVMe
# files in that directory, device and host budgets below what the training
# state needs; on this machine's GPU when it has one, else on the device's host
# stand-in) beside the same training with torch.optim.AdamW in memory; then
# fine-tune that checkpoint with ZenFlow at stage 3 (the parameters and
# ZenFlow's windowed state on NVMe) on held-out text the pretraining never
# saw, beside torch.optim.AdamW fine-tuning the same weights. The loss plots,
# the Perfetto traces and the checkpoints land in build/train_gpt_out/ and
# build/train_gpt_out/zenflow/.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/scripts/setup.sh"
"$here/scripts/build.sh" build
scratch=$(mktemp -d "${TMPDIR:-/var/tmp}/tierflow-run-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
"$here/build/bin/tierflow" info --path "$scratch"
"$here/.venv/bin/python" "$here/examples/train_gpt.py" --compare --nvme-dir "$scratch" \
  --out "$here/build/train_gpt_out"
"$here/.venv/bin/python" "$here/examples/train_gpt.py" --zenflow --nvme-dir "$scratch" \
  --init-from "$here/build/train_gpt_out/checkpoint" --compare --out "$here/build/train_gpt_out/zenflow"
