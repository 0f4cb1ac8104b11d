#!/usr/bin/env bash
# On the lent GPU machine, in one call (the device tool; carry: .carry, made
# here by scripts/gpu_carry.sh): every GPU test, compute-sanitizer memcheck and
# racecheck on the kernels, the pre-pass benchmark, and a short table last.
# Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/eps-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.carry/lib EPSD_BIN=$PWD/.carry/epsd
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
declare -A result
run() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then result[$name]="pass"; else result[$name]="FAIL"; fi
  result[$name]+=" ($((SECONDS - t0)) s)"
  tail -n 4 "$OUT/$name.log"
}
run gpu_step_test .carry/gpu_step_test
run gpu_summary_test .carry/gpu_summary_test
run two_process_test .carry/two_process_test
run async_fence_test .carry/async_fence_test
run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 .carry/gpu_step_test
run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 .carry/gpu_step_test
# shellcheck disable=SC2086
# shellcheck disable=SC2086
run bench .carry/eps_gpu_bench ${EPS_BENCH_ARGS:-}
echo
grep -h "round trip\|SelectPages\|Ping \|two-process\|async fence" "$OUT"/two_process_test.log "$OUT"/async_fence_test.log
echo
cat "$OUT/bench.log"
echo
for k in gpu_step_test gpu_summary_test two_process_test async_fence_test memcheck racecheck bench; do
  printf '%-18s %s\n' "$k" "${result[$k]}"
done
grep -q FAIL <<<"${result[*]}" && exit 1 || exit 0
