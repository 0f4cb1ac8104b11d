"""The feedback-memory table (plans.FEEDBACK_MEMORY_PLAN): `python -m eps_eval.report_fbmem
--out=DIR` reads DIR/units/q19_*.csv (`--units DIR...`: those of several runs' units
directories instead) and prints, per (workload, context), each row's gap to
the g = 1 mass oracle at 75 % of KV bytes skipped (summary bytes counted), paired over the
(layer, step) pairs, its gain over fbmem1 (the steady state of today's feedback; `--base=`
another row's name, or the start of it), and its summary bytes relative to quest fp16 at
g = 1 near that skip. The listcount plan's rows (eps_eval.list_count) are shown too."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from eps_eval.report_quality import (
    SKIP,
    Row,
    add_units_argument,
    at_skip,
    col,
    group,
    load,
    paired_gain,
    unit_dirs,
    where,
)

# Quest's fp16 record at g = 1 against a block's fp16 K and V: 4·d / (16 · 4·d) of dense.
QUEST16_G1_FRAC = 1.0 / 16.0


def _order(name: str) -> tuple[int, str]:
    for i, prefix in enumerate(("oracle_mass-union", "oracle_mass_lag", "oracle_maxlag",
                                "oracle_meanlag",
                                "c2f", "fb-", "fb2-", "fbmem0", "fbmem1-", "fbmem")):
        if name.startswith(prefix):
            return i, name
    return 99, name


def table(rows: list[Row], base_prefix: str = "fbmem1-c2f") -> list[str]:
    """base_prefix: the row (by the start of its name) the gain column is paired against."""
    out: list[str] = []
    for (wl, ctx), w in sorted(group(rows, ("workload", "context")).items()):
        oracle = where(w, lambda r: r["method"] == "oracle_mass" and r["lag"] == 0
                       and r["g"] == 1 and r["budget"] == "threshold")
        base = where(w, lambda r: str(r["method"]).startswith(base_prefix))
        best = where(w, lambda r: r["method"] == "oracle_mass-union")
        names = sorted({str(r["method"]) for r in w
                        if (r["lag"] == 1 or r["method"] == "oracle_mass-union") and (r["budget"] in ("c2f", "listcount") or str(r["method"]).startswith("oracle_"))},
                       key=_order)
        pairs = len(group(oracle, ("layer", "step")))
        out.append(f"\n### {wl}, context {int(ctx)}; pairs: {pairs}\n")  # type: ignore[call-overload]
        out.append(f"| row | gap to g = 1 oracle | gain over {base_prefix} | "
                   "bytes / quest fp16 g = 1 "
                   "| gap to the union oracle |")
        out.append("| --- | --- | --- | ---: | --- |")
        for name in names:
            if name.startswith(("miss-", "xmiss-")):
                continue
            sel = where(w, lambda r, n=name: r["method"] == n)  # type: ignore[misc]
            gap = paired_gain(oracle, sel)
            gain = paired_gain(sel, base) if base and not name.startswith(base_prefix) else None
            ugap = paired_gain(best, sel) if best else (np.nan, np.nan, 0)
            near = [r for r in sel if abs(float(r["skip"]) - SKIP) < 0.05]  # type: ignore[arg-type]
            frac = float(col(near, "summary_frac").mean()) / QUEST16_G1_FRAC if near else np.nan
            g = f"{gain[0]:+.4f} ± {gain[1]:.4f}" if gain else ""
            out.append(f"| {name} | {gap[0]:.4f} ± {gap[1]:.4f} | {g} | {frac:.2f} "
                       f"| {ugap[0]:.4f} ± {ugap[1]:.4f} |")
        misses = sorted({str(r["method"]) for r in w
                         if str(r["method"]).startswith(("miss-", "xmiss-"))})
        if misses:
            miss = at_skip(oracle)
            out.append(f"\nfbmem1's missed mass (1 − recall) at 75 % skipped, by what the step "
                       f"knew of the missed block; the oracle misses {1 - miss[0]:.4f}:\n")
            out.append("| part | missed mass |")
            out.append("| --- | --- |")
            for name in misses:
                mean, half, _ = at_skip(where(w, lambda r, n=name: r["method"] == n))  # type: ignore[misc]
                out.append(f"| {name} | {mean:.4f} ± {half:.4f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, help="the directory run_quality or run_gemma wrote "
                                               "(its units/q19_*.csv are read)")
    add_units_argument(ap)
    ap.add_argument("--base", default="fbmem1-c2f",
                    help="the row (start of its name) the gain column is paired against")
    a = ap.parse_args(argv)
    dirs = unit_dirs(ap, a.out, a.units)
    try:
        rows = load(dirs)
    except ValueError as e:
        ap.error(str(e))
    print("\n".join(table(rows, a.base)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
