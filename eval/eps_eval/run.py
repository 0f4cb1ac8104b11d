"""Runs the evaluation: `python -m eps_eval.run --out=DIR [--quick]`.

Work is cut into units (one synthetic layer at one context, one real-model
layer, the real model's quality runs); each finished unit writes its CSV/JSON
atomically under DIR/units, and a rerun skips the units already there.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from eps_eval import synthetic
from eps_eval.args import (
    check_context,
    output_dir,
    passkey_contexts,
    positive_int,
    same_settings,
)
from eps_eval.selection import LayerSequences, Plan, step_rows


@dataclass
class Settings:
    synthetic_contexts: tuple[int, ...]
    synthetic_steps: dict[int, int]
    real_context: int
    real_layers: tuple[int, ...]
    real_steps: int
    ppl_positions: int
    passkey_prompts: int
    passkey_context: int
    plan: Plan = field(default_factory=Plan)
    seed: int = 20261122
    context_plans: dict[int, Plan] = field(default_factory=dict)  # overrides `plan` per context

    def plan_for(self, context: int) -> Plan:
        return self.context_plans.get(context, self.plan)


QUICK = Settings(
    synthetic_contexts=(8192,),
    synthetic_steps={8192: 2},
    real_context=512,
    real_layers=(2, 15, 28),
    real_steps=2,
    ppl_positions=6,
    passkey_prompts=1,
    passkey_context=384,
    plan=Plan(group_blocks=(1, 8), jl_dims=(4, 8, 32), fractions=(0.02, 0.05, 0.1, 0.2, 0.4)),
)
# Sized for the shared 2-vCPU developer machine (each process got ~10-15 % of a
# core under the load of the other agents): see docs/eval/README.md.
FULL = Settings(
    synthetic_contexts=(8192, 32768, 131072),
    synthetic_steps={8192: 6, 32768: 3, 131072: 1},
    real_context=2048,
    real_layers=(0, 5, 10, 15, 20, 25, 29),
    real_steps=3,
    ppl_positions=40,
    passkey_prompts=5,
    passkey_context=1024,
    context_plans={131072: Plan(group_blocks=(1, 8, 16), jl_dims=(4, 8, 32))},
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_unit(units: Path, name: str, rows: list[dict[str, object]], meta: dict[str, object]) -> None:
    units.mkdir(parents=True, exist_ok=True)
    tmp = units / f".{name}.tmp"
    with tmp.open("w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    (units / f"{name}.json").write_text(json.dumps(meta, indent=1, default=str))
    tmp.rename(units / f"{name}.csv")  # the CSV lands last: its presence marks the unit done


def unit_done(units: Path, name: str) -> bool:
    return (units / f"{name}.csv").exists()


def run_synthetic(s: Settings, units: Path) -> None:
    for ctx in s.synthetic_contexts:
        steps = s.synthetic_steps[ctx]
        positions = [ctx - steps + i for i in range(steps)]
        max_lag = max(s.plan_for(ctx).lags)
        q_positions = sorted({p - lag for p in positions for lag in range(max_lag + 1)})
        for li, kind in enumerate(synthetic.KINDS):
            name = f"synthetic_{ctx}_L{li}"
            if unit_done(units, name):
                log(f"{name}: done before, skipped")
                continue
            seed = s.seed + 1000 * li + ctx
            t0 = time.time()
            tr = synthetic.make_layer(kind, ctx, q_positions, seed=seed)
            seqs = LayerSequences(s.plan_for(ctx), 8, 2, 128, ctx)
            rows: list[dict[str, object]] = []
            for si, p in enumerate(positions):
                for r in step_rows(seqs, tr.k, tr.v, tr.q, p):
                    rows.append({"workload": "synthetic", "kind": kind, "context": ctx,
                                 "layer": li, "step": si, **r})
            write_unit(units, name, rows, {"kind": kind, "seed": seed, "context": ctx,
                                           "positions": positions, "info": tr.info,
                                           "seconds": time.time() - t0})
            log(f"{name} ({kind}, seed {seed}): {len(rows)} rows in {time.time() - t0:.0f} s")


def run_real(s: Settings, units: Path, cache: Path) -> None:
    from eps_eval import realmodel

    todo_layers = [l for l in s.real_layers if not unit_done(units, f"real_{s.real_context}_L{l}")]
    quality_done = unit_done(units, f"real_{s.real_context}_quality")
    passkey_done = unit_done(units, f"real_passkey_{s.passkey_context}")
    if not todo_layers and quality_done and passkey_done:
        log("real model: done before, skipped")
        return
    rm = realmodel.RealModel(cache)
    if todo_layers or not quality_done:
        plan = s.plan_for(s.real_context)
        trace, info = rm.passage_trace(s.real_context, s.real_steps, s.ppl_positions, max(plan.lags))
        log(f"real model prefill of {s.real_context} tokens: {info}")
        for layer in todo_layers:
            t0 = time.time()
            rows = rm.selection_rows(trace, layer, plan, s.real_context, s.real_steps)
            write_unit(units, f"real_{s.real_context}_L{layer}", rows,
                       {"layer": layer, **info, "seconds": time.time() - t0})
            log(f"real layer {layer}: {len(rows)} rows in {time.time() - t0:.0f} s")
        if not quality_done:
            t0 = time.time()
            rows, meta = rm.quality_rows(trace, s.real_context, s.ppl_positions)
            write_unit(units, f"real_{s.real_context}_quality", rows, {**info, **meta,
                                                                       "seconds": time.time() - t0})
            log(f"real quality: {len(rows)} rows in {time.time() - t0:.0f} s")
    if not passkey_done:
        t0 = time.time()
        rows, meta = rm.passkey_rows(s.passkey_prompts, s.passkey_context, s.seed)
        write_unit(units, f"real_passkey_{s.passkey_context}", rows,
                   {**meta, "seconds": time.time() - t0})
        log(f"passkey: {len(rows)} rows in {time.time() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=output_dir)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("synthetic", "real", "report"), default=None)
    ap.add_argument("--cache", type=Path, default=None, help="model cache (default $EPS_EVAL_CACHE, else OUT/../.eval-cache)")
    ap.add_argument("--real-context", type=positive_int, default=None,
                    help="the real model's passage length (default: the mode's)")
    ap.add_argument("--passkey-context", type=positive_int, default=None,
                    help="the passkey prompts' length (default: the mode's)")
    ap.add_argument("--no-report", action="store_true",
                    help="write the units only (e.g. on a machine without matplotlib)")
    a = ap.parse_args(argv)
    s = QUICK if a.quick else FULL
    if a.real_context is not None:
        s = replace(s, real_context=a.real_context)
    if a.passkey_context is not None:
        passkey_contexts(ap, "--passkey-context", [a.passkey_context])
        s = replace(s, passkey_context=a.passkey_context)
    if a.only in (None, "real"):
        # passage_trace's query positions: the selection steps with their lags, and the
        # teacher-forced positions with the two before them (checked before the model loads)
        for steps, history in ((s.real_steps, max(s.plan_for(s.real_context).lags)),
                               (s.ppl_positions, 2)):
            check_context(ap, "--real-context", s.real_context, steps, history)
    out: Path = a.out
    units = out / "units"
    cache = a.cache or Path(os.environ.get("EPS_EVAL_CACHE", out.parent / ".eval-cache"))
    t0 = time.time()
    load0 = os.getloadavg()
    # Units are resumed by name (context, layer), which does not hold the settings: a
    # directory whose units were made with other settings would mix the two runs.
    mode = "quick" if a.quick else "full"
    if a.only == "report":
        if not any(units.glob("*.csv")):
            ap.error(f"{units} holds no units to report on")
    else:
        same_settings(ap, out, {"mode": mode, "settings": asdict(s)},
                      {"machine": platform.platform(), "cpus": os.cpu_count(),
                       "loadavg_start": load0, "python": sys.version.split()[0],
                       "numpy": np.__version__})
    if a.only in (None, "synthetic"):
        run_synthetic(s, units)
    if a.only in (None, "real"):
        run_real(s, units, cache)
    if a.no_report:
        log(f"done in {time.time() - t0:.0f} s; units in {units}")
        return 0
    from eps_eval import report

    # A report-only call did not run the units: no wall time or start load of its own.
    report_only = a.only == "report"
    report.write(out, t0=None if report_only else t0, load0=None if report_only else load0)
    log(f"done in {time.time() - t0:.0f} s; summary: {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
