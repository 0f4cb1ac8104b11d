#!/usr/bin/env bash
# The README's run command: installs, builds, starts epsd (CPU backend) on a
# private Unix socket, and runs eps-demo against it step by step.
# Extra arguments go to eps-demo, e.g. scripts/demo.sh --steps=32 --mode=stream
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Only what the demo runs (the tests and benchmarks are scripts/test.sh's).
EPS_BUILD_TARGETS="epsd eps-demo" bash scripts/build.sh
BUILD_DIR=${EPS_BUILD_DIR:-build}
SOCKET_DIR=$(mktemp -d)
SOCKET="unix://$SOCKET_DIR/epsd.sock"
# Metrics on a port the kernel picks (epsd prints it), so a busy 9464 never stops the demo.
"$BUILD_DIR"/service/epsd --listen="$SOCKET" --backend=cpu --metrics-listen=127.0.0.1:0 &
EPSD_PID=$!
trap 'kill -TERM $EPSD_PID 2>/dev/null; wait $EPSD_PID 2>/dev/null; rm -rf "$SOCKET_DIR"' EXIT
for _ in $(seq 100); do [[ -S "$SOCKET_DIR/epsd.sock" ]] && break; sleep 0.05; done
"$BUILD_DIR"/demo/eps-demo --target="$SOCKET" "$@"
