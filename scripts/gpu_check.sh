#!/usr/bin/env bash
# On the lent GPU machine, in one call (the device tool; carry: .carry, or the
# folder EPS_CARRY_DIR names, made here by scripts/gpu_carry.sh): every GPU test
# (the CPU-bound step test in parallel gtest shards), the pre-pass benchmark,
# the async-fence and two-process tests against epsd, compute-sanitizer memcheck
# and racecheck on the step test, and a short table last. Logs go to $OUT, packed
# at the end into $OUT/logs.tgz (bench.0.log and device.txt stay beside it).
#   EPS_GPU_ONLY="gpu_step_test bench"   run only those (names as below)
#   EPS_BENCH_ARGS="--contexts=32768"    arguments of eps_gpu_bench
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
CARRY=${EPS_CARRY_DIR:-.carry}
OUT=${OUT:-/tmp/eps-gpu}
mkdir -p "$OUT"
bash scripts/carry_unpack.sh "$CARRY" || exit 1
export LD_LIBRARY_PATH=$PWD/$CARRY/lib EPSD_BIN=$PWD/$CARRY/epsd RANK_ENGINE_BIN=$PWD/$CARRY/rank_engine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
declare -A result
want() { [[ -z ${EPS_GPU_ONLY:-} || " $EPS_GPU_ONLY " == *" $1 "* ]]; }
run() {  # name, timeout, shards, command...: the shards run in parallel
  local name=$1 limit=$2 shards=$3 t0=$SECONDS ok=pass pids=()
  shift 3
  want "$name" || return 0
  for i in $(seq 0 $((shards - 1))); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "$limit" "$@" >"$OUT/$name.$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || ok=FAIL; done
  result[$name]="$ok ($((SECONDS - t0)) s)"
  echo "$name ${result[$name]}"
}
run gpu_step_test 120 6 "$CARRY/gpu_step_test"
run gpu_strict_oracle_test 60 1 "$CARRY/gpu_strict_oracle_test"
run gpu_summary_test 60 1 "$CARRY/gpu_summary_test"
# shellcheck disable=SC2086
run bench 300 1 "$CARRY/eps_gpu_bench" ${EPS_BENCH_ARGS:-}
run async_fence_test 120 1 "$CARRY/async_fence_test"
# The sparse paged attention under its default planner (every variant and the sanitizers:
# bench/attention_device_run.sh).
run attention_test 120 1 "$CARRY/attention_test"
# The sanitizers on the device-heavy cases (the others repeat them on other shapes);
# Fused* are the fused selection's (tests/gpu/fused_select_test.cc), Coarse* the coarse
# level's (tests/gpu/coarse_step_gpu_test.cc; every coarse group a candidate, c1024, repeats
# the flat selection's kernels), Feedback* selection feedback's (tests/gpu/feedback_gpu_test.cc).
# Less the case whose cudaMalloc must fail (memcheck reports the API error it asks for).
filter='Quest8/*:QueryTypes/*:Methods/*jl_d128_g8:Methods/*quest_d128_g2:Methods/*questclt*:WarpSums/*questclt*:Budgets/*:Mass/*:MassLayers/*:WarpSums/*quest_d128_g8:WarpSums/*strict:GpuStepGraphTest.*:GpuStepValidationTest.*:Fused*:Coarse/*c1p5*:CoarseGpu*:Feedback*-*AFailedCreate*'
run memcheck 300 6 compute-sanitizer --tool memcheck --error-exitcode 1 "$CARRY/gpu_step_test" \
  --gtest_filter="$filter"
run racecheck 300 6 compute-sanitizer --tool racecheck --error-exitcode 1 "$CARRY/gpu_step_test" \
  --gtest_filter="$filter"
run two_process_test 300 1 "$CARRY/two_process_test"
# Tensor-parallel ranks (docs/api-memory.md §3.7): several on one GPU; rank r on GPU r where
# there are more.
run multi_rank_test 400 1 "$CARRY/multi_rank_test"
echo
[[ -f $OUT/bench.0.log ]] && cat "$OUT/bench.0.log"
echo
grep -h "strict mode\|SelectPages\|Ping \|two-process\|in lockstep\|ERROR SUMMARY\|RACECHECK SUMMARY\|Failure" \
  "$OUT"/*.log | sort | uniq -c
for k in "${!result[@]}"; do printf '%-24s %s\n' "$k" "${result[$k]}"; done
# The device tool brings back at most 8 files from $OUT: the logs go back as one archive
# (logs.tgz), beside device.txt and the bench's log.
(cd "$OUT" && tar czf logs.tgz ./*.log && find . -maxdepth 1 -name '*.log' ! -name bench.0.log -delete)
grep -q FAIL <<<"${result[*]}" && exit 1 || exit 0
