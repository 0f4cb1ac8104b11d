#!/usr/bin/env bash
# Runs the transport and setting comparisons of docs/benchmarks/latency-history.md:
# each configuration twice, against a CPU-backend epsd started here.
#
#   load/compare.sh OUT_DIR [EXTRA eps-load FLAGS...]
#
# Run from the repository root. EPSD and EPS_LOAD name the binaries (default
# build/service/epsd and build/load/eps-load); DURATION (default 5s) sets each run's measured window;
# BACKEND (default cpu) is epsd's backend for the preset runs. Writes one JSON per
# run to OUT_DIR and prints a markdown table (load/summarize.py) at the end.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)  # this script's helpers (load/ or a carried copy)
OUT=${1:?usage: load/compare.sh OUT_DIR [eps-load flags...]}
shift
EXTRA=("$@")
EPSD=${EPSD:-build/service/epsd}
EPS_LOAD=${EPS_LOAD:-build/load/eps-load}
DURATION=${DURATION:-5s}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
source "$HERE/epsd_ctl.sh"

SOCK=/tmp/eps-load-compare-$$.sock
# A small step, so that transport costs are visible next to the selection work.
SMALL=(--preset=smollm2-135m --batch=1 --context=4k --duration="$DURATION" --warmup=1s)

run() {  # run NAME TARGET FLAGS...: writes NAME-$rep.json
  local name=$1 target=$2
  shift 2
  echo "== $name ($rep/2)"
  "$EPS_LOAD" --target="$target" "$@" "${EXTRA[@]}" --json="$OUT/$name-$rep.json" ||
    echo "(eps-load exited $?)"
}

UDS_PID= TCP_PID= UDS_LOG= TCP_LOG=
trap 'kill -TERM $UDS_PID $TCP_PID 2>/dev/null; wait; rm -f $SOCK $UDS_LOG $TCP_LOG' EXIT
epsd_start "unix://$SOCK" --backend=cpu
UDS=$EPSD_TARGET UDS_PID=$EPSD_PID UDS_LOG=$EPSD_LOG
epsd_start 127.0.0.1:0 --backend=cpu
TCP=$EPSD_TARGET TCP_PID=$EPSD_PID TCP_LOG=$EPSD_LOG

# Every configuration once, then all of them again: the two runs of one
# configuration are minutes apart, so the spread includes the machine's drift.
for rep in 1 2; do
  # 1. Unix socket vs loopback TCP; 2. unary vs stream (closed loop, one session).
  run uds-unary "$UDS" "${SMALL[@]}" --mode=unary
  run tcp-unary "$TCP" "${SMALL[@]}" --mode=unary
  run uds-stream "$UDS" "${SMALL[@]}" --mode=stream
  run tcp-stream "$TCP" "${SMALL[@]}" --mode=stream
  # 3. The client's wait: callback API and a condition variable (as EpsClient) vs the sync stub.
  run uds-ping-sync "$UDS" "${SMALL[@]}" --mode=unary --ping-api=sync
  # 4. Channel arguments (two sessions, so that sharing one connection can matter).
  run chan-default "$UDS" "${SMALL[@]}" --mode=unary --sessions=2
  run chan-noretry "$UDS" "${SMALL[@]}" --mode=unary --sessions=2 --channel-arg=grpc.enable_retries=0
  run chan-localpool "$UDS" "${SMALL[@]}" --mode=unary --sessions=2 --channel-arg=grpc.use_local_subchannel_pool=1
  # 5. Server concurrency: more sessions (epsd runs each step on a gRPC callback thread).
  run sessions-4 "$UDS" "${SMALL[@]}" --mode=unary --sessions=4
  # 6. Open loop at a fixed Poisson rate: tail latency under load, no coordinated omission.
  run open-poisson200 "$UDS" "${SMALL[@]}" --mode=unary --rate=poisson:200
  # 7. The headline shape: Llama-3-8B, batch 8, 32k context (CPU backend: the selection dominates).
  run llama8b-b8-32k "$UDS" --mode=unary --preset=llama-3-8b --batch=8 --context=32768 --duration="$DURATION" --warmup=1s
  run llama8b-b1-8k-stream "$UDS" --preset=llama-3-8b --batch=1 --context=8k --mode=stream --duration="$DURATION" --warmup=1s
done

"$PYTHON" "$HERE/summarize.py" "$OUT"/*.json
