"""The feedback-memory table (plans.FEEDBACK_MEMORY_PLAN): `python -m eps_eval.report_fbmem
--out=DIR` reads DIR/units/q19_*.csv (`--units DIR...`: those of several runs' units
directories instead) and prints, per (workload, context), each row's gap to
the g = 1 mass oracle at 75 % of KV bytes skipped (summary bytes counted), paired over the
(layer, step) pairs, its gain over fbmem1 (the steady state of today's feedback; `--base=`
another row's name, or the start of it), and its summary bytes relative to quest fp16 at
g = 1 near that skip. The listcount plan's rows (eps_eval.list_count) are shown too.

A row is one sweep: a method at one g, lag 1 (the union oracle: its own lag), on the c2f or
listcount budget (oracle_ rows: the threshold budget); a method run at several g gets a row
per g, named "(g = G)". "—" is a value not there (no row to pair with, a sweep that never
reaches 75 %); a value over fewer pairs than the header's names its count."""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np

from eps_eval.report_quality import (
    PAIR,
    SKIP,
    Row,
    add_units_argument,
    at_skip,
    col,
    group,
    load,
    of_pairs,
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


def _sweep_of(r: Row) -> bool:
    """Rows this table reads: lag 1 (the union oracle at its lag 0), the c2f or listcount
    budget, or an oracle's threshold sweep."""
    name = str(r["method"])
    if name == "oracle_mass-union":
        return r["budget"] == "threshold"
    if r["lag"] != 1:
        return False
    return r["budget"] in ("c2f", "listcount") or (name.startswith("oracle_")
                                                  and r["budget"] == "threshold")


def _gap(value: tuple[float, float, int], pairs: int, digits: int = 4,
         sign: str = "") -> str:
    mean, half, n = value
    if np.isnan(mean):
        return "—"
    return (f"{mean:{sign}.{digits}f}" + ("" if np.isnan(half) else f" ± {half:.{digits}f}")
            + of_pairs(n, pairs))


def table(rows: list[Row], base_prefix: str = "fbmem1-c2f") -> list[str]:
    """base_prefix: the row (by the start of its name) the gain column is paired against; a
    prefix that starts several rows' names is a ValueError naming them."""
    out: list[str] = []
    for (wl, ctx), w in sorted(group(rows, ("workload", "context")).items()):
        oracle = where(w, lambda r: r["method"] == "oracle_mass" and r["lag"] == 0
                       and r["g"] == 1 and r["budget"] == "threshold")
        swept = where(w, _sweep_of)
        by_row = group(swept, ("method", "g"))
        gs_of: dict[str, set[object]] = defaultdict(set)
        for m, g in by_row:
            gs_of[str(m)].add(g)
        bases = sorted({key for key in by_row if str(key[0]).startswith(base_prefix)}, key=str)
        if len(bases) > 1:
            raise ValueError(f"--base={base_prefix} starts {len(bases)} rows of {wl} {int(ctx)} "  # type: ignore[call-overload]
                             f"({', '.join(f'{m} g = {int(g)}' for m, g in bases)}): "  # type: ignore[call-overload]
                             "name one")
        base = by_row[bases[0]] if bases else []
        best = by_row.get(("oracle_mass-union", 1.0), [])
        keys = sorted(by_row, key=lambda k: (_order(str(k[0])), k[1]))
        pairs = len(group(w, PAIR))
        out.append(f"\n### {wl}, context {int(ctx)}; pairs: {pairs}\n")  # type: ignore[call-overload]
        out.append(f"| row | gap to g = 1 oracle | gain over {base_prefix} | "
                   "bytes / quest fp16 g = 1 "
                   "| gap to the union oracle |")
        out.append("| --- | --- | --- | ---: | --- |")
        for key in keys:
            name, g = str(key[0]), key[1]
            if name.startswith(("miss-", "xmiss-")):
                continue
            sel = by_row[key]
            label = f"{name} (g = {int(g)})" if len(gs_of[name]) > 1 else name  # type: ignore[call-overload]
            gap = _gap(paired_gain(oracle, sel), pairs)
            gain = (_gap(paired_gain(sel, base), pairs, sign="+")
                    if base and key not in bases else "")
            ugap = _gap(paired_gain(best, sel), pairs) if best else "—"
            near = [r for r in sel if abs(float(r["skip"]) - SKIP) < 0.05]  # type: ignore[arg-type]
            frac = (f"{float(col(near, 'summary_frac').mean()) / QUEST16_G1_FRAC:.2f}"
                    if near else "—")
            out.append(f"| {label} | {gap} | {gain} | {frac} | {ugap} |")
        misses = [key for key in keys if str(key[0]).startswith(("miss-", "xmiss-"))]
        if misses:
            miss = at_skip(oracle)
            missed = "—" if np.isnan(miss[0]) else f"{1 - miss[0]:.4f}"
            out.append(f"\nfbmem1's missed mass (1 − recall) at 75 % skipped, by what the step "
                       f"knew of the missed block; the oracle misses {missed}:\n")
            out.append("| part | missed mass |")
            out.append("| --- | --- |")
            for key in misses:
                out.append(f"| {key[0]} | {_gap(at_skip(by_row[key]), pairs)} |")
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
        print("\n".join(table(load(dirs), a.base)))
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
