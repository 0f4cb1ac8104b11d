#!/usr/bin/env bash
# A fault soak: eps-load runs against a CPU-backend epsd (one unary and one
# stream process) while this script kills epsd with SIGKILL every KILL_EVERY
# and starts a new one on the same socket. It checks that the sessions
# re-attach after every restart and that nothing leaks:
#   - every eps-load process had steps selected by the last epsd it lived a whole
#     KILL_EVERY beside (that epsd's step log, --step-log=OUT_DIR/epsd-K.jsonl, has OK
#     lines of the process's transport), and re-attached at least once per session per
#     restart it saw;
#   - eps-load's open fds grow by at most 8, and its RSS by at most half or 32 MiB
#     (whichever is more), from the first restart to the end: abandoned calls, streams
#     and channels are released, and a leak grows with every restart;
#   - no epsd maps more shm objects than there are sessions (sampled before each kill), and
#     /dev/shm holds no object of the eps-load processes once they have exited.
#
#   load/fault_soak.sh OUT_DIR   (DURATION=60s KILL_EVERY=5 RATE=50 SESSIONS=2)
#
# EPSD and EPS_LOAD name the binaries. Exit status 0 when every check holds.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: load/fault_soak.sh OUT_DIR}
EPSD=${EPSD:-build/service/epsd}
EPS_LOAD=${EPS_LOAD:-build/load/eps-load}
DURATION=${DURATION:-60s}
KILL_EVERY=${KILL_EVERY:-5}
RATE=${RATE:-50}
SESSIONS=${SESSIONS:-2}
mkdir -p "$OUT"
source load/epsd_ctl.sh
SOCKET="unix:///tmp/eps-fault-soak-$$.sock"
loads=()
cleanup() {
  local p
  for p in "${loads[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  epsd_stop
}
trap cleanup EXIT

# Shm objects of the eps-load processes (their names carry the creator's pid).
shm_objects() {
  local p n=0
  for p in "${loads[@]}"; do n=$((n + $(find /dev/shm -maxdepth 1 -name "eps-*-$p-*" | wc -l))); done
  echo "$n"
}
fds() { ls "/proc/$1/fd" 2>/dev/null | wc -l; }
rss_kb() { sed -n 's/^VmRSS:[[:space:]]*\([0-9]*\).*/\1/p' "/proc/$1/status" 2>/dev/null; }

epsd_start "$SOCKET" --backend=cpu --lease-ms=2000 --step-log="$OUT/epsd-0.jsonl"
echo "fault soak: epsd pid $EPSD_PID on $EPSD_TARGET for $DURATION, SIGKILL every ${KILL_EVERY}s"
COMMON=(--target="$EPSD_TARGET" --preset=smollm2-135m --batch=1 --context=uniform:512-4k
        --rate=poisson:"$RATE" --sessions="$SESSIONS" --duration="$DURATION" --warmup=1s)
"$EPS_LOAD" "${COMMON[@]}" --mode=unary --seed=1 --json="$OUT/fault-unary.json" \
  >"$OUT/fault-unary.txt" 2>&1 &
loads+=($!)
"$EPS_LOAD" "${COMMON[@]}" --mode=stream --seed=2 --json="$OUT/fault-stream.json" \
  >"$OUT/fault-stream.txt" 2>&1 &
loads+=($!)

kills=0
declare -A first_fds first_rss last_fds last_rss served_by
running() { local p; for p in "${loads[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
sleep "$KILL_EVERY"
max_maps=0
while running; do
  # The shm objects this epsd maps, just before it dies: one per live session at most.
  maps=$(grep -c '/dev/shm/eps-' "/proc/$EPSD_PID/maps" 2>/dev/null || true)
  ((maps > max_maps)) && max_maps=$maps
  kill -KILL "$EPSD_PID"
  wait "$EPSD_PID" 2>/dev/null || true
  kills=$((kills + 1))
  rm -f "$EPSD_LOG"
  epsd_start "$SOCKET" --backend=cpu --lease-ms=2000 --step-log="$OUT/epsd-$kills.jsonl"
  if ((kills == 1)); then
    for p in "${loads[@]}"; do first_fds[$p]=$(fds "$p"); first_rss[$p]=$(rss_kb "$p"); done
  fi
  for p in "${loads[@]}"; do
    echo "kill $kills: eps-load $p fds $(fds "$p") rss $(rss_kb "$p") kB" >>"$OUT/fault-samples.txt"
  done
  sleep "$KILL_EVERY"
  if running; then
    for p in "${loads[@]}"; do last_fds[$p]=$(fds "$p"); last_rss[$p]=$(rss_kb "$p"); done
  fi
  # A process still running now lived this whole interval beside the epsd of restart $kills.
  for p in "${loads[@]}"; do kill -0 "$p" 2>/dev/null && served_by[$p]=$kills; done
done

status=0
for p in "${loads[@]}"; do wait "$p" || true; done
shm_maps=$max_maps
shm_after=$(shm_objects)
echo "fault soak: $kills kills; an epsd mapped at most $shm_maps shm objects for $((2 * SESSIONS)) sessions;" \
     "eps-load's shm objects left in /dev/shm: $shm_after"
cat "$OUT/fault-samples.txt"
python3 - "$OUT" "$kills" "$SESSIONS" "${served_by[${loads[0]}]:-}" "${served_by[${loads[1]}]:-}" <<'PY' || status=1
import json, sys
out, kills, sessions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
served = {"unary": sys.argv[4], "stream": sys.argv[5]}  # restart index of the last epsd
ok = True
for mode in ("unary", "stream"):
    if served[mode] and int(served[mode]) > 0:
        log = f"{out}/epsd-{served[mode]}.jsonl"
        selected = 0
        with open(log) as lines:
            for text in lines:
                try:
                    step = json.loads(text)
                except ValueError:  # the line SIGKILL cut
                    continue
                selected += step.get("transport") == mode and step.get("status") == "OK"
        print(f"{mode}: {selected} steps selected by the epsd of restart {served[mode]} ({log})")
        if selected == 0:
            print(f"  FAIL: no {mode} step selected after restart {served[mode]}")
            ok = False
    else:
        print(f"  FAIL: the {mode} process lived no whole interval after a restart")
        ok = False
    r = json.load(open(f"{out}/fault-{mode}.json"))
    f = r["client_fallbacks"]
    line = (f"{mode}: steps {f['steps']} selected {f['selected']} reattaches {f['reattaches']} "
            f"fallbacks deadline {f['deadline']} unavailable {f['unavailable']} "
            f"not_attached {f['not_attached']} error {f['error']}")
    print(line)
    # Each session re-attaches after each restart it lived through (the last may end the run).
    if f["reattaches"] < (kills - 1) * sessions:
        print(f"  FAIL: {f['reattaches']} re-attaches for {kills} restarts x {sessions} sessions")
        ok = False
    if f["selected"] == 0:
        print("  FAIL: no step was selected")
        ok = False
sys.exit(0 if ok else 1)
PY
for p in "${loads[@]}"; do
  # fds may move by a few (a connection being re-made); a leak grows with every restart.
  if [[ -n ${last_fds[$p]:-} ]] && ((last_fds[$p] > first_fds[$p] + 8)); then
    echo "FAIL: eps-load $p held ${first_fds[$p]} fds after the first restart, ${last_fds[$p]} at the end"
    status=1
  fi
  if [[ -n ${last_rss[$p]:-} && -n ${first_rss[$p]:-} ]]; then
    margin=$((first_rss[$p] / 2 > 32768 ? first_rss[$p] / 2 : 32768))
    if ((last_rss[$p] > first_rss[$p] + margin)); then
      echo "FAIL: eps-load $p RSS grew from ${first_rss[$p]} kB after the first restart to ${last_rss[$p]} kB (margin $margin kB)"
      status=1
    fi
  fi
  echo "eps-load $p: fds ${first_fds[$p]:-?} -> ${last_fds[$p]:-?}, rss ${first_rss[$p]:-?} -> ${last_rss[$p]:-?} kB"
done
if ((shm_maps > 2 * SESSIONS)); then
  echo "FAIL: an epsd mapped $shm_maps shm objects for $((2 * SESSIONS)) sessions"; status=1
fi
if ((shm_after > 0)); then
  echo "FAIL: /dev/shm holds $shm_after objects of the exited eps-load processes"; status=1
fi
exit "$status"
