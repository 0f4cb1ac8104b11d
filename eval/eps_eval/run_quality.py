"""Issue 19's evaluation: `python -m eps_eval.run_quality --out=DIR [--synthetic=8192,...]
[--real-context=N --real-layers=0,5,...] [--real-steps=N] [--plan=NAME of plans.PLANS]`.

Same unit files as eps_eval.run (one CSV + JSON per synthetic layer or real layer,
skipped when present); the rows come from eps_eval.quality.step_rows. The report
is eps_eval.report_quality.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import time
from pathlib import Path

import numpy as np

from eps_eval import synthetic
from eps_eval.args import (
    check_context,
    index_list,
    int_list,
    non_negative_int,
    output_dir,
    positive_int,
    same_settings,
)
from eps_eval.plans import PLANS, QualityPlan, query_history
from eps_eval.quality import QUEST8_SCALES, LayerState, step_rows
from eps_eval.run import log, unit_done, write_unit

SEED = 20261122
REAL_LAYERS = 30  # SmolLM2-135M's


def run_synthetic(ctx: int, steps: int, plan: QualityPlan, units: Path) -> None:
    positions = [ctx - steps + i for i in range(steps)]
    max_lag = query_history(plan)
    q_positions = sorted({p - lag for p in positions for lag in range(max_lag + 1)})
    for li, kind in enumerate(synthetic.KINDS):
        name = f"q19_synthetic_{ctx}_L{li}"
        if unit_done(units, name):
            log(f"{name}: done before, skipped")
            continue
        seed = SEED + 1000 * li + ctx
        t0 = time.time()
        tr = synthetic.make_layer(kind, ctx, q_positions, seed=seed)
        state = LayerState(plan, 8, 2, 128, ctx)
        rows: list[dict[str, object]] = []
        for si, p in enumerate(positions):
            rows += step_rows(state, tr.k, tr.v, tr.q, p,
                              {"workload": "synthetic", "kind": kind, "context": ctx,
                               "layer": li, "step": si})
        write_unit(units, name, rows, {"kind": kind, "seed": seed, "context": ctx,
                                       "positions": positions, "seconds": time.time() - t0})
        log(f"{name}: {len(rows)} rows in {time.time() - t0:.0f} s")


def rotate_one_position(q: np.ndarray, base: float) -> np.ndarray:
    """SmolLM2's query [H, d] after RoPE, moved on one position."""
    from eps_eval.model import apply_rope

    return apply_rope(q[None], np.ones(1, dtype=np.int64), base)[0]


def run_real(ctx: int, layers: list[int], steps: int, plan: QualityPlan, units: Path,
             cache: Path) -> None:
    from eps_eval import realmodel

    todo = [layer for layer in layers if not unit_done(units, f"q19_real_{ctx}_L{layer}")]
    if not todo:
        log("real model: done before, skipped")
        return
    rm = realmodel.RealModel(cache)
    tr, info = rm.passage_trace(ctx, steps, 1, query_history(plan))
    log(f"real model prefill of {ctx} tokens: {info}")
    c = rm.cfg
    for layer in todo:
        t0 = time.time()
        state = LayerState(plan, c.heads, c.kv_heads, c.head_dim, ctx,
                           rotate_lag=functools.partial(rotate_one_position, base=c.rope_base))
        q = {p: tr.q[p][layer] for p in tr.q}
        rows: list[dict[str, object]] = []
        for si, p in enumerate(range(ctx - steps, ctx)):
            rows += step_rows(state, tr.k[layer], tr.v[layer], q, p,
                              {"workload": "real", "kind": "smollm2", "context": ctx,
                               "layer": layer, "step": si})
        write_unit(units, f"q19_real_{ctx}_L{layer}", rows,
                   {"layer": layer, **info, "seconds": time.time() - t0})
        log(f"real layer {layer}: {len(rows)} rows in {time.time() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=output_dir)
    ap.add_argument("--synthetic", type=int_list, default=[], help="comma-separated contexts")
    ap.add_argument("--synthetic-steps", type=positive_int, default=2)
    ap.add_argument("--real-context", type=non_negative_int, default=0, help="0: none")
    ap.add_argument("--real-layers", type=index_list, default=[0, 5, 10, 15, 20, 25, 29])
    ap.add_argument("--real-steps", type=positive_int, default=3)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--plan", choices=tuple(PLANS), default="full",
                    help="estimators: plans.ESTIMATOR_PLAN (lag 1, quest, quest8, estimators); "
                         "mass: plans.MASS_PLAN (the mass budget, quest and questclt); "
                         "massunion: plans.MASS_UNION_PLAN (mass plus the list-level mass "
                         "budget and the exact lag-1 mass); c2f: plans.C2F_PLAN (coarse-to-"
                         "fine swept); meancentre: plans.MEAN_PLAN (questclt centred on the "
                         "mean key); reuse: plans.REUSE_PLAN (questclt and quest8 at lags "
                         "1-4, report_quality's reuse table); the others: eps_eval.plans")
    ap.add_argument("--quest8-scale", choices=QUEST8_SCALES, default="fp32",
                    help="quest8's scale per group: fp32 (max |k| / 127) or pow2 (rounded up to "
                         "a power of two, as a writer that sees keys one at a time would keep it)")
    a = ap.parse_args(argv)
    units = a.out / "units"
    cache = a.cache or Path(os.environ.get("EPS_EVAL_CACHE", a.out.parent / ".eval-cache"))
    plan = dataclasses.replace(PLANS[a.plan], quest8_scale=a.quest8_scale)
    t0 = time.time()
    if a.real_context and (bad := [layer for layer in a.real_layers if layer >= REAL_LAYERS]):
        ap.error(f"--real-layers: SmolLM2 has layers 0-{REAL_LAYERS - 1}, not {bad}")
    for ctx in a.synthetic:
        check_context(ap, "--synthetic", ctx, a.synthetic_steps, query_history(plan),
                      synthetic.FIRST_QUERY)
    if a.real_context:
        # passage_trace's window of 1 needs the 3 last positions' queries as well
        for steps, history in ((a.real_steps, query_history(plan)), (1, 2)):
            check_context(ap, "--real-context", a.real_context, steps, history)
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "cache")}
    same_settings(ap, a.out, {"args": settings, "plan": plan.__dict__},
                  {"machine": platform.platform(), "cpus": os.cpu_count(),
                   "loadavg_start": os.getloadavg(), "numpy": np.__version__,
                   "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t0))})
    for ctx in a.synthetic:
        run_synthetic(ctx, a.synthetic_steps, plan, units)
    if a.real_context:
        run_real(a.real_context, a.real_layers, a.real_steps, plan, units, cache)
    log(f"done in {time.time() - t0:.0f} s, load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
