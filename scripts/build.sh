#!/usr/bin/env bash
# Configures and builds everything into build/ (Ninja, ccache when present).
# Extra arguments go to cmake, e.g. scripts/build.sh -DEPS_WITH_CUDA=OFF
# EPS_BUILD_TARGETS="epsd eps-demo" builds only those targets (scripts/demo.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${EPS_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DEPS_BUILD_TESTS=ON -DEPS_BUILD_BENCH=ON "$@" >/dev/null
targets=()
for t in ${EPS_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}"
