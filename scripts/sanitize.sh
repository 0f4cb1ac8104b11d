#!/usr/bin/env bash
# Builds the whole project with AddressSanitizer + UndefinedBehaviorSanitizer
# into build-asan/ (gcc, no CUDA) and runs the whole test suite under them.
# Any report fails its test (UB is fatal: -fno-sanitize-recover). Extra
# arguments go to ctest, e.g. scripts/sanitize.sh -R service (the tests that load
# a library into Python, EPS_ASAN_CTYPES_TESTS, run second with the runtime preloaded).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${EPS_ASAN_BUILD_DIR:-build-asan}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPS_SANITIZE=ON \
  -DEPS_WITH_CUDA=OFF -DEPS_BUILD_TESTS=ON -DEPS_BUILD_BENCH=OFF >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
# Leak checks on: epsd and the tests must free what they allocate.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:halt_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
cd "$BUILD_DIR"
# Tests that load an instrumented library into Python through ctypes need the ASan runtime
# first in the process (LD_PRELOAD), and Python's own allocations are not ours to leak-check.
ctypes_tests=${EPS_ASAN_CTYPES_TESTS:-eval_harness_test}
ctest --output-on-failure -j "$(nproc)" --timeout 900 -E "$ctypes_tests" "$@"
LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1 \
  ctest --output-on-failure -j "$(nproc)" --timeout 900 -R "$ctypes_tests" "$@"
