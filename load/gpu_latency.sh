#!/usr/bin/env bash
# The latency comparisons of docs/benchmarks/latency-history.md on the lent GPU machine,
# from binaries carried in .carry/load (load/make_carry.sh packs them).
#
#   here:  scripts/build.sh && cmake --build build --target epsd eps-load && load/make_carry.sh
#   there: bash load/gpu_latency.sh          (carry: .carry)
#
# Runs load/compare.sh (CPU backend: the transport, stream, channel and session
# comparisons, and the Llama-3-8B shapes) into $OUT/latency (or ./latency-out; with $OUT
# set, as on the device tool, packed at the end as $OUT/latency.tgz),
# then the same Llama-3-8B shapes against epsd --backend=cuda, with sync and
# with async replies (--reply=async: the reply comes once the step is queued).
# EPS_LATENCY_CUDA_ONLY=1 skips the CPU-backend comparisons.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
CARRY=$PWD/.carry/load
export EPSD=$CARRY/epsd EPS_LOAD=$CARRY/eps-load  # wrappers that set their library path
OUT_DIR=${OUT:-$PWD/latency-out}/latency
mkdir -p "$OUT_DIR"
{
  date -u
  nproc
  grep -m1 'model name' /proc/cpuinfo
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
  cat /proc/loadavg
} | tee "$OUT_DIR/machine.txt"
# compare.sh and its helpers: from the working tree when present, else from the carry.
SCRIPTS=load
[[ -x load/compare.sh ]] || SCRIPTS=$CARRY
if [[ ${EPS_LATENCY_CUDA_ONLY:-0} != 1 ]]; then
  bash "$SCRIPTS/compare.sh" "$OUT_DIR" 2>&1 | tee "$OUT_DIR/compare.log"
fi

source "$SCRIPTS/epsd_ctl.sh"
trap epsd_stop EXIT
if epsd_start "unix:///tmp/eps-load-gpu-$$.sock" --backend=cuda; then
  for shape in "--batch=8 --context=32768" "--batch=1 --context=32768" "--batch=8 --context=131072" \
    "--batch=8 --context=32768 --reply=async" "--batch=1 --context=32768 --reply=async"; do
    name=cuda-llama8b-$(echo "$shape" | tr -d ' -' | tr '=' '_')
    for rep in 1 2; do
      # shellcheck disable=SC2086
      "$EPS_LOAD" --target="$EPSD_TARGET" --backend=cuda --preset=llama-3-8b $shape \
        --duration=5s --warmup=1s --json="$OUT_DIR/$name-$rep.json" 2>&1 | tee -a "$OUT_DIR/cuda.log"
    done
  done
  epsd_stop
fi
python3 "$SCRIPTS/summarize.py" "$OUT_DIR"/*.json | tee "$OUT_DIR/summary.md"
# The device tool brings back at most 8 files from $OUT: there, one archive of the folder.
if [[ -n ${OUT:-} ]]; then
  tar czf "$OUT/latency.tgz" -C "$OUT" latency && rm -rf "$OUT_DIR"
fi
