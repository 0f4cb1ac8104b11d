#!/usr/bin/env bash
# Configures and builds everything into build/ (Ninja, ccache when present).
# Extra arguments go to cmake, e.g. scripts/build.sh -DEPS_WITH_CUDA=OFF
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${EPS_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DEPS_BUILD_TESTS=ON -DEPS_BUILD_BENCH=ON "$@" >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
