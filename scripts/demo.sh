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
# `|| true`: under set -e a failing command in the trap would replace the script's status
# (epsd already gone, or its status on TERM).
trap 'kill -TERM $EPSD_PID 2>/dev/null || true; wait $EPSD_PID 2>/dev/null || true
      rm -rf "$SOCKET_DIR"' EXIT
# An epsd that cannot start (a bad flag, no memory) has said why on stderr; the demo stops
# with its status rather than dialling a socket nobody serves.
for _ in $(seq 200); do
  [[ -S "$SOCKET_DIR/epsd.sock" ]] && break
  if ! kill -0 "$EPSD_PID" 2>/dev/null; then
    status=0
    wait "$EPSD_PID" || status=$?
    echo "demo.sh: epsd exited with status $status before it served $SOCKET" >&2
    exit $((status == 0 ? 1 : status))
  fi
  sleep 0.05
done
if [[ ! -S "$SOCKET_DIR/epsd.sock" ]]; then
  echo "demo.sh: epsd did not create $SOCKET within 10 s" >&2
  exit 1
fi
"$BUILD_DIR"/demo/eps-demo --target="$SOCKET" "$@"
