#!/usr/bin/env bash
# On the lent GPU machine: unpacks the carry that scripts/gpu_carry.sh packed
# (pack.tar.xz in the carry folder, $1 or .carry) in place; Python's tarfile
# where the image has no xz. Sourced or run by gpu_check.sh and gpu_profile.sh.
set -euo pipefail
carry=${1:-.carry}
if [[ -f $carry/pack.tar.xz ]]; then
  tar xJf "$carry/pack.tar.xz" -C "$carry" 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$carry/pack.tar.xz" "$carry" || { echo "cannot unpack $carry/pack.tar.xz" >&2; exit 1; }
  rm -f "$carry/pack.tar.xz"
fi
