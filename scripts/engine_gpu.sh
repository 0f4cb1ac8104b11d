#!/usr/bin/env bash
# On the lent GPU machine: the reference engine's measurement (issue 14 item 4) and the
# kill -9 run, in one call, from the carry that scripts/engine_stage.sh packs:
#
#   bash scripts/engine_gpu.sh            (carry: .carry-engine; model staged, see below)
#
# .carry-engine/ holds epsd and lib/ (its non-libc shared libraries), libeps_engine.so,
# libeps_attention.so (when built), python/ (eps_client and the examples) and wheels/
# (grpcio, protobuf, gguf for the image's Python). The SmolLM2 GGUF for the quality and
# passkey runs is found at $EPS_MODEL, else joined from /tmp/eps-stage/*.part-* (staged
# by earlier calls to the same warm machine); without it those runs are skipped.
# EPS_ENGINE_QUICK=1 runs a small plan (a debugging pass). EPS_ENGINE_ARGS adds flags to
# every run (e.g. "--group-blocks 2"); EPS_ENGINE_TOP_PAGES and EPS_ENGINE_PASSKEY_TOP_PAGES
# replace the quality and passkey budgets (defaults 4,8,12,16,24,32 and 8,16 groups, for
# the reference engine's g = 8). EPS_ENGINE_PLAN=speed runs only the speed runs named in
# EPS_ENGINE_SPEED (default "b8-32k b2-128k", in either plan; no device tests, kill, quality or one-queue
# runs); EPS_ENGINE_PLAN=quality only the quality and passkey runs (and the speed runs
# named in EPS_ENGINE_SPEED, none by default). EPS_EPSD_PREFIX goes before epsd's command (a wrapper, e.g. ncu). At the end epsd
# gets SIGTERM and EPS_EPSD_STOP_S seconds (default 15) to drain and exit, and its wrapper
# the same to finish (ncu writes its report at exit); then SIGKILL.
# EPS_ENGINE_MPS=1 runs epsd and the engine as clients of a CUDA Multi-Process Service
# daemon started here (private pipe and log directories under /tmp, stopped at exit; the
# card's settings are left alone), so their kernels share the GPU without time-slicing
# between two contexts.
# Results: $OUT/*.json, logs, and the tables printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
carry=${EPS_ENGINE_CARRY:-.carry-engine}
bash scripts/carry_unpack.sh "$carry" || exit 1  # engine_stage.sh packs it
carry=$(cd "$carry" && pwd)
out=${OUT:-/tmp/eps-engine}
mkdir -p "$out"
site=/tmp/eps-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" "$carry"/wheels/*.whl >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
export PYTHONPATH="$carry/python/src:$carry/python/examples:$site"
export EPS_ENGINE_LIB="$carry/libeps_engine.so"
[[ -f $carry/libeps_attention.so ]] && export EPS_ATTENTION_LIB="$carry/libeps_attention.so"
export LD_LIBRARY_PATH="$carry:$carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
python3 -c 'import torch, grpc, eps_client; print("torch", torch.__version__, "grpc", grpc.__version__, torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

model=${EPS_MODEL:-}
if [[ -z $model ]] && ls /tmp/eps-stage/*.part-* >/dev/null 2>&1; then
  model=/tmp/eps-model.gguf
  cat /tmp/eps-stage/*.part-* > "$model"
  if ls /tmp/eps-stage/*.sha256 >/dev/null 2>&1; then
    echo "$(cut -d' ' -f1 /tmp/eps-stage/*.sha256 | head -1)  $model" | sha256sum -c - || exit 1
  fi
fi

if [[ ${EPS_ENGINE_MPS:-0} == 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/eps-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/eps-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS: the control daemon did not start"; exit 1; }
  echo "MPS: control daemon started"
fi
stop_mps() {
  [[ ${EPS_ENGINE_MPS:-0} == 1 ]] || return 0
  echo "MPS servers: $(echo get_server_list | nvidia-cuda-mps-control 2>&1 | tr '\n' ' ')"
  echo quit | nvidia-cuda-mps-control
}
sock=/tmp/eps-engine-$$.sock
pidfile=$out/epsd.pid
epsd_cmd="exec ${EPS_EPSD_PREFIX:-} $carry/epsd --listen=unix://$sock --backend=cuda --metrics-listen=off >>$out/epsd.log 2>&1"
start_epsd() {
  bash -c "$epsd_cmd" & echo $! > "$pidfile"
  python3 - "$sock" <<'PY'
import sys, grpc
with grpc.insecure_channel(f"unix://{sys.argv[1]}") as ch:
    grpc.channel_ready_future(ch).result(timeout=30)
PY
}
stop_epsd() {  # SIGTERM to epsd itself (under a wrapper, its child), then wait for the drain
  [[ -f $pidfile ]] || return 0
  local pid target p i
  pid=$(cat "$pidfile")
  target=$pid
  for p in $(pgrep -x epsd); do  # epsd itself, when a wrapper started it
    grep -qF "$sock" "/proc/$p/cmdline" 2>/dev/null && target=$p
  done
  kill -TERM "$target" 2>/dev/null
  for ((i = 0; i < ${EPS_EPSD_STOP_S:-15} * 5; ++i)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.2
  done
  kill -KILL "$pid" 2>/dev/null
}
trap 'stop_epsd; stop_mps' EXIT
start_epsd || { tail "$out/epsd.log"; exit 1; }
echo "epsd up: $(head -1 "$out/epsd.log")"

engine() {  # name, then reference_engine.py flags
  local name=$1; shift
  echo "=== $name: $*"
  timeout "${EPS_RUN_TIMEOUT:-240}" python3 "$carry/python/examples/reference_engine.py" \
    --epsd-target "unix://$sock" --json "$out/$name.json" "$@" ${EPS_ENGINE_ARGS:-} \
    >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "=== $name: exit $rc"
  [[ $rc -eq 0 ]] || status=1
  # a failed run may have left epsd dead: bring it back for the next
  kill -0 "$(cat "$pidfile")" 2>/dev/null || start_epsd
}
speed() {  # the speed runs named in $1 (b8-32k, b2-128k)
  local run
  for run in $1; do
    case $run in
      b8-32k) engine speed-b8-32k --mode speed --batch 8 --context 32768 --decode-steps 64 ;;
      b2-128k) engine speed-b2-128k --mode speed --batch 2 --context 131072 --decode-steps 64 ;;
      *) echo "EPS_ENGINE_SPEED: no run $run"; status=1 ;;
    esac
  done
}
quality() {  # the SmolLM2 quality and passkey runs (model staged)
  [[ -n $model ]] || { echo "no model staged: quality and passkey runs skipped"; return; }
  engine quality --mode quality --model gguf --gguf "$model" --batch 4 --context 8000 \
    --decode-steps 64 --top-pages "${EPS_ENGINE_TOP_PAGES:-4,8,12,16,24,32}" --methods "${EPS_ENGINE_METHODS:-quest,questclt,jl}"
  engine passkey --mode passkey --model gguf --gguf "$model" --context 8000 --passkeys 20 \
    --top-pages "${EPS_ENGINE_PASSKEY_TOP_PAGES:-8,16}" --methods "${EPS_ENGINE_METHODS:-quest,questclt,jl}"
}
status=0
if [[ ${EPS_ENGINE_PLAN:-full} == quality ]]; then
  [[ -n ${EPS_ENGINE_SPEED:-} ]] && speed "$EPS_ENGINE_SPEED"
  quality
  for f in "$out"/*.log; do
    case $f in */epsd.log|*/pip.log) continue;; esac
    awk '/^(speed|quality|passkey)[: -]/{p=1} p' "$f"
  done
  exit $status
fi
if [[ ${EPS_ENGINE_PLAN:-full} == speed ]]; then
  speed "${EPS_ENGINE_SPEED:-b8-32k b2-128k}"
  for f in "$out"/speed-*.log; do awk '/^(speed)[: -]/{p=1} p' "$f"; done
  exit $status
fi
# The client library's device tests first: outputs kernels, summary queue, watchdog, the
# counter protocol with every stream in one hardware queue, and the torch/kernel paths of
# eps_client.outputs against their numpy references.
for t in engine_outputs_test engine_capi_test one_queue_test; do
  "$carry/$t" --gtest_brief=1 >"$out/$t.log" 2>&1; rc=$?
  echo "$t: exit $rc ($(grep -cE '^\[       OK|^\[  PASSED' "$out/$t.log") ok lines)"; tail -n 3 "$out/$t.log"
  [[ $rc -eq 0 ]] || status=1
done
# PYTEST_DISABLE_PLUGIN_AUTOLOAD: the image's pytest plugins do not load into the carried pytest.
# test_torch_writer.py: every test (-k matches its module's name), which CI skips (no torch).
(cd "$carry/python/tests" && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -m pytest -q -p no:cacheprovider test_outputs.py test_torch_writer.py -k torch \
  >"$out/python-outputs.log" 2>&1); rc=$?
echo "python outputs and torch writer (torch, kernel): exit $rc: $(tail -n 1 "$out/python-outputs.log")"
[[ $rc -eq 0 ]] || status=1
if [[ ${EPS_ENGINE_QUICK:-0} == 1 ]]; then
  engine speed-quick --mode speed --batch 4 --context 8192 --decode-steps 24 --warmup-steps 4 \
    --fractions 0.25
  engine kill-quick --mode kill --model small-random --batch 4 --context 4096 \
    --decode-steps 400 --kill-at 10 --restart-at 20 --epsd-pid-file "$pidfile" \
    --epsd-cmd "$epsd_cmd"
else
  speed "${EPS_ENGINE_SPEED:-b8-32k b2-128k}"
  engine kill --mode kill --batch 8 --context 8192 --decode-steps 120 --kill-at 20 \
    --restart-at 40 --epsd-pid-file "$pidfile" --epsd-cmd "$epsd_cmd"
  quality
fi
# The engine loop and the kill -9 release with every stream of each process in ONE hardware
# queue: any wait queued before the work that satisfies it in the same process hangs here.
# Last: the kill run restarts epsd with the same setting.
CUDA_DEVICE_MAX_CONNECTIONS=1 engine speed-one-queue --mode speed --batch 2 --context 8192 \
  --decode-steps 24 --warmup-steps 4 --fractions 0.25
CUDA_DEVICE_MAX_CONNECTIONS=1 engine kill-one-queue --mode kill --model small-random --batch 4 \
  --context 4096 --decode-steps 200 --kill-at 10 --restart-at 20 --epsd-pid-file "$pidfile" \
  --epsd-cmd "$epsd_cmd"
echo
echo "################ tables"
for f in "$out"/*.log; do
  case $f in */epsd.log|*/pip.log) continue;; esac
  awk '/^(speed|kill|quality|passkey)[: -]/{p=1} p' "$f"
done
exit $status
