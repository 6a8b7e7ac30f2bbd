#!/usr/bin/env bash
# Installs everything tierflow needs on a fresh Debian 12 machine, as root.
# Idempotent: when every package is already present it only checks and returns.
#
#   scripts/setup.sh            system packages (build, test, fio as the I/O peer,
#                               clang-16 for the thread-safety analysis)
#   scripts/setup.sh --bench    also the Python benchmark peers (torch, deepspeed) in .venv/
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

apt_packages=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libtbb-dev libhwloc-dev libnuma-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev
  libhwy-dev libxxhash-dev libdnnl-dev
  fio jq util-linux e2fsprogs
  clang-16
)

missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup.sh: missing packages (${missing[*]}); run as root to install them" >&2
    exit 1
  fi
  echo "setup.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ ${1:-} == --bench ]]; then
  if [[ ! -x $here/.venv/bin/python ]]; then
    python3 -m venv "$here/.venv"
  fi
  "$here/.venv/bin/pip" install -q --upgrade pip >/dev/null
  "$here/.venv/bin/pip" install -q -r "$here/scripts/requirements-bench.txt"
fi
echo "setup.sh: dependencies present"
