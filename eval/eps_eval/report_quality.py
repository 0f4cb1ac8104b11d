"""Tables of issue 19's evaluation: `python -m eps_eval.report_quality --out=DIR`.

Reads DIR/units/q19_*.csv (or those of the --units directories: several runs' units,
each run with its own --out) and writes DIR/quality.md. Every "recall at S skipped"
is interpolated per (layer, step) along that pair's own sweep, then averaged;
the ± is 1.96 standard errors over the pairs (a normal 95 % interval; pairs of
one layer are not independent, so it is optimistic). "—" is a value not there to
report (a sweep that never reaches S, a reuse length whose lags were not all measured),
never a neighbouring value; a cell over fewer pairs than its table's header says
names its count ("(6 of 9 pairs)").
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from eps_eval.estimators import is_estimator

SKIP = 0.75
TARGET = 0.95
Row = dict[str, object]
PAIR = ("workload", "kind", "context", "layer", "step")
# What makes rows one sweep of a pair: its points differ in `param` only.
SWEEP = ("method", "g", "lag", "budget", "temperature", "floor")
NUMERIC = {"context", "layer", "step", "g", "lag", "param", "temperature", "floor", "groups",
           "recall",
           "recall_min", "top10", "out_err", "visited", "summary_frac", "skip"}


def unit_files(dirs: list[Path], pattern: str) -> list[Path]:
    """The files matching `pattern` in any of `dirs`, sorted by name. A name found in two
    of them is a ValueError naming both: one run's units would be counted twice."""
    found: dict[str, Path] = {}
    for d in dirs:
        for f in d.glob(pattern):
            if f.name in found:
                raise ValueError(f"{f.name} is in both {found[f.name].parent} and {d}: "
                                 "give each run's units once")
            found[f.name] = f
    return [found[name] for name in sorted(found)]


def add_units_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--units", nargs="+", action="extend", type=Path, metavar="DIR",
                    help="read the unit CSVs of these directories (each run's OUT/units; "
                         "repeatable, and a shell glob such as OUT/*/units works) instead "
                         "of --out's units/")


def unit_dirs(ap: argparse.ArgumentParser, out: Path | None,
              units: list[Path] | None) -> list[Path]:
    """The directories whose units a report reads: --units, else --out's units/; exits
    with status 2 naming one that does not exist."""
    if units:
        for d in units:
            if not d.is_dir():
                ap.error(f"--units {d}: no such directory")
        return units
    if out is None:
        ap.error("give --out or --units")
    if not out.is_dir():
        ap.error(f"--out={out}: no such directory")
    return [out / "units"]


def load(dirs: list[Path]) -> list[Row]:
    rows: list[Row] = []
    for f in unit_files(dirs, "q19_*.csv"):
        with f.open() as fh:
            for r in csv.DictReader(fh):
                rows.append({k: (float(v) if k in NUMERIC else v) for k, v in r.items()})
    return rows


def group(rows: Iterable[Row], keys: tuple[str, ...]) -> dict[tuple[object, ...], list[Row]]:
    out: dict[tuple[object, ...], list[Row]] = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def where(rows: Iterable[Row], pred: Callable[[Row], bool]) -> list[Row]:
    return [r for r in rows if pred(r)]


def col(rows: list[Row], name: str) -> np.ndarray:
    return np.asarray([float(r[name]) for r in rows])  # type: ignore[arg-type]


def per_pair_at_skip(rows: list[Row], skip: float = SKIP) -> dict[tuple[object, ...], float]:
    """Recall interpolated at `skip` per (layer, step) pair; {} when a pair's sweep misses it.
    A pair's rows must be one sweep (one method, g, lag, budget, τ and floor, each point
    once): rows of two sweeps, or a unit read twice, are a ValueError naming the pair, since
    interpolating along their mixture gives no configuration's recall."""
    vals = {}
    for key, g in group(rows, PAIR).items():
        sweeps = {tuple(r.get(k) for k in SWEEP) for r in g}
        params = [r.get("param", r["skip"]) for r in g]  # a point: its budget (or skip)
        if len(sweeps) > 1 or len(set(params)) < len(params):
            named = "; ".join(", ".join(f"{k} {v}" for k, v in zip(SWEEP, sw) if v is not None)
                              for sw in sorted(sweeps, key=str))
            raise ValueError(f"pair {dict(zip(PAIR, key))}: its rows are not one sweep "
                             f"({named}; {len(params)} points, {len(set(params))} distinct)")
        g = sorted(g, key=lambda r: float(r["skip"]))  # type: ignore[arg-type]
        x, y = col(g, "skip"), col(g, "recall")
        if x.min() > skip or x.max() < skip:
            return {}
        vals[key] = float(np.interp(skip, x, y))
    return vals


def mean_interval(vals: list[float]) -> tuple[float, float, int]:
    if not vals:
        return float("nan"), float("nan"), 0
    v = np.asarray(vals)
    half = 1.96 * v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else float("nan")
    return float(v.mean()), float(half), len(v)


def at_skip(rows: list[Row], skip: float = SKIP) -> tuple[float, float, int]:
    """Mean over pairs of recall interpolated at `skip`; NaN when a pair's sweep misses it."""
    return mean_interval(list(per_pair_at_skip(rows, skip).values()))


def paired_gain(rows: list[Row], base: list[Row], skip: float = SKIP) -> tuple[float, float, int]:
    """Mean over the pairs both cover of (recall of rows − recall of base) at `skip`: the
    interval of a difference measured on the same pairs, much tighter than the two
    unpaired intervals."""
    a, b = per_pair_at_skip(rows, skip), per_pair_at_skip(base, skip)
    return mean_interval([a[k] - b[k] for k in a if k in b])


def fmt(mean: float, half: float) -> str:
    if np.isnan(mean):
        return "—"
    return f"{mean:.3f} ± {half:.3f}" if not np.isnan(half) else f"{mean:.3f}"


def of_pairs(n: int, pairs: int) -> str:
    """" (n of N pairs)" for a value over fewer pairs than its table's header counts."""
    return f" ({n} of {pairs} pairs)" if n < pairs else ""


def cell(value: tuple[float, float, int], pairs: int) -> str:
    """A mean ± interval over `value`'s n pairs (at_skip), naming n when below `pairs`."""
    mean, half, n = value
    return fmt(mean, half) + ("" if np.isnan(mean) else of_pairs(n, pairs))


def gain_text(gain: tuple[float, float, int], pairs: int) -> str:
    """A paired gain (paired_gain): "" when no pair has both, no ± over one pair."""
    mean, half, n = gain
    if np.isnan(mean):
        return ""
    return (f"{mean:+.3f}" + ("" if np.isnan(half) else f" ± {half:.3f}")
            + of_pairs(n, pairs))


def bytes_ratio(near: list[Row], base_frac: float) -> str:
    """Mean summary_frac of the sweep points near 75 % skipped over `base_frac`; "—" when no
    point is near it or the base is unmeasured (it printed "nan")."""
    if not near or np.isnan(base_frac):
        return "—"
    return f"{float(col(near, 'summary_frac').mean()) / base_frac:.2f}"


HEAD_DIM = {"real": 64, "synthetic": 128, "gemma": 256}


def epsd_record_rows(rows: list[Row], d: int) -> list[Row]:
    """quest rows re-costed with epsd's record today (fp32: G and norms at m = 8, key_sum,
    quest min/max; docs/summaries.md) instead of Quest's fp16 min/max (4·d bytes)."""
    words = 8 * 9 // 2 + 3 + d + 2 * d
    ratio = (-(-words // 4) * 4 * 4) / (4.0 * d)
    out = []
    for r in rows:
        frac = float(r["summary_frac"]) * ratio  # type: ignore[arg-type]
        out.append({**r, "summary_frac": frac, "skip": 1.0 - float(r["visited"]) - frac})  # type: ignore[arg-type]
    return out


def table_methods(rows: list[Row], lag: int) -> list[str]:
    out: list[str] = []
    for (wl, ctx), w in sorted(group(rows, ("workload", "context")).items()):
        thr = where(w, lambda r: r["budget"] == "threshold")
        pairs = len(group(w, PAIR))
        o = at_skip(where(thr, lambda r: r["method"] == "oracle_mass" and r["g"] == 1))
        out.append(f"\n### {wl}, context {int(ctx)}, lag {lag}; pairs: {pairs}; "  # type: ignore[call-overload]
                   f"mass oracle at g = 1: {cell(o, pairs)}\n")
        gs = sorted({int(r["g"]) for r in thr})  # type: ignore[call-overload]
        out.append("| method | " + " | ".join(f"g = {g}" for g in gs) + " |")
        out.append("| --- |" + " --- |" * len(gs))
        for m in ("jl8", "1pc", "fro", "quest", "questclt", "quest8", "oracle_max", "oracle_mass"):
            want_lag = 0 if m.startswith("oracle") else lag
            cells = []
            for g in gs:
                sel = [r for r in thr if r["method"] == m and r["g"] == g and r["lag"] == want_lag]
                cells.append(cell(at_skip(sel), pairs) if sel else "")
            out.append(f"| {m}{' (lag 0)' if want_lag != lag else ''} | " + " | ".join(cells) + " |")
            if m == "quest":
                d = HEAD_DIM.get(str(wl), 128)
                cells = []
                for g in gs:
                    sel = [r for r in thr if r["method"] == m and r["g"] == g and r["lag"] == lag]
                    cells.append(cell(at_skip(epsd_record_rows(sel, d)), pairs) if sel else "")
                out.append("| quest, epsd's fp32 record today | " + " | ".join(cells) + " |")
        q16 = where(thr, lambda r: r["method"] == "quest" and r["g"] == 1 and r["lag"] == lag)
        q16_frac = float(col(q16, "summary_frac").mean()) if q16 else float("nan")
        c2f = where(w, lambda r: r["budget"] == "c2f" and r["lag"] == lag)
        if c2f:
            out.append("\nCoarse-to-fine (block-granular lists, quest8 records), and the summary "
                       "bytes read near 75 % skipped relative to quest fp16 at g = 1 (4·d bytes "
                       "per block and KV head):\n")
            out.append("| configuration | recall at 75 % skipped | summary bytes / quest fp16 g = 1 |")
            out.append("| --- | --- | --- |")
            for (name,), sel in sorted(group(c2f, ("method",)).items()):
                near = [r for r in sel if abs(float(r["skip"]) - SKIP) < 0.05]  # type: ignore[arg-type]
                out.append(f"| {name} | {cell(at_skip(sel), pairs)} | "
                           f"{bytes_ratio(near, q16_frac)} |")
    return out


def table_estimators(rows: list[Row], lag: int = 1) -> list[str]:
    """Estimators from the quest8 record (eps_eval.estimators) against quest8 at the same g,
    i.e. the same summary bytes, and c2f with estimator levels against c2f with quest8
    levels; each gain is paired over the (layer, step) pairs."""
    out: list[str] = []
    for (wl, ctx), w in sorted(group(rows, ("workload", "context")).items()):
        thr = where(w, lambda r: r["budget"] == "threshold")
        names = sorted({str(r["method"]) for r in thr
                        if is_estimator(str(r["method"]))
                        or r["method"] in ("momentlgn", "oracle_mass_lag")})
        if not names:
            continue
        pairs = len(group(w, PAIR))
        o = at_skip(where(thr, lambda r: r["method"] == "oracle_mass" and r["g"] == 1))
        gs = sorted({int(r["g"]) for r in thr})  # type: ignore[call-overload]
        d = HEAD_DIM.get(str(wl), 128)
        out.append(f"\n### {wl}, context {int(ctx)}, lag {lag}; pairs: {pairs}; "  # type: ignore[call-overload]
                   f"mass oracle at g = 1: {cell(o, pairs)}\n")
        out.append("Recall at 75 % skipped (gain over quest8 at the same g, paired).\n")
        out.append("| method | " + " | ".join(f"g = {g}" for g in gs) + " |")
        out.append("| --- |" + " --- |" * len(gs))
        out.append("| summary bytes / quest fp16 g = 1 | "
                   + " | ".join(f"{(2 * d + 4) / (4 * d * g):.2f}" for g in gs) + " |")

        def sel(m: str, g: int, thr: list[Row] = thr) -> list[Row]:
            return [r for r in thr if r["method"] == m and r["g"] == g and r["lag"] == lag]

        for m in ["quest", "quest8"] + names:
            cells = []
            for g in gs:
                rec = at_skip(sel(m, g))
                gain = gain_text(paired_gain(sel(m, g), sel("quest8", g)), pairs)
                paired = m != "quest8" and gain
                cells.append(cell(rec, pairs) + (f" ({gain})" if paired else ""))
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        c2f = where(w, lambda r: r["budget"] == "c2f" and r["lag"] == lag)
        q16 = sel("quest", 1)
        q16_frac = float(col(q16, "summary_frac").mean()) if q16 else float("nan")
        for (base,), bsel in sorted(group(c2f, ("method",)).items()):
            if "-" in str(base):
                continue
            variants = [(str(m), v) for (m,), v in sorted(group(c2f, ("method",)).items())
                        if str(m).startswith(f"{base}-")]
            if not variants:
                continue
            out.append(f"\n| configuration | recall at 75 % skipped | gain over {base} (paired) | "
                       "summary bytes / quest fp16 g = 1 |")
            out.append("| --- | --- | --- | --- |")
            for m, v in [(str(base), bsel)] + variants:
                near = [r for r in v if abs(float(r["skip"]) - SKIP) < 0.05]  # type: ignore[arg-type]
                gtxt = gain_text(paired_gain(v, bsel), pairs) if m != base else ""
                out.append(f"| {m} | {cell(at_skip(v), pairs)} | {gtxt} | "
                           f"{bytes_ratio(near, q16_frac)} |")
    return out


def reuse_rows(rows: list[Row], k: int) -> tuple[list[Row], int]:
    """A selection reused for k steps, read with lags 1…k: per pair and sweep point, recall
    and skip averaged over those lags, for the pairs with every one of them measured at
    every sweep point (a pair short of one lag is left out, never averaged over the lags it
    has); and how many pairs that is. rows: one method and g, any lags."""
    want = {float(lag) for lag in range(1, k + 1)}
    within = [r for r in rows if float(r["lag"]) in want]  # type: ignore[arg-type]
    out: list[Row] = []
    pairs = 0
    for key, pts in group(within, PAIR).items():
        points = group(pts, ("param",))
        if any(len(p) != k or {float(r["lag"]) for r in p} != want  # type: ignore[arg-type]
               for p in points.values()):
            continue
        pairs += 1
        for (param,), p in points.items():
            out.append({**dict(zip(PAIR, key)), "param": param,
                        "recall": float(col(p, "recall").mean()),
                        "skip": float(col(p, "skip").mean())})
    return out, pairs


REUSE_STEPS = (1, 2, 4)


def table_reuse(rows: list[Row], methods: tuple[str, ...], gs: tuple[int, ...]) -> list[str]:
    out = ["",
           ("A selection made with the query of step t−1 and reused for steps t…t+k−1 is read "
            "with lags 1…k: per sweep point the recall is averaged over those lags, on the pairs "
            "that have every lag 1…k measured (a run that measured lag 1 only has no k = 2 or "
            "4: \"—\", as where the sweep never reaches 75 %)."), "",
           "| workload | context | method | g | "
           + " | ".join(f"k = {k}" for k in REUSE_STEPS) + " |",
           "| --- | --- | --- | --- |" + " --- |" * len(REUSE_STEPS)]
    thr = where(rows, lambda r: r["budget"] == "threshold")
    for (wl, ctx), w in sorted(group(thr, ("workload", "context")).items()):
        for m in methods:
            for g in gs:
                sel = [r for r in w if r["method"] == m and r["g"] == g]
                if not sel:
                    continue
                # The pairs measured at lag 1 are the row's; a k over fewer names its count.
                pairs = len(group(where(sel, lambda r: r["lag"] == 1), PAIR))
                cells = []
                for k in REUSE_STEPS:
                    avg, n = reuse_rows(sel, k)
                    cells.append(cell(at_skip(avg), pairs) if n else "—")
                out.append(f"| {wl} | {int(ctx)} | {m} | {g} | " + " | ".join(cells) + " |")  # type: ignore[call-overload]
    return out


def ranked_points(rows: list[Row]) -> list[list[Row]]:
    """The k-th sweep point (k-th smallest parameter) of every pair, for each k: the same
    share of the unforced groups across pairs. Pairs whose sweeps differ in length are a
    ValueError naming the lengths: their k-th points are no common budget, and the last
    points would average over the longer sweeps' pairs only."""
    sweeps = [sorted(pts, key=lambda r: float(r["param"]))  # type: ignore[arg-type]
              for pts in group(rows, PAIR).values()]
    lengths = sorted({len(s) for s in sweeps})
    if len(lengths) > 1:
        r = rows[0]
        raise ValueError(f"{r['workload']} {float(r['context']):g} {r['method']} "  # type: ignore[arg-type]
                         f"g = {float(r['g']):g}, lag {float(r['lag']):g}: the "  # type: ignore[arg-type]
                         f"pairs' sweeps have {' or '.join(map(str, lengths))} points: no "
                         "mean per sweep point over every pair")
    return [list(points) for points in zip(*sweeps)]


def fixed_skip_at_recall(rows: list[Row], target: float) -> str:
    """Largest mean skip among the sweep points (same share of unforced groups across pairs)
    whose mean recall over the pairs reaches `target`."""
    if not rows:
        return "—"
    best, top = None, 0.0
    for pts in ranked_points(rows):
        rec, sk = col(pts, "recall").mean(), col(pts, "skip").mean()
        top = max(top, rec)
        if rec >= target and (best is None or sk > best):
            best = sk
    return f"{best:.3f}" if best is not None else f"never (best mean recall {top:.3f})"


def table_mass(rows: list[Row], target: float = TARGET) -> list[str]:
    """Adaptive budget: choose (τ, p, floor) on every other evaluated layer (the 1st, 3rd, …),
    report on the others."""
    out: list[str] = []
    for (wl, ctx), w in sorted(group(rows, ("workload", "context")).items()):
        layers = sorted({int(r["layer"]) for r in w})  # type: ignore[call-overload]
        calib_layers = set(layers[0::2])
        calib = [r for r in w if int(r["layer"]) in calib_layers]  # type: ignore[call-overload]
        test = [r for r in w if int(r["layer"]) not in calib_layers]  # type: ignore[call-overload]
        out.append(f"\n### {wl}, context {int(ctx)}: (τ, p) chosen on layers "  # type: ignore[call-overload]
                   f"{sorted({int(r['layer']) for r in calib})}, tested on "  # type: ignore[call-overload]
                   f"{sorted({int(r['layer']) for r in test})}\n")  # type: ignore[call-overload]
        out.append("| method | g | lag | chosen τ, p, floor | test: pairs with recall ≥ 0.95 | "
                   "test: mean recall | test: mean skip | best fixed budget with mean recall "
                   "≥ 0.95 (test): skip |")
        out.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        mass = where(w, lambda r: r["budget"] == "mass")
        for (m, g, lag), _ in sorted(group(mass, ("method", "g", "lag")).items()):
            def same(r: Row, m: object = m, g: object = g, lag: object = lag) -> bool:
                return r["budget"] == "mass" and r["method"] == m and r["g"] == g and r["lag"] == lag
            best = None
            for (tau, p, fl), sel in group(where(calib, same),
                                           ("temperature", "param", "floor")).items():
                share = float((col(sel, "recall") >= target).mean())
                sk = float(col(sel, "skip").mean())
                if share >= 0.95 and (best is None or sk > best[2]):
                    best = (tau, p, sk, fl)
            fixed_lag = 0 if str(m).startswith("oracle") else lag
            tf = where(test, lambda r, m=m, g=g, fl=fixed_lag: r["budget"] == "threshold"
                       and r["method"] == m and r["g"] == g and r["lag"] == fl)
            fixed = fixed_skip_at_recall(tf, target)
            if best is None:
                out.append(f"| {m} | {int(g)} | {int(lag)} | none reaches 95 % of pairs | | | | {fixed} |")  # type: ignore[call-overload]
                continue
            sel = where(test, lambda r, b=best, s=same: s(r) and r["temperature"] == b[0]
                        and r["param"] == b[1] and r["floor"] == b[3])
            rec = col(sel, "recall")
            out.append(f"| {m} | {int(g)} | {int(lag)} | {best[0]:g}, {best[1]:g}, {best[3]:g} | "  # type: ignore[call-overload]
                       f"{(rec >= target).mean():.3f} of {len(sel)} | {rec.mean():.3f} | "
                       f"{col(sel, 'skip').mean():.3f} | {fixed} |")
    return out


def curve(rows: list[Row]) -> tuple[np.ndarray, np.ndarray]:
    """Mean (skip, recall) per sweep point (k-th smallest parameter of every pair)."""
    pts = sorted((col(v, "skip").mean(), col(v, "recall").mean()) for v in ranked_points(rows))
    return np.asarray([p[0] for p in pts]), np.asarray([p[1] for p in pts])


def plots(rows: list[Row], out: Path, lag: int = 1) -> list[str]:
    """recall vs skip per method at g = 1 and g = 8 (and c2f), one PNG per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for (wl, ctx), w in sorted(group(rows, ("workload", "context")).items()):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, g in zip(axes, (1, 8)):
            for m in ("jl8", "1pc", "quest", "quest8", "questclt1", "oracle_mass"):
                want = 0 if m.startswith("oracle") else lag
                sel = [r for r in w if r["budget"] == "threshold" and r["method"] == m
                       and r["g"] == g and r["lag"] == want]
                if sel:
                    x, y = curve(sel)
                    ax.plot(x, y, marker=".", label=m)
            if g == 1:
                for m in ("c2f8x2", "c2f16x2", "c2f8x2-questclt1"):
                    sel = [r for r in w if r["budget"] == "c2f" and r["method"] == m
                           and r["lag"] == lag]
                    if sel:
                        x, y = curve(sel)
                        ax.plot(x, y, marker="x", linestyle="--", label=m)
            ax.axvline(SKIP, color="grey", linewidth=0.5)
            ax.set_title(f"{wl} {int(ctx)}, g = {g}, lag {lag}")  # type: ignore[call-overload]
            ax.set_xlabel("KV bytes skipped (summary bytes counted)")
            ax.set_xlim(0, 1)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("attention-mass recall")
        for ax in axes:
            ax.legend(fontsize=8)
        name = f"q19_recall_vs_skip_{wl}_{int(ctx)}.png"  # type: ignore[call-overload]
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        names.append(name)
    return names


def table_passkeys(dirs: list[Path]) -> list[str]:
    """Gemma passkeys per variant: retrieved, and retrieved where dense retrieves."""
    out = []
    # One file per context (q19gemma_passkey_4096) or per prompt (q19gemma_passkey_32768_p07).
    by_context: dict[str, list[dict[str, str]]] = defaultdict(list)
    for f in unit_files(dirs, "q19gemma_passkey_*.csv"):
        with f.open() as fh:
            by_context[re.sub(r"_p\d+$", "", f.stem)] += list(csv.DictReader(fh))
    for stem, rows in sorted(by_context.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1])):
        dense_ok = {r["prompt"] for r in rows if r["method"] == "dense" and r["correct"] == "1"}
        n = len({r["prompt"] for r in rows})
        out += ["", f"Passkeys ({stem}): {n} prompts, dense retrieves {len(dense_ok)}.", "",
                "| variant | retrieved | retrieved where dense does | tokens visited (global layers) |",
                "| --- | --- | --- | --- |"]
        for (m, g), sel in sorted(group(rows, ("method", "g")).items()):  # type: ignore[arg-type]
            if m == "dense":
                continue
            ok = sum(r["correct"] == "1" for r in sel)
            # Out of the prompts dense retrieves that this variant ran: one it did not run
            # is no miss.
            ran = dense_ok & {str(r["prompt"]) for r in sel}
            both = sum(r["correct"] == "1" for r in sel if r["prompt"] in ran)
            vis = np.mean([float(r["visited"]) for r in sel])
            out.append(f"| {m}, g = {g} | {ok} of {len(sel)} | {both} of {len(ran)} | "
                       f"{vis:.3f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=Path,
                    help="the directory run_quality wrote (its units/q19_*.csv are read, "
                         "quality.md and the plots written there; created with --units)")
    add_units_argument(ap)
    a = ap.parse_args(argv)
    dirs = unit_dirs(ap, a.out, a.units)
    try:  # a unit in two directories is refused before anything is written
        units = unit_files(dirs, "q19_*.csv")
        unit_files(dirs, "q19gemma_passkey_*.csv")
    except ValueError as e:
        ap.error(str(e))
    # An empty report over a good one is no report: the units come first (run_quality).
    if not units and a.units:
        ap.error(f"--units: {', '.join(map(str, dirs))} hold no q19_*.csv unit to report on")
    if not units:
        ap.error(f"--out={a.out}: {dirs[0]} holds no q19_*.csv unit to report on "
                 f"(run eps_eval.run_quality --out={a.out} first)")
    rows = load(dirs)
    lines = ["# Issue 19: group size, reuse, 8-bit quest, coarse-to-fine, adaptive budget", "",
             ("Generated by `python -m eps_eval.report_quality`; the runs, machines and dates "
              "are in docs/eval/README.md."), "",
             "## Recall at 75 % of KV bytes skipped (summary bytes counted), threshold budget"]
    try:  # rows that are no one sweep of a pair are refused before anything is written
        for lag in (1, 0):
            lines += table_methods(rows, lag)
        est = table_estimators(rows)
        if est:
            lines += ["", "## Estimators from the quest8 record, at quest8's bytes"] + est
        lines += ["", "## Reusing one selection for k steps (recall at 75 % skipped)"]
        lines += table_reuse(rows, ("quest", "quest8", "questclt", "jl8"), (1, 2, 4, 8))
        lines += ["", "## Adaptive mass budget against the fixed budgets (target recall 0.95)"]
        lines += table_mass(rows)
    except ValueError as e:
        ap.error(str(e))
    lines += ["", "## Gemma 3 270M passkeys"] + table_passkeys(dirs)
    a.out.mkdir(parents=True, exist_ok=True)
    try:
        lines += ["", "## Plots", ""] + [f"![{n}]({n})" for n in plots(rows, a.out)]
    except ValueError as e:  # quality.md is not written
        ap.error(str(e))
    (a.out / "quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
