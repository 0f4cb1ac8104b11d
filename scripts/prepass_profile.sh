#!/usr/bin/env bash
# On the lent GPU machine, one call: the kernels of one pre-pass step under Nsight Compute,
# once in eps_gpu_bench and once in epsd serving the reference engine, at batch 8 x 32k,
# g = 2, questclt threshold; and the GPU's clocks, power and temperature sampled every
# 100 ms throughout: the pre-pass's kernels side by side, in the benchmark and in epsd
# beside an engine. It found the 2.4x gap of 2026-11-25 to be the same work waiting longer
# for memory (docs/benchmarks/gpu-history-2026-11-25-26.md, "2026-11-25, second session").
# Carries: .carry (scripts/gpu_carry.sh) and .carry-engine (scripts/engine_stage.sh).
# EPS_PROFILE_PARTS (default "bench engine") picks the parts. Results in $OUT (default
# /tmp/eps-prepass-profile):
#   smi.csv, ncu-bench.csv, ncu-epsd.csv (one row per kernel launch), engine/, logs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/eps-prepass-profile}
mkdir -p "$out"
bash scripts/carry_unpack.sh .carry || exit 1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
  --format=csv -lms 100 >"$out/smi.csv" 2>&1 &
smi=$!
trap 'kill $smi 2>/dev/null' EXIT
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second
metrics+=,launch__registers_per_thread,launch__grid_size,launch__block_size
metrics+=,launch__shared_mem_per_block_dynamic
ncu=(ncu --clock-control none --metrics "$metrics" --csv --page raw)
status=0
parts=${EPS_PROFILE_PARTS:-bench engine}
if [[ $parts == *bench* ]]; then
  echo "=== bench under ncu ($(date -u +%H:%M:%S) UTC)"
  # The first policy case's steps 10-29 (three kernels a step; the bench's setup kernels first).
  LD_LIBRARY_PATH=$PWD/.carry/lib timeout 200 "${ncu[@]}" --launch-skip 60 --launch-count 60 \
    .carry/eps_gpu_bench --group-blocks=2 --batches= --contexts= --slots=scattered \
    "--policies=questclt threshold" >"$out/ncu-bench.csv" 2>"$out/ncu-bench.err" || status=1
  echo "bench: $(wc -l <"$out/ncu-bench.csv") lines; $(tail -n 2 "$out/ncu-bench.err")"
fi
if [[ $parts == *engine* ]]; then
  echo "=== engine, epsd under ncu ($(date -u +%H:%M:%S) UTC)"
  # epsd's first pre-pass kernels after its warm-up: the calibration's synchronous selections
  # (with the engine idle; the slow pre-pass is as slow there, "pre-pass idle us").
  kernels="'regex:ScoreKernel|SelectKernel|TermsKernel'"  # quoted for epsd_cmd's bash -c
  EPS_EPSD_PREFIX="${ncu[*]} --kernel-name $kernels --launch-skip 6 --launch-count 24 \
  --log-file $out/ncu-epsd.csv" EPS_EPSD_STOP_S=120 \
    EPS_ENGINE_PLAN=speed EPS_ENGINE_SPEED=b8-32k \
    EPS_ENGINE_ARGS="--group-blocks 2 --fractions 0.25 --decode-steps 40" \
    OUT="$out/engine" timeout 400 bash scripts/engine_gpu.sh >"$out/engine.log" 2>&1 || status=1
  tail -n 4 "$out/engine.log"
  echo "epsd: $(wc -l <"$out/ncu-epsd.csv" 2>/dev/null) lines"
fi
gzip -kf "$out"/ncu-*.csv
exit $status
