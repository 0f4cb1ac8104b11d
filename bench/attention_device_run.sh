#!/usr/bin/env bash
# On the lent GPU machine (docs/benchmarks/attention.md): the attention tests under every
# kernel variant, a quick benchmark of each variant, the full table with the fastest,
# and compute-sanitizer memcheck / racecheck on it. $1: a folder holding
# libeps_attention.so, attention_test, bench/attention_bench.py and
# client/python/src/eps_client/attention.py (the bench's layout); logs go to $OUT.
set -u
C=$(cd "${1:?carry folder}" && pwd)
OUT=${OUT:-/tmp/attention_run}
mkdir -p "$OUT"
export EPS_ATTENTION_LIB=$C/libeps_attention.so
variants=(warp cta cta_kv_inner warp_lean)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$OUT/gpu.txt"
for v in "${variants[@]}"; do
  EPS_ATTN_VARIANT=$v timeout 60 "$C/attention_test" --gtest_brief=1 >"$OUT/test_$v.log" 2>&1
  echo "tests $v: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/test_$v.log" | tr '\n' ' ')"
done
for v in "${variants[@]}"; do
  EPS_ATTN_VARIANT=$v timeout 60 python3 "$C/bench/attention_bench.py" --quick \
    >"$OUT/quick_$v.md" 2>&1
  # µs of batch 8 x 32k dense + batch 1 x 128k dense
  score=$(awk -F'|' '($2+0==8 && $3~/32k/ || $2+0==1 && $3~/128k/) && $4~/100 %/ {s+=$5} END {print s+0}' \
    "$OUT/quick_$v.md")
  echo "$v $score" >>"$OUT/scores.txt"
  grep -E '^\| (8|1) \| (32k|128k)' "$OUT/quick_$v.md" | sed "s/^/$v /"
done
best=$(sort -k2 -g "$OUT/scores.txt" | awk '$2 > 0 {print $1; exit}')
echo "best: ${best:=warp}"
EPS_ATTN_VARIANT=$best timeout 150 python3 "$C/bench/attention_bench.py" >"$OUT/full_$best.md" 2>&1
cat "$OUT/full_$best.md"
filter='-PagedAttention.GqaRatiosOfAnySizeMatchReference'
for tool in memcheck racecheck; do
  EPS_ATTN_VARIANT=$best timeout 80 compute-sanitizer --tool $tool --error-exitcode 9 \
    "$C/attention_test" --gtest_brief=1 --gtest_filter="$filter" >"$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool ($best): rc=$? $(tail -2 "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
done
