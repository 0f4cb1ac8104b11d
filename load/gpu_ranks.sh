#!/usr/bin/env bash
# Tensor-parallel ranks on a multi-GPU machine (docs/benchmarks/gpu.md, "Tensor-parallel
# ranks"), from binaries carried in .carry/load (load/make_carry.sh packs them):
#
#   here:  scripts/build.sh && load/make_carry.sh
#   there: bash load/gpu_ranks.sh          (carry: .carry; EPS_RANK_TPS="2 4 8" by default)
#   here, a dry run of the script on the cpu backend:
#     EPSD=build/service/epsd EPS_LOAD=build/load/eps-load EPS_RANK_BACKEND=cpu \
#       EPS_RANK_ARGS="--batch=1 --context=2k --duration=1s --warmup=100ms" bash load/gpu_ranks.sh
#
# For each tensor-parallel size T: one epsd --backend=cuda, first one rank of the
# llama-3-70b-tpT shape alone on GPU 0 (the single-GPU number), then T ranks in
# lockstep, rank r on GPU r mod the GPUs; JSON reports go to $OUT/ranks (packed as
# $OUT/ranks.tgz at the end when $OUT is set), and a table
# of per-rank SelectPages p50 against the single-rank p50 and the spread between
# ranks at the same step comes last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
CARRY=$PWD/.carry/load
export EPSD=${EPSD:-$CARRY/epsd} EPS_LOAD=${EPS_LOAD:-$CARRY/eps-load}
OUT_DIR=${OUT:-$PWD/ranks-out}/ranks
mkdir -p "$OUT_DIR"
{
  date -u
  nproc
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null
  nvidia-smi topo -m 2>/dev/null
} | tee "$OUT_DIR/machine.txt"
SCRIPTS=load
[[ -f load/epsd_ctl.sh ]] || SCRIPTS=$CARRY
source "$SCRIPTS/epsd_ctl.sh"
trap epsd_stop EXIT
ARGS=${EPS_RANK_ARGS:---batch=8 --context=32768 --duration=5s --warmup=1s --floor-calls=0}
BACKEND=${EPS_RANK_BACKEND:-cuda}
for tp in ${EPS_RANK_TPS:-2 4 8}; do
  epsd_start "unix:///tmp/eps-ranks-$$-$tp.sock" --backend="$BACKEND" || exit 1
  for ranks in 1 "$tp"; do
    # shellcheck disable=SC2086
    "$EPS_LOAD" --target="$EPSD_TARGET" --backend="$BACKEND" --preset="llama-3-70b-tp$tp" \
      --ranks="$ranks" $ARGS --json="$OUT_DIR/tp$tp-ranks$ranks.json" 2>&1 |
      tee -a "$OUT_DIR/ranks.log"
  done
  epsd_stop
done
python3 - "$OUT_DIR" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| tp | ranks on GPUs | single-rank p50 us | per-rank p50 us (min-max) | worst / single | spread p50 / p99 us |")
print("| ---: | --- | ---: | ---: | ---: | ---: |")
for tp in (1, 2, 4, 8, 16):
    one, many = out / f"tp{tp}-ranks1.json", out / f"tp{tp}-ranks{tp}.json"
    if not (one.exists() and many.exists()):
        continue
    base = json.loads(one.read_text())["ranks"][0]["p50_us"]
    report = json.loads(many.read_text())
    p50 = [r["p50_us"] for r in report["ranks"]]
    gpus = sorted({r["device"] for r in report["ranks"]})
    s = report["rank_spread"]
    print(f"| {tp} | {gpus} | {base:.1f} | {min(p50):.1f}-{max(p50):.1f} | {max(p50) / base:.2f}x "
          f"| {s['p50_us']:.1f} / {s['p99_us']:.1f} |")
PY
# The device tool brings back at most 8 files from $OUT: there, one archive of the folder.
if [[ -n ${OUT:-} ]]; then
  tar czf "$OUT/ranks.tgz" -C "$OUT" ranks && rm -rf "$OUT_DIR"
fi
