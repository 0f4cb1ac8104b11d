#!/usr/bin/env bash
# The README's test command: installs what a fresh machine lacks, builds, and
# runs every test. CI (.ci/run) calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh "$@"
(cd "${EPS_BUILD_DIR:-build}" && ctest --output-on-failure -j "$(nproc)" --timeout 600)
# A short fuzz run of Attach and SelectPages validation (clang, ASan + UBSan; docs/security.md).
if [[ -z ${EPS_SKIP_FUZZ:-} ]]; then bash scripts/fuzz.sh 5; fi
