#!/usr/bin/env bash
# Here (the developer machine): packs what the lent GPU machine needs into .carry/
# (ignored by git; EPS_CARRY_DIR names another folder): the GPU tests, the
# benchmark, epsd, and the Debian shared libraries they link that the GPU
# machine's Ubuntu image lacks, packed as one pack.tar.xz (about a fifth of the
# size: a carry and the working tree together must stay under 64 MiB;
# EPS_CARRY_PACK=0 leaves the files as they are). Then run, there:
#   bash scripts/gpu_check.sh        (the device tool's command; carry: .carry)
#   EPS_CARRY_DIR=.carry-x bash scripts/gpu_check.sh   (carry: .carry-x)
# gpu_check.sh unpacks the archive first.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${EPS_BUILD_DIR:-build}
CARRY=${EPS_CARRY_DIR:-.carry}
rm -rf "$CARRY" && mkdir -p "$CARRY/lib"
bins=(service/epsd tests/gpu_step_test tests/gpu_strict_oracle_test tests/gpu_summary_test
      tests/two_process_test tests/async_fence_test tests/multi_rank_test tests/rank_engine
      tests/attention_test bench/eps_gpu_bench "$@")
for b in "${bins[@]}"; do
  cp "$BUILD/$b" "$CARRY/"
  strip "$CARRY/$(basename "$b")"
done
# Every library outside glibc's core set (the image has its own, newer glibc).
for b in "$CARRY"/*; do
  [[ -f $b && -x $b ]] || continue
  ldd "$b" | awk '/=> \//{print $3}'
done | sort -u | grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$CARRY/lib/"; done
du -sh "$CARRY"
if [[ ${EPS_CARRY_PACK:-1} == 1 ]]; then
  tar cf - -C "$CARRY" . | xz -T2 -6 >"$CARRY.pack.tar.xz"
  rm -rf "$CARRY" && mkdir -p "$CARRY" && mv "$CARRY.pack.tar.xz" "$CARRY/pack.tar.xz"
  du -sh "$CARRY"
fi
