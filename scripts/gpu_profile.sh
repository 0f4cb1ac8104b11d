#!/usr/bin/env bash
# On the lent GPU machine (carry: .carry from scripts/gpu_carry.sh): the
# pre-pass benchmark under Nsight Compute, one CSV row per kernel launch with
# its duration, DRAM bytes, active warps and registers, for each batch in
# EPS_PROFILE_BATCHES at 32k (docs/benchmarks/gpu.md reads them: where a step's
# time goes).
#   EPS_PROFILE_BATCHES="1 8"  EPS_BENCH_ARGS="--contexts=32768"
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
CARRY=${EPS_CARRY_DIR:-.carry}
OUT=${OUT:-/tmp/eps-profile}
mkdir -p "$OUT"
bash scripts/carry_unpack.sh "$CARRY" || exit 1
export LD_LIBRARY_PATH=$PWD/$CARRY/lib
metrics=gpu__time_duration.sum,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active
metrics+=,launch__registers_per_thread,launch__grid_size,launch__block_size
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for b in ${EPS_PROFILE_BATCHES:-1 8}; do
  # shellcheck disable=SC2086
  timeout 280 ncu --clock-control none --metrics "$metrics" --csv --page raw \
    "$CARRY/eps_gpu_bench" --batches="$b" --queued=off ${EPS_BENCH_ARGS:---contexts=32768} \
    >"$OUT/ncu_b$b.csv" 2>"$OUT/ncu_b$b.err"
  echo "batch $b: rc $?, $(wc -l <"$OUT/ncu_b$b.csv") lines"
  # The same run without the profiler, for the event times beside the kernel times.
  # shellcheck disable=SC2086
  "$CARRY/eps_gpu_bench" --batches="$b" ${EPS_BENCH_ARGS:---contexts=32768} >"$OUT/bench_b$b.log" 2>&1
done
gzip -f "$OUT"/ncu_b*.csv
