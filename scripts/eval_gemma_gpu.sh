#!/usr/bin/env bash
# On the lent GPU machine: Gemma 3 270M at 16k and 32k for issue 19 (selection rows of the
# global layers, passkeys, forward checks and the torch-against-numpy check), from the
# carry folders that scripts/eval_gemma_stage.sh packs. Every call runs this same command;
# what it does follows from what the call carries:
#   .carry-gemma-K/     its GGUF piece is checked (sha256) and copied to /tmp/eps-gemma/stage
#   .carry-gemma/       once every piece of its MANIFEST is staged: join, gunzip, check the
#                       GGUF's sha256 (eps_eval.gemma.SHA256), run eps_eval.run_gemma on
#                       cuda, and pack the results into $OUT/gemma-q19.tar.gz
#   .carry-gemma-units/ (optional) gemma-q19.tar.gz of an earlier run: its finished units
#                       are unpacked first and skipped
# Units are written atomically; a rerun on the same warm machine skips the finished ones.
# Settings: EPS_GEMMA_CONTEXTS (16384,32768), EPS_GEMMA_ROW_CONTEXTS (the contexts of the
# selection rows; default EPS_GEMMA_CONTEXTS, 0 for passkeys only), EPS_GEMMA_PASSKEYS (20), EPS_GEMMA_STEPS (3),
# EPS_GEMMA_WORKERS (6), EPS_GEMMA_TIMEOUT (480 s for run_gemma, inside the call's 600),
# EPS_GEMMA_DEVICE (cuda; cpu tries the script on a machine without a GPU), EPS_GEMMA_VARIANTS
# (the gated passkey variants, METHOD:G,...; default run_gemma.VARIANTS).
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.." || exit 1
units_in() { local f=("$1"/*.csv); echo "${#f[@]}"; }
work=/tmp/eps-gemma
stage=$work/stage
mkdir -p "$stage"
out=${OUT:-$work/results}
mkdir -p "$out"

for d in .carry-gemma-[0-9]*; do
  [[ -d $d ]] || continue
  (cd "$d" && grep -F "$(ls gemma.gguf.gz.*)" MANIFEST | sha256sum -c --quiet -) ||
    { echo "$d: piece damaged in transit"; exit 1; }
  cp "$d"/gemma.gguf.gz.* "$d"/MANIFEST "$stage/"
done
pieces=("$stage"/gemma.gguf.gz.*)
have=${#pieces[@]}
want=$(cat "$stage"/MANIFEST .carry-gemma/MANIFEST 2>/dev/null | sort -u | wc -l)
echo "staged pieces: $have of $want in $stage"
[[ -d .carry-gemma ]] || exit 0

carry=$(cd .carry-gemma && pwd)
(cd "$stage" && sha256sum -c --quiet "$carry/MANIFEST") ||
  { echo "pieces missing or damaged: was the machine given back between calls?"; exit 1; }
export PYTHONPATH="$PWD/eval:$work/site" PYTHONUNBUFFERED=1
export EPS_EVAL_LIB=$carry/libeps_eval.so EPS_EVAL_LICENCES=$carry/licences
export LD_LIBRARY_PATH="$carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$work/site" "$carry"/wheels/*.whl || exit 1
cache=$work/cache
gguf=$cache/gemma-3-270m-q4_k_m.gguf
want_sha=$(python3 -c 'from eps_eval.gemma import SHA256; print(SHA256)') || exit 1
if [[ ! -f $gguf ]]; then
  mkdir -p "$cache"
  gzip -dc < <(cat "${pieces[@]}") > "$gguf.tmp" || exit 1  # split's names sort in order
  mv "$gguf.tmp" "$gguf"
fi
echo "$want_sha  $gguf" | sha256sum -c - || { rm -f "$gguf"; exit 1; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc
  python3 -c 'import importlib.metadata, sys, numpy, torch
print(sys.version.split()[0], "numpy", numpy.__version__, "torch", torch.__version__,
      "gguf", importlib.metadata.version("gguf"), torch.cuda.is_available() and torch.cuda.get_device_name())'
} 2>&1 | tee "$out/env.txt"

res=$work/out
if [[ -f .carry-gemma-units/gemma-q19.tar.gz && ! -d $res ]]; then
  mkdir -p "$res" && tar -xzf .carry-gemma-units/gemma-q19.tar.gz -C "$res"
  echo "resumed: $(units_in "$res/units") units from the carried results"
fi
contexts=${EPS_GEMMA_CONTEXTS:-16384,32768}
(cd eval && timeout -k 10 "${EPS_GEMMA_TIMEOUT:-480}" python3 -m eps_eval.run_gemma \
  --out="$res" --cache="$cache" --device="${EPS_GEMMA_DEVICE:-cuda}" --compare-tokens=600 \
  --context="${EPS_GEMMA_ROW_CONTEXTS:-$contexts}" --steps="${EPS_GEMMA_STEPS:-3}" \
  --passkeys="${EPS_GEMMA_PASSKEYS:-20}" --passkey-context="$contexts" \
  --workers="${EPS_GEMMA_WORKERS:-6}" --variants="${EPS_GEMMA_VARIANTS:-}") 2>&1 | tee "$out/run.log"
rc=${PIPESTATUS[0]}
tar -czf "$out/gemma-q19.tar.gz" -C "$res" .
echo "run_gemma exit $rc; $(units_in "$res/units") units in $out/gemma-q19.tar.gz"
# The passkey tally per context and variant (the full tables: eps_eval.report_quality).
python3 - "$res/units" <<'PY'
import csv, collections, pathlib, re, sys
tally = collections.defaultdict(lambda: [0, 0])
for f in pathlib.Path(sys.argv[1]).glob("q19gemma_passkey_*_p*.csv"):
    ctx = re.search(r"passkey_(\d+)_p", f.name).group(1)
    for r in csv.DictReader(f.open()):
        t = tally[(int(ctx), r["method"], r["g"])]
        t[0] += int(r["correct"]); t[1] += 1
for (ctx, m, g), (ok, n) in sorted(tally.items()):
    print(f"passkey {ctx} {m} g={g}: {ok}/{n}")
PY
exit "$rc"
