#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh runs into one folder, for a GPU machine that
# has none of tierflow's Debian packages and no network: the binaries of a
# CUDA build and the shared libraries they load, less the C library and
# CUDA's own, which come with that machine's CUDA install.
#   scripts/gpu_bundle.sh [BUILD_DIR] [BUNDLE_DIR]   (default: build, gpu-bundle)
# Then, there: scripts/gpu_check.sh BUNDLE_DIR RESULTS_DIR
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$here/build}
bundle=${2:-$here/gpu-bundle}
bins=(tierflow optim_test store_test bench_offload_test)
for b in "${bins[@]}"; do
  [[ -x $build/bin/$b ]] || { echo "gpu_bundle.sh: $build/bin/$b is not built" >&2; exit 1; }
done
if ! grep -q "TIERFLOW_WITH_CUDA:INTERNAL=ON\|TIERFLOW_WITH_CUDA:.*=ON" "$build/CMakeCache.txt" 2>/dev/null &&
   ! ldd "$build/bin/tierflow" | grep -q libcublas; then
  echo "gpu_bundle.sh: $build is not a CUDA build" >&2
  exit 1
fi
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
for b in "${bins[@]}"; do cp "$build/bin/$b" "$bundle/bin/"; done
for b in "${bins[@]}"; do ldd "$build/bin/$b"; done | awk '/=> \// {print $3}' | sort -u |
  while read -r lib; do
    case $(basename "$lib") in
      libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | ld-linux* | libcuda.so* | libcublas* | \
        libcudart* | libnccl*) ;;
      *) cp -L "$lib" "$bundle/lib/" ;;
    esac
  done
du -sh "$bundle"
