#!/usr/bin/env bash
# On the lent GPU machine, one call: the reference engine's pre-pass against the
# benchmark's, for the same shape and kernel (docs/benchmarks/gpu-history-2026-11-25-26.md,
# "2026-11-25, second session": an IPC allocation that is not whole 2 MiB pages made it 2.4 x
# slower).
# Carries: .carry (scripts/gpu_carry.sh) and .carry-engine (scripts/engine_stage.sh).
# Runs, at batch 8 x 32k and g = 2, questclt threshold, scattered slots:
#   1. eps_gpu_bench with the pool allocated in its own process; mapped from a child
#      process through CUDA IPC (as epsd maps an engine's); and the same 4 KiB past a
#      multiple of 2 MiB (the slow case, kept as the control);
#   2. the reference engine's speed run, whose table has the pre-pass during decode
#      and with the engine idle ("pre-pass idle us").
# Logs go to $OUT (default /tmp/eps-probe).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/eps-probe}
mkdir -p "$out"
bash scripts/carry_unpack.sh .carry || exit 1
status=0
for pool in local ipc ipc-pad; do
  echo "=== bench, pool $pool ($(date -u +%H:%M:%S) UTC)"
  pad=0
  [[ $pool == ipc-pad ]] && pad=4096
  LD_LIBRARY_PATH=$PWD/.carry/lib timeout 150 .carry/eps_gpu_bench --group-blocks=2 \
    --batches= --contexts= --slots=scattered --pool="${pool%-pad}" --pool-pad=$pad \
    "--policies=questclt threshold,quest threshold (" >"$out/bench-$pool.log" 2>&1 || status=1
  grep -v '^$' "$out/bench-$pool.log"
done
echo "=== reference engine ($(date -u +%H:%M:%S) UTC)"
EPS_ENGINE_PLAN=speed EPS_ENGINE_SPEED=b8-32k \
  EPS_ENGINE_ARGS="--group-blocks 2 --fractions 0.25 --decode-steps 40" \
  OUT="$out/engine" timeout 240 bash scripts/engine_gpu.sh >"$out/engine.log" 2>&1 || status=1
tail -n 6 "$out/engine.log"
exit $status
