#!/usr/bin/env bash
# On the lent GPU machine, in one call (the device tool; carry: .carry, made
# here by scripts/gpu_carry.sh): every GPU test, compute-sanitizer memcheck and
# racecheck on the kernels, the pre-pass benchmark, and a short table last.
# Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/eps-gpu}
mkdir -p "$OUT"
CARRY=${EPS_CARRY_DIR:-.carry}
export LD_LIBRARY_PATH=$PWD/$CARRY/lib EPSD_BIN=$PWD/$CARRY/epsd
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
declare -A result
run() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then result[$name]="pass"; else result[$name]="FAIL"; fi
  result[$name]+=" ($((SECONDS - t0)) s)"
  tail -n 4 "$OUT/$name.log"
}
# EPS_GPU_ONLY="a b": run only those (names as in the table below).
want() { [[ -z ${EPS_GPU_ONLY:-} || " $EPS_GPU_ONLY " == *" $1 "* ]]; }
want gpu_step_test && run gpu_step_test timeout 300 "$CARRY/gpu_step_test"
want gpu_strict_oracle_test && run gpu_strict_oracle_test timeout 300 "$CARRY/gpu_strict_oracle_test"
want gpu_summary_test && run gpu_summary_test timeout 300 "$CARRY/gpu_summary_test"
want two_process_test && run two_process_test timeout 300 "$CARRY/two_process_test"
want async_fence_test && run async_fence_test timeout 120 "$CARRY/async_fence_test"
want memcheck && run memcheck timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 "$CARRY/gpu_step_test"
want racecheck && run racecheck timeout 300 compute-sanitizer --tool racecheck --error-exitcode 1 "$CARRY/gpu_step_test"
# shellcheck disable=SC2086
want bench && run bench timeout 300 "$CARRY/eps_gpu_bench" ${EPS_BENCH_ARGS:-}
echo
grep -h "round trip\|SelectPages\|Ping \|two-process\|async fence\|killed epsd\|strict mode" "$OUT"/*_test.log
echo
[[ -f $OUT/bench.log ]] && cat "$OUT/bench.log"
echo
for k in "${!result[@]}"; do printf '%-18s %s\n' "$k" "${result[$k]}"; done
grep -q FAIL <<<"${result[*]}" && exit 1 || exit 0
