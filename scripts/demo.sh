#!/usr/bin/env bash
# The README's first command: installs, builds, and runs the main job.
# For now: core/ selecting pages on a synthetic long-context workload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
"${EPS_BUILD_DIR:-build}"/demo/eps_core_demo "$@"
