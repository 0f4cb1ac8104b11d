#!/usr/bin/env bash
# On the lent GPU machine: eps-load with and without selection feedback (--feedback-share),
# first as two plain processes, then both under a CUDA MPS daemon started here (private
# pipe and log directories, stopped at the end), into $OUT (docs/benchmarks/latency.md,
# "Checked under MPS"). Carry: .carry holding load/ as load/make_carry.sh packs it (packed
# into .carry/pack.tar.xz when the tree and the carry exceed one call's 64 MiB:
# scripts/carry_unpack.sh .carry unpacks it).
set -u
cd "$(dirname "$0")/.." || exit 1
CARRY=$PWD/.carry/load
OUT=${OUT:-/tmp/feedback-mps}
mkdir -p "$OUT"
export EPSD=$CARRY/epsd
source load/epsd_ctl.sh
run_pair() {  # label: F = 0, 0.25, 0, 0.25 against one epsd
  local sock=/tmp/eps-mps-$$-$1.sock F
  epsd_start "unix://$sock" --backend=cuda || { echo "epsd did not start"; return 1; }
  for F in 0 0.25 0 0.25; do
    "$CARRY/eps-load" --target="unix://$sock" --backend=cuda --preset=llama-3-8b --batch=8 \
      --context=32768 --duration=4s --warmup=1s --floor-calls=0 --feedback-share=$F \
      --json="$OUT/$1-$F.json" >"$OUT/$1-$F.log" 2>&1
    echo "$1 F=$F: $(grep -m1 -E 'SelectPages' "$OUT/$1-$F.log")"
  done
  epsd_stop
}
date -u
run_pair plain
export CUDA_MPS_PIPE_DIRECTORY=/tmp/eps-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/eps-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS up" || { echo "MPS did not start"; exit 1; }
run_pair mps
echo quit | nvidia-cuda-mps-control
