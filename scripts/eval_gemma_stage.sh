#!/usr/bin/env bash
# Here (the developer machine): packs what scripts/eval_gemma_gpu.sh needs on the lent GPU
# machine into git-ignored carry folders. A call carries the working tree too (64 MiB in
# all), so each folder stays under EPS_GEMMA_PIECE_MIB (default 46) MiB:
#   .carry-gemma/         libeps_eval.so and its non-system shared libraries (lib/), the
#                         gguf wheel (wheels/; the image has torch and numpy, not gguf), the
#                         licence texts (licences/), MANIFEST (each piece's sha256)
#   .carry-gemma-1 .. N/  the Gemma 3 270M GGUF, gzip-compressed (253 -> 238 MB) and cut
#                         into pieces, each with a copy of MANIFEST
# The GGUF comes through the harness cache (eps_eval.gemma.fetch_gguf; EPS_EVAL_CACHE,
# default ~/.cache/eps-eval). Prints the device calls to make, in order.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${EPS_BUILD_DIR:-build}
PY=${EPS_PYTHON:-.venv/bin/python}
piece_mib=${EPS_GEMMA_PIECE_MIB:-46}
cache=${EPS_EVAL_CACHE:-$HOME/.cache/eps-eval}
dest=.carry-gemma

cmake --build "$BUILD" -j2 --target eps_eval
gguf=$(cd eval && "../$PY" -c 'import sys; from pathlib import Path
from eps_eval.gemma import fetch_gguf
print(fetch_gguf(Path(sys.argv[1])))' "$cache")

rm -rf "$dest" "$dest"-[0-9]* && mkdir -p "$dest/lib" "$dest/wheels" "$dest/licences"
cp "$BUILD/eval/libeps_eval.so" "$dest/" && strip "$dest/libeps_eval.so"
# Every library outside glibc and the compiler's runtime (the image has newer ones of those).
ldd "$dest/libeps_eval.so" | awk '/=> \//{print $3}' |
  grep -Ev '/(libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$dest/lib/"; done
wheels=${XDG_CACHE_HOME:-$HOME/.cache}/eps-gemma-wheels
mkdir -p "$wheels"
"$PY" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --dest "$wheels" gguf==0.19.0
cp "$wheels"/gguf-0.19.0-*.whl "$dest/wheels/"
cp -L /usr/share/common-licenses/* "$dest/licences/" 2>/dev/null || true

# The pieces: gzip once, cut the stream (the machine joins and gunzips them).
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
gzip -6 -c "$gguf" | split -b "${piece_mib}M" -d -a 1 - "$tmp/gemma.gguf.gz."
(cd "$tmp" && sha256sum gemma.gguf.gz.* > MANIFEST)
n=0
for p in "$tmp"/gemma.gguf.gz.*; do
  n=$((n + 1))
  mkdir -p "$dest-$n" && mv "$p" "$dest-$n/" && cp "$tmp/MANIFEST" "$dest-$n/"
done
cp "$tmp/MANIFEST" "$dest/"

tree_mib=$(( ($(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) + 1048575) / 1048576 ))
size() { echo $(( ($(du -sb "$@" | awk '{s += $1} END {print s}') + 1048575) / 1048576 )); }
echo "working tree ${tree_mib} MiB (travels with every call); carry folders:"
du -sh "$dest" "$dest"-[0-9]*
first=$(( $(size "$dest-1") + tree_mib )) last=$(( $(size "$dest-$n" "$dest") + tree_mib ))
echo "a piece's call: $first MiB; the last call: $last MiB (limit 64, tree included)"
if (( first > 63 || last > 63 )); then echo "too large: lower EPS_GEMMA_PIECE_MIB" >&2; exit 1; fi
echo
echo "Device calls, back to back (the machine keeps /tmp only while warm), each"
echo "command: bash scripts/eval_gemma_gpu.sh   timeout_s: 600"
for k in $(seq 1 $((n - 1))); do echo "  call $k: carry [\"$dest-$k\"]"; done
echo "  call $n: carry [\"$dest-$n\", \"$dest\"]   (joins, checks, runs; results in \$OUT)"
echo "A rerun after a lost machine: all calls again, adding \"$dest-units\" (holding the"
echo "returned gemma-q19.tar.gz) to the last call's carry: finished units are skipped."
