#!/usr/bin/env python3
"""Reference engine: decode from a paged KV cache with attention gated by epsd, next to a
dense run of the same loop and kernel (docs/benchmarks/reference-engine.md).

Modes:
  speed    random-weight Llama-3-8B shape: decode-step p50/p95 and mean dense vs gated at
           target fractions of blocks read (and --reuse lengths), the breakdown, the
           attention limit, SDPA's dense time
  quality  a real model (GGUF, e.g. SmolLM2-135M) teacher-forced on real text: Δ NLL and
           top-1 agreement against dense per method and budget; method=off must equal dense
  passkey  the real model: pass-key retrieval, dense vs gated, greedy
  kill     a gated run during which epsd is killed (-9) and restarted: the engine continues
           densely, re-attaches, finishes; every dense step has a counted reason

    python3 reference_engine.py --mode speed --batch 8 --context 32768 --fractions 0.5,0.25
    python3 reference_engine.py --mode quality --gguf SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["speed", "quality", "passkey", "kill"], required=True)
    ap.add_argument("--model", choices=["llama3-8b-random", "small-random", "gguf"],
                    default="llama3-8b-random")
    ap.add_argument("--gguf", help="the GGUF file (--model gguf)")
    ap.add_argument("--epsd-target", default="unix:///tmp/epsd.sock")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--fractions", default="0.5,0.25,0.125",
                    help="speed/kill: target fractions of blocks read")
    ap.add_argument("--methods", default="quest,jl", help="quality/passkey")
    ap.add_argument("--top-pages", default="4,8,16,32,64", help="quality/passkey budgets")
    ap.add_argument("--first-n", type=int, default=1, help="SelectOptions.first_n: leading "
                    "groups every list visits")
    ap.add_argument("--last-n", type=int, default=2, help="SelectOptions.last_n: trailing "
                    "groups every list visits")
    ap.add_argument("--group-blocks", type=int, default=8,
                    help="g (8: the history pages' layout; epsd's default and the README's "
                         "headline runs use 2: EPS_ENGINE_ARGS='--group-blocks 2' with "
                         "scripts/engine_gpu.sh)")
    ap.add_argument("--sketch-dim", type=int, default=8)
    ap.add_argument("--coarse-blocks", type=int, default=0,
                    help="a coarse level of N blocks per coarse group "
                         "(0: none; docs/policy-selection.md)")
    ap.add_argument("--coarse-candidates", type=float, default=2.0,
                    help="SelectOptions.coarse_candidates with a coarse level")
    ap.add_argument("--feedback", action="store_true",
                    help="selection feedback: the gated attention writes each visited group's "
                         "log-sum-exp, which epsd's next selection reads "
                         "(docs/policy-selection.md)")
    ap.add_argument("--list-budget", action="store_true",
                    help="the list-level rule: budget mass over the list at temperature 1 with "
                         "floor = ceiling = each budget value (groups per list, not per head)")
    ap.add_argument("--mass-layers", default=None,
                    help="FILE:KEY: the adaptive budget with per-layer settings from "
                         "eps_eval.layer_calibration --emit, KEY e.g. fbm-questclt_g=8 ('_' "
                         "for a space); each budget value then runs the same")
    ap.add_argument("--quest8", action="store_true",
                    help="records also hold the quest8 part, which questclt then reads")
    ap.add_argument("--quest8-only", action="store_true",
                    help="records hold the quest8 part and no key_sum or binary16 quest part "
                         "(432 bytes at d = 128 instead of 1,184; method=quest is then refused)")
    ap.add_argument("--reuse", default="1", type=reuses,
                    help="selections reused for k steps, a comma list (each gated row runs "
                         "once per k): one SelectPages every k decode steps, the steps "
                         "between read the same lists extended by their new blocks "
                         "(docs/api.md, \"Reusing a selection\")")
    ap.add_argument("--passkeys", type=int, default=20)
    ap.add_argument("--deadline-ms", type=float, default=50.0,
                    help="ClientOptions.deadline_s of each SelectPages, in ms")
    ap.add_argument("--watchdog-ms", type=float, default=200.0,
                    help="the selection watchdog's timeout: an accepted async step whose "
                         "lists have not come by then is released densely, in ms")
    ap.add_argument("--no-graphs", action="store_true", help="eager steps (no CUDA graphs)")
    ap.add_argument("--kill-at", type=int, default=20, help="kill: step at which epsd dies")
    ap.add_argument("--restart-at", type=int, default=40, help="kill: step of its restart")
    ap.add_argument("--epsd-pid-file", help="kill: epsd's pid (rewritten on restart)")
    ap.add_argument("--epsd-cmd", help="kill: the command that starts epsd again")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    return ap


def fractions(text: str) -> list[float]:
    out = [float(v) for v in text.split(",") if v]
    for f in out:
        if not 0.0 < f <= 1.0:
            raise SystemExit(f"--fractions: {f} not in (0, 1]")
    return out


def reuses(text: str) -> list[int]:
    """--reuse's comma list of counts >= 1 (a usage error, exit 2, otherwise)."""
    try:
        out = [int(v) for v in text.split(",") if v]
    except ValueError:
        out = []
    from eps_client.outputs import REUSE_WINDOW_BLOCKS

    # the views' reuse window at the engine's 16-token blocks (engine_loop.PagedEngine.decode)
    longest = (REUSE_WINDOW_BLOCKS - 1) * 16 + 1
    if not out or any(not 1 <= k <= longest for k in out):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of counts in [1, {longest}]")
    return out


def main() -> int:
    args = build_parser().parse_args()
    if args.mode in ("quality", "passkey") and args.model != "gguf":
        raise SystemExit(f"--mode {args.mode} needs --model gguf --gguf FILE (real weights)")
    if args.model == "gguf" and not args.gguf:
        raise SystemExit("--model gguf needs --gguf FILE")
    if args.feedback and "EPS_ATTN_VARIANT" not in os.environ:
        # Feedback is written by the kernel's tensor-core unit alone (paged_attention.h):
        # the dense run takes the same unit, so that dense and gated differ only in their
        # lists (at 8 x 32k the library picks it anyway; at SmolLM2's shape it would not).
        os.environ["EPS_ATTN_VARIANT"] = "warp_mma"
        print("--feedback: EPS_ATTN_VARIANT=warp_mma for dense and gated runs", flush=True)
    # Before CUDA starts: the watchdog's release runs on a second stream, which can sit in
    # the hardware queue behind the very wait it should end; more queues, fewer streams a
    # queue (docs/design.md §6, as epsd does). A value already set (a one-queue run) stays.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    import engine_runs  # torch from here on

    result = engine_runs.run(args)
    print(result.pop("table"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0 if result.get("ok", True) else 1


def restart_epsd(args: argparse.Namespace) -> float:
    """kill mode: starts epsd again with --epsd-cmd, records its pid, and waits until it
    accepts connections (as an operator's restart would be done before the engine's next
    step). Returns the seconds that took."""
    import grpc

    start = time.monotonic()
    proc = subprocess.Popen(args.epsd_cmd, shell=True, start_new_session=True)
    if args.epsd_pid_file:
        Path(args.epsd_pid_file).write_text(str(proc.pid))
    with grpc.insecure_channel(args.epsd_target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
    return time.monotonic() - start


def kill_epsd(args: argparse.Namespace) -> int:
    """kill mode: SIGKILL to the process in --epsd-pid-file and every process under it.
    Under EPS_EPSD_PREFIX (scripts/engine_gpu.sh) that pid is the wrapper (e.g. ncu) and
    epsd its child, which killing the wrapper alone would leave serving. Returns epsd's pid
    (the process of that tree named epsd, else the pid in the file)."""
    pid = int(Path(args.epsd_pid_file).read_text().strip())
    tree = process_tree(pid, _parent_pids())
    for p in reversed(tree):  # children first: epsd dies before its wrapper could react
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:  # exited meanwhile
            pass
    return next((p for p in tree if _command_name(p) == "epsd"), pid)


def process_tree(root: int, parents: dict[int, int]) -> list[int]:
    """``root`` and its descendants, parents before children, from {pid: parent pid}."""
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    tree = [root]
    for p in tree:  # grows while it is walked: breadth first
        tree += sorted(children.get(p, []))
    return tree


def _parent_pids() -> dict[int, int]:
    """{pid: parent pid} of every process in /proc (Linux)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2:].split()[1])
    return parents


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


if __name__ == "__main__":
    sys.exit(main())
