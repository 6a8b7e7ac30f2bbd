#!/usr/bin/env bash
# Sets up, builds and runs every tierflow test:
#   1. the Release build (CUDA sources compiled for sm_90 when nvcc exists) and its tests;
#   2. clang's thread-safety analysis of core/, tiers/, io/ and collectives/, from that build's
#      compile_commands.json (a parse per file, not another build);
#   3. the same tests built with AddressSanitizer + UndefinedBehaviorSanitizer;
#   4. the concurrent tests (block store, links, scheduler, ZenFlow engine, the
#      collectives' watchdog)
#      built with ThreadSanitizer;
#   5. the Python package's tests (pytest over tests/python, in .venv/, which
#      setup.sh made and installed the package into).
# Fails on the first failure.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"

"$here/scripts/setup.sh"

echo "== Release build and tests"
"$here/scripts/build.sh" build -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
ctest --test-dir build --output-on-failure -j "$(nproc)"

echo "== Thread-safety analysis (clang)"
"$here/scripts/thread_safety.sh" build core tiers io collectives

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and tests"
"$here/scripts/build.sh" build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTIERFLOW_SANITIZE=address,undefined -DTIERFLOW_CUDA=OFF -DTIERFLOW_BUILD_BENCH=OFF
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$(nproc)"

echo "== ThreadSanitizer build and the concurrent tests"
# Only the concurrent tests' binaries are built here, to keep CI short.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$here" -B "$here/build-tsan" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTIERFLOW_SANITIZE=thread -DTIERFLOW_CUDA=OFF -DTIERFLOW_BUILD_BENCH=OFF >/dev/null
cmake --build "$here/build-tsan" -j "$(nproc)" --target store_test store_stress_test store_failure_test scheduler_test zenflow_test \
  collectives_test
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  ctest --test-dir build-tsan --output-on-failure -j "$(nproc)" \
  -R '^(store|store_stress|store_failure|store_failure/persistent_writeback_failure|link|fair_queue|Scheduler|OptimizerStream|ZenflowEngine|Watchdog)\.'

echo "== Python package tests"
"$here/.venv/bin/python" -m pytest -q "$here/tests/python"
