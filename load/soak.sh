#!/usr/bin/env bash
# A soak run: a CPU-backend epsd on a fresh Unix socket and two eps-load
# processes against it at a fixed Poisson rate for DURATION, one unary and one
# on the stream, each printing every error and sampling epsd's RSS and open fds
# every SAMPLE seconds and at every error.
#
#   load/soak.sh OUT_DIR            (DURATION=10m RATE=10 SAMPLE=60s by default)
#
# EPSD and EPS_LOAD name the binaries (default build/service/epsd and
# build/load/eps-load). Exit status: 0 when both runs had no error.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: load/soak.sh OUT_DIR}
EPSD=${EPSD:-build/service/epsd}
EPS_LOAD=${EPS_LOAD:-build/load/eps-load}
DURATION=${DURATION:-10m}
RATE=${RATE:-10}
SAMPLE=${SAMPLE:-60s}
mkdir -p "$OUT"
source load/epsd_ctl.sh
trap epsd_stop EXIT
epsd_start "unix:///tmp/eps-load-soak-$$.sock" --backend=cpu
echo "epsd pid $EPSD_PID on $EPSD_TARGET; soak for $DURATION at poisson:$RATE per mode"
COMMON=(--target="$EPSD_TARGET" --preset=llama-3-8b --batch=1 --context=uniform:512-4k
        --rate=poisson:"$RATE" --sessions=2 --duration="$DURATION" --warmup=2s --soak
        --sample-every="$SAMPLE" --epsd-pid="$EPSD_PID")
status=0
"$EPS_LOAD" "${COMMON[@]}" --mode=unary --seed=1 --json="$OUT/soak-unary.json" \
  >"$OUT/soak-unary.txt" 2>&1 &
unary=$!
"$EPS_LOAD" "${COMMON[@]}" --mode=stream --seed=2 --json="$OUT/soak-stream.json" \
  >"$OUT/soak-stream.txt" 2>&1 &
stream=$!
wait "$unary" || status=$?
wait "$stream" || status=$?
cat "$OUT/soak-unary.txt" "$OUT/soak-stream.txt"
echo "epsd log:"
cat "$EPSD_LOG"
exit "$status"
