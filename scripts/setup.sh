#!/usr/bin/env bash
# Installs everything tierflow needs on a fresh Debian 12 machine, as root.
# Idempotent: when every package is already present it only checks and returns.
#
#   scripts/setup.sh            system packages (build, test, fio as the I/O peer,
#                               clang-16 for the thread-safety analysis), and .venv/
#                               with torch, the Python test tools, the training
#                               example's plot and progress bar (matplotlib, tqdm),
#                               the peers the tests check against (deepspeed,
#                               transformers, accelerate, lightning) and the tierflow
#                               package built from this tree
#   scripts/setup.sh --bench    also the Python benchmark peers (deepspeed) in .venv/
#                               and libaio-dev, which DeepSpeed's NVMe offload builds on
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

apt_packages=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libtbb-dev libhwloc-dev libnuma-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev
  libhwy-dev libxxhash-dev libdnnl-dev libgloo-dev
  fio jq util-linux e2fsprogs
  clang-16
)

# Installs those of the Debian packages given that are missing (as root;
# otherwise names them and exits). $1 says what they are for, in messages.
apt_install() {
  local why=$1 p missing=()
  shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup.sh: missing packages (${missing[*]}${why:+; $why}); run as root to install them" >&2
    exit 1
  fi
  echo "setup.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

apt_install "" "${apt_packages[@]}"

# .venv/: the tierflow Python package and what it and its tests need, from PyPI.
# Each install runs only when an import says it is missing, so a full venv costs
# the package's incremental rebuild alone. PyPI's torch is the CUDA build (about
# 4 GB with its nvidia wheels): pip's cache serves it again on a fresh clone.
venv_python=$here/.venv/bin/python
[[ -x $venv_python ]] || python3 -m venv "$here/.venv"
if ! "$venv_python" -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 9))' 2>/dev/null; then
  echo "setup.sh: installing torch into .venv/"
  "$venv_python" -m pip install -q 'torch>=2.9'
fi
if ! "$venv_python" -c 'import numpy, pytest, nanobind, scikit_build_core' 2>/dev/null; then
  "$venv_python" -m pip install -q numpy pytest 'nanobind>=2.0' 'scikit-build-core>=0.10'
fi
# torch's optimizer test database (torch.testing._internal.common_optimizers,
# which tests/python/test_torch_optim_db.py drives) imports expecttest.
if ! "$venv_python" -c 'import expecttest' 2>/dev/null; then
  "$venv_python" -m pip install -q expecttest
fi
# examples/train_gpt.py, the main job: its loss plot and its progress bar.
if ! "$venv_python" -c 'import matplotlib, tqdm' 2>/dev/null; then
  "$venv_python" -m pip install -q matplotlib tqdm
fi
# The peers the Python tests prove the engine against, from PyPI: DeepSpeed
# (its zero_to_fp32.py reads the engine's checkpoints), Hugging Face's
# transformers and accelerate (the Trainer's calls into a DeepSpeed engine).
if ! "$venv_python" -c 'import deepspeed, transformers, accelerate' 2>/dev/null; then
  "$venv_python" -m pip install -q deepspeed transformers accelerate
fi
# Lightning, whose Trainer (FSDP2 through its ModelParallelStrategy) the
# tierflow.torch.fsdp plugin is tested beneath.
if ! "$venv_python" -c 'import lightning' 2>/dev/null; then
  "$venv_python" -m pip install -q lightning
fi
# The package: pyproject.toml builds the CMake project (the extension target
# only) in build/python, reused by the next install; no build isolation, so
# the venv's nanobind and the system's cmake and ninja build it.
launchers=()
if command -v ccache >/dev/null; then
  for lang in C CXX CUDA; do launchers+=("-Ccmake.define.CMAKE_${lang}_COMPILER_LAUNCHER=ccache"); done
fi
"$venv_python" -m pip install -q --no-build-isolation "${launchers[@]}" "$here"

if [[ ${1:-} == --bench ]]; then
  # DeepSpeed's NVMe offload (bench/python/zero3_vs_deepspeed.py) JIT-builds
  # its async_io op against libaio's headers.
  apt_install "DeepSpeed's NVMe offload" libaio-dev
  "$venv_python" -m pip install -q -r "$here/scripts/requirements-bench.txt"
fi
echo "setup.sh: dependencies present"
