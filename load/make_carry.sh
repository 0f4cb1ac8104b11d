#!/usr/bin/env bash
# Packs what load/gpu_latency.sh needs on the lent GPU machine into .carry/load/:
# epsd and eps-load (stripped, behind wrappers) and the shared libraries they load that are not
# part of glibc (ldd), since that machine has no gRPC C++ libraries.
#
#   load/make_carry.sh [BUILD_DIR]     (default build; build epsd and eps-load first)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DEST=.carry/load
rm -rf "$DEST"
mkdir -p "$DEST/lib"
mkdir -p "$DEST/bin"
for bin in "$BUILD/service/epsd" "$BUILD/load/eps-load"; do
  name=$(basename "$bin")
  strip -o "$DEST/bin/$name" "$bin"
  # A wrapper that sets the library path for this binary only (exec keeps the pid),
  # so that the machine's own python3 and tools keep their own libraries.
  printf '#!/bin/sh\nhere=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH="$here/lib" exec "$here/bin/%s" "$@"\n' \
    "$name" >"$DEST/$name"
  chmod +x "$DEST/$name"
  ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*) ;;
      *) cp -L "$lib" "$DEST/lib/" ;;
    esac
  done
done
cp load/compare.sh load/epsd_ctl.sh load/summarize.py load/gpu_latency.sh load/gpu_ranks.sh "$DEST/"
du -sh "$DEST"
