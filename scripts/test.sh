#!/usr/bin/env bash
# The README's test command: installs what a fresh machine lacks, builds, and
# runs every test. CI (.ci/run) calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh "$@"
cd "${EPS_BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" --timeout 600
