#!/usr/bin/env bash
# Runs the reference engine on the lent GPU machine, in one command, against epsd's cuda
# backend (CUDA IPC buffers allocated by eps_client.cuda).
#
#   client/python/examples/run_reference_gpu.sh EPSD_DIR WHEEL_DIR MODEL [OUT_DIR] [-- engine flags]
#
# EPSD_DIR   folder with the epsd binary and lib/ (its non-libc shared libraries, from ldd)
# WHEEL_DIR  folder of wheels for Python 3.12: grpcio, protobuf, gguf (eps_client optional);
#            installed with pip --no-index into /tmp/eps-site
# MODEL      the .gguf file, or a prefix whose pieces PREFIX.part-* are concatenated
#            (a model larger than one carry travels in pieces); checked against MODEL.sha256
#            (or PREFIX.sha256) when that file exists
# OUT_DIR    where reference-b*.json and the logs go (default: $OUT if set, else /tmp/eps-ref)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
epsd_dir=$(cd "$1" && pwd); wheels=$(cd "$2" && pwd); model=$3; shift 3
out=${OUT:-/tmp/eps-ref}
if [[ $# -gt 0 && $1 != -- ]]; then out=$1; shift; fi
[[ $# -gt 0 && $1 == -- ]] && shift
mkdir -p "$out"

site=/tmp/eps-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" "$wheels"/*.whl
# The tree's own eps_client (client/python/src) comes first, so the engine and the library
# always match; an eps_client wheel in WHEEL_DIR is only a fallback.
export PYTHONPATH="$here/../src:$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import eps_client, grpc, google.protobuf, gguf, torch; print("eps_client", eps_client.__file__, "grpc", grpc.__version__, "protobuf", google.protobuf.__version__, "torch", torch.__version__)'

if [[ -f $model ]]; then
  gguf=$model; sum_file=$model.sha256
else
  gguf=/tmp/eps-model.gguf; sum_file=$model.sha256
  cat "$model".part-* > "$gguf"
fi
if [[ -f $sum_file ]]; then
  echo "$(cut -d' ' -f1 "$sum_file")  $gguf" | sha256sum -c -
fi

sock=/tmp/eps-ref-$$.sock
export LD_LIBRARY_PATH="$epsd_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# EPS_REF_BACKEND=cpu (with engine flags -- --buffers shm) checks the script without a GPU.
"$epsd_dir/epsd" --listen="unix://$sock" --backend="${EPS_REF_BACKEND:-cuda}" >"$out/epsd.log" 2>&1 &
epsd_pid=$!
trap 'kill $epsd_pid 2>/dev/null || true; wait $epsd_pid 2>/dev/null || true' EXIT
python3 - "$sock" <<'PY'
import sys, grpc
with grpc.insecure_channel(f"unix://{sys.argv[1]}") as ch:
    grpc.channel_ready_future(ch).result(timeout=30)
PY
echo "epsd up: $(head -1 "$out/epsd.log")"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

export PYTHONUNBUFFERED=1
# One engine process per batch size (EPS_REF_BATCHES, default "4 32"): at batch 4 a
# 135M model's step is launch-bound; at 32 the 8k-token attention reads dominate.
status=0
for batch in ${EPS_REF_BATCHES:-4 32}; do
  echo "=== batch $batch"
  python3 "$here/reference_engine.py" --gguf "$gguf" --epsd-target "unix://$sock" \
    --buffers cuda --device cuda --dtype bf16 --batch "$batch" --prompt-tokens 7680 \
    --decode-steps 128 --warmup-steps 8 --top-pages 4,8,16 \
    --json "$out/reference-b$batch.json" "$@" 2>&1 | tee "$out/engine-b$batch.log" || status=1
done
tail -n 20 "$out/epsd.log" >&2 || true
exit $status
