#!/usr/bin/env bash
# On the lent GPU machine (docs/benchmarks/attention.md): a quick benchmark of every
# kernel variant (EPS_ATTN_VARIANT), the attention tests under each, the full table
# with the faster of the two automatic choices, and compute-sanitizer memcheck /
# racecheck. $1: a folder holding libeps_attention.so, attention_test and the bench's
# layout (bench/attention_bench.py, client/python/src/eps_client/attention.py); logs go
# to $OUT. EPS_ATTN_VARIANTS (space-separated) narrows the variants, so that a run fits
# the device's per-command limit.
set -u
C=$(cd "${1:?carry folder}" && pwd)
OUT=${OUT:-/tmp/attention_run}
mkdir -p "$OUT"
export EPS_ATTENTION_LIB=$C/libeps_attention.so
export LD_LIBRARY_PATH=$C${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
all_variants="cta cta_kv_inner warp_lean warp_pipe warp_mma auto auto_lean auto_pipe"
read -r -a variants <<<"${EPS_ATTN_VARIANTS:-$all_variants}"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$OUT/gpu.txt"
for v in "${variants[@]}"; do
  EPS_ATTN_VARIANT=$v timeout 50 python3 "$C/bench/attention_bench.py" --quick \
    >"$OUT/quick_$v.md" 2>&1
  # geometric mean of the µs column over the quick rows
  score=$(awk -F'|' '$2+0 > 0 && $5+0 > 0 {s += log($5); n++} END {print n ? exp(s / n) : 0}' \
    "$OUT/quick_$v.md")
  echo "$v $score" | tee -a "$OUT/scores.txt"
  grep -E '^\| [0-9]+ \| [0-9]+k' "$OUT/quick_$v.md" | sed "s/^/$v /"
done
best=$(grep -E '^auto' "$OUT/scores.txt" | sort -k2 -g | awk '$2 > 0 {print $1; exit}')
echo "best: ${best:=auto}"
for v in "${variants[@]}"; do
  EPS_ATTN_VARIANT=$v timeout 40 "$C/attention_test" --gtest_brief=1 >"$OUT/test_$v.log" 2>&1
  echo "tests $v: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/test_$v.log" | tr '\n' ' ')"
done
EPS_ATTN_VARIANT=$best timeout 120 python3 "$C/bench/attention_bench.py" >"$OUT/full_$best.md" 2>&1
cat "$OUT/full_$best.md"
case $best in
  auto_pipe) large=warp_pipe ;;
  auto_lean) large=warp_lean ;;
  *) large=warp_mma ;;
esac
filter='-PagedAttention.GqaRatiosOfAnySizeMatchReference'
runs=("memcheck $best" "memcheck $large" "racecheck $best")
# warp_mma keeps q in shared memory: checked whichever automatic choice won
if [[ " ${variants[*]} " == *" warp_mma "* ]]; then
  [[ $large != warp_mma ]] && runs+=("memcheck warp_mma")
  runs+=("racecheck warp_mma")
fi
for run in "${runs[@]}"; do
  read -r tool v <<<"$run"
  EPS_ATTN_VARIANT=$v timeout 60 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    "$C/attention_test" --gtest_brief=1 --gtest_filter="$filter" >"$OUT/sanitizer_${tool}_$v.log" 2>&1
  echo "$tool ($v): rc=$? $(tail -2 "$OUT/sanitizer_${tool}_$v.log" | tr '\n' ' ')"
done
