"""Aggregates the units of a run into CSV, PNG plots and summary.md."""

from __future__ import annotations

import csv
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

KEY = ("workload", "kind", "context", "method", "g", "lag", "granularity", "top_pages")
METRICS = ("skip", "visited", "summary_frac", "recall", "recall_min", "top10", "false_skip", "out_err")
MAIN = ("jl8", "exact", "1pc", "fro", "quest", "oracle_mass", "oracle_max", "jl8-2l", "quest-2l",
        "1pc-2l", "jl4", "jl16", "jl32", "strict")
STYLE = {"jl4": ":", "jl16": ":", "jl32": ":", "jl8-2l": "--", "quest-2l": "--", "1pc-2l": "--",
         "oracle_mass": "-.", "oracle_max": "-."}


def _read(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _num(x: str) -> float | int | str:
    try:
        v = float(x)
        return int(v) if v.is_integer() and "." not in x and "e" not in x else v
    except ValueError:
        return x


def aggregate(rows: list[dict[str, str]]) -> list[dict[str, object]]:
    """Means over layers and steps (and the kinds of a synthetic context)."""
    acc: dict[tuple, list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        acc[tuple(r[k] for k in KEY)].append(r)
        acc[tuple("all" if k == "kind" else r[k] for k in KEY)].append(r)
    out = []
    for key, rs in acc.items():
        row: dict[str, object] = {k: _num(v) for k, v in zip(KEY, key)}
        row["n"] = len(rs)
        for m in METRICS:
            row[m] = float(np.mean([float(r[m]) for r in rs]))
        row["recall_p10"] = float(np.percentile([float(r["recall"]) for r in rs], 10))
        out.append(row)
    out.sort(key=lambda r: tuple(str(r[k]) for k in KEY))
    return out


def curve(agg: list[dict[str, object]], **sel: object) -> tuple[np.ndarray, np.ndarray]:
    pts = sorted((float(r["skip"]), float(r["recall"])) for r in agg
                 if all(str(r[k]) == str(v) for k, v in sel.items()))
    if not pts:
        return np.array([]), np.array([])
    a = np.array(pts)
    return a[:, 0], a[:, 1]


def recall_at(agg: list[dict[str, object]], skip: float, **sel: object) -> float | None:
    """Recall at `skip`, linear between the sweep's points (None outside their range)."""
    x, y = curve(agg, **sel)
    if len(x) < 2 or skip < x.min() or skip > x.max():
        return None
    order = np.argsort(x)
    return float(np.interp(skip, x[order], y[order]))


def _plots(out: Path, agg: list[dict[str, object]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    combos = sorted({(r["workload"], r["context"]) for r in agg}, key=str)
    for wl, ctx in combos:
        gs = sorted({int(r["g"]) for r in agg if r["workload"] == wl and r["context"] == ctx})
        fig, axes = plt.subplots(1, len(gs), figsize=(4.2 * len(gs), 4), squeeze=False)
        for ax, g in zip(axes[0], gs):
            for m in MAIN:
                lag = 0 if m.startswith("oracle") else 1
                x, y = curve(agg, workload=wl, kind="all", context=ctx, method=m, g=g, lag=lag,
                             granularity="union")
                if len(x):
                    ax.plot(x, y, STYLE.get(m, "-"), marker=".", label=m, lw=1.2)
            ax.axvline(0.75, color="grey", lw=0.6)
            ax.set_title(f"g={g} ({16 * g}-token groups), lag 1")
            ax.set_xlabel("KV bytes skipped (net of summaries)")
            ax.set_xlim(0.0, 1.0)
            ax.set_ylim(0.0, 1.02)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("attention-mass recall")
        axes[0][-1].legend(fontsize=7, loc="lower left")
        fig.suptitle(f"{wl}, context {ctx}: recall vs bytes skipped (union, mean over layers/steps)")
        fig.tight_layout()
        name = f"recall_vs_skip_{wl}_{ctx}.png"
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        made.append(name)
        # Lag and granularity at the product's g = 8 (or the largest g run); the
        # short real-model context reaches high skip only with the smallest g.
        g0 = gs[0] if wl == "real" else (8 if 8 in gs else gs[-1])
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for m, color in (("jl8", "C0"), ("1pc", "C2"), ("quest", "C3")):
            for lag, ls in ((0, "-"), (1, "--"), (4, ":")):
                x, y = curve(agg, workload=wl, kind="all", context=ctx, method=m, g=g0, lag=lag,
                             granularity="union")
                if len(x):
                    ax.plot(x, y, ls, color=color, marker=".", label=f"{m} lag {lag}")
            x, y = curve(agg, workload=wl, kind="all", context=ctx, method=m, g=g0, lag=1,
                         granularity="per_kv_head")
            if len(x):
                ax.plot(x, y, "-.", color=color, alpha=0.6, label=f"{m} lag 1 per KV head")
        ax.axvline(0.75, color="grey", lw=0.6)
        ax.set_xlabel("KV bytes skipped (net of summaries)")
        ax.set_ylabel("attention-mass recall")
        ax.set_xlim(0.0, 1.0)
        ax.set_ylim(0.0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(f"{wl}, context {ctx}, g={g0}: query lag and per-KV-head lists")
        fig.tight_layout()
        name = f"lag_{wl}_{ctx}.png"
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        made.append(name)
    return made


def _fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def write(out: Path, *, t0: float | None = None, load0: tuple[float, ...] | None = None) -> None:
    units = out / "units"
    sel_rows: list[dict[str, str]] = []
    quality: list[dict[str, str]] = []
    passkey: list[dict[str, str]] = []
    metas = {}
    for p in sorted(units.glob("*.csv")):
        rows = _read(p)
        metas[p.stem] = json.loads((units / f"{p.stem}.json").read_text())
        if p.stem.endswith("_quality"):
            quality += rows
        elif p.stem.startswith("real_passkey"):
            passkey += rows
        else:
            sel_rows += rows
    agg = aggregate(sel_rows)
    if agg:
        with (out / "aggregate.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(agg[0].keys()))
            w.writeheader()
            w.writerows(agg)
    plots = _plots(out, agg) if agg else []
    lines = ["# EPS selection-quality evaluation", ""]
    settings = json.loads((out / "settings.json").read_text()) if (out / "settings.json").exists() else {}
    lines += [f"Mode: {settings.get('mode', '?')}; machine: {settings.get('machine', '?')}, "
              f"{settings.get('cpus', '?')} CPUs; load average at start "
              f"{_fmt(load0[0] if load0 else None, 2)}, at end {os.getloadavg()[0]:.2f}; "
              f"finished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
              + (f"; wall time {time.time() - t0:.0f} s." if t0 else "."), ""]
    lines += ["Rows are means over layers and decode steps (`kind=all`: every synthetic kind).",
              "`skip` = 1 − (KV bytes read + summary bytes read) / dense KV bytes (fp16 K and V).",
              "Recall at a given skip is interpolated along each method's top_pages sweep.", ""]
    lines += ["## Attention-mass recall at 75 % of KV bytes skipped", ""]
    lines += ["| workload | context | g | lag | jl8 | 1pc | quest | exact | fro | oracle_mass |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    combos = sorted({(r["workload"], r["context"]) for r in agg}, key=lambda t: (str(t[0]), int(t[1])))
    for wl, ctx in combos:
        gs = sorted({int(r["g"]) for r in agg if r["workload"] == wl and r["context"] == ctx})
        for g in gs:
            for lag in (0, 1):
                vals = [recall_at(agg, 0.75, workload=wl, kind="all", context=ctx, method=m, g=g,
                                  lag=0 if m == "oracle_mass" else lag, granularity="union")
                        for m in ("jl8", "1pc", "quest", "exact", "fro", "oracle_mass")]
                lines.append(f"| {wl} | {ctx} | {g} | {lag} | " + " | ".join(_fmt(v) for v in vals) + " |")
    kinds = sorted({str(r["kind"]) for r in agg if r["kind"] != "all" and r["workload"] == "synthetic"})
    if kinds:
        lines += ["", "Per synthetic kind (g = 8, the product's default):", "",
                  "| kind | context | lag | jl8 | 1pc | quest | exact | fro | oracle_mass |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for kind in kinds:
            for wl, ctx in combos:
                if wl != "synthetic":
                    continue
                for lag in (0, 1):
                    vals = [recall_at(agg, 0.75, workload=wl, kind=kind, context=ctx, method=m,
                                      g=8, lag=0 if m == "oracle_mass" else lag,
                                      granularity="union")
                            for m in ("jl8", "1pc", "quest", "exact", "fro", "oracle_mass")]
                    lines.append(f"| {kind} | {ctx} | {lag} | " + " | ".join(_fmt(v) for v in vals) + " |")
    lines += ["", "## Best recall at 75 % skipped over every method variant (lag 1, union)", "",
              "| workload | context | best method (g) | recall | jl8 best g | quest best g |",
              "| --- | --- | --- | --- | --- | --- |"]
    methods = sorted({str(r["method"]) for r in agg})
    for wl, ctx in combos:
        gs = sorted({int(r["g"]) for r in agg if r["workload"] == wl and r["context"] == ctx})
        best: dict[str, tuple[float, int]] = {}
        for m in methods:
            for g in gs:
                v = recall_at(agg, 0.75, workload=wl, kind="all", context=ctx, method=m, g=g,
                              lag=0 if m.startswith("oracle") else 1, granularity="union")
                if v is not None and (m not in best or v > best[m][0]):
                    best[m] = (v, g)
        real = {m: v for m, v in best.items() if not m.startswith("oracle") and m != "exact"}
        if real:
            bm = max(real, key=lambda m: real[m][0])
            lines.append(f"| {wl} | {ctx} | {bm} ({real[bm][1]}) | {real[bm][0]:.3f} | "
                         f"{_fmt(best.get('jl8', (None, 0))[0])} ({best.get('jl8', (0, '—'))[1]}) | "
                         f"{_fmt(best.get('quest', (None, 0))[0])} ({best.get('quest', (0, '—'))[1]}) |")
    # Strict mode.
    strict = [r for r in agg if r["method"] == "strict" and r["kind"] == "all"]
    if strict:
        lines += ["", "## Strict mode (PageSelector::Select, every bound in the record)", "",
                  "| workload | context | g | lag | top_pages | skip | recall | false-skip rate |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in strict:
            lines.append(f"| {r['workload']} | {r['context']} | {r['g']} | {r['lag']} | "
                         f"{r['top_pages']} | {r['skip']:.3f} | {r['recall']:.3f} | "
                         f"{r['false_skip']:.4f} |")
    if quality:
        lines += ["", "## Real model: teacher-forced quality against dense (paired positions)", "",
                  "| method | lag | top_pages share | tokens visited | Δ perplexity | top-1 agreement | n |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        by: dict[tuple[str, str, str], list[dict[str, str]]] = defaultdict(list)
        for r in quality:
            by[(r["method"], r["lag"], r["fraction"])].append(r)
        for (m, lag, frac), rs in sorted(by.items()):
            dn = np.exp(np.mean([float(r["nll_dense"]) for r in rs]))
            sp = np.exp(np.mean([float(r["nll_sparse"]) for r in rs]))
            lines.append(f"| {m} | {lag} | {frac} | {np.mean([float(r['visited']) for r in rs]):.3f} "
                         f"| {sp - dn:+.3f} (dense {dn:.2f}) | "
                         f"{np.mean([int(r['agree']) for r in rs]):.3f} | {len(rs)} |")
    if passkey:
        lines += ["", "## Real model: passkey retrieval (greedy, selection at every decode step)", "",
                  "| method | lag | top_pages share | tokens visited | accuracy | n |",
                  "| --- | --- | --- | --- | --- | --- |"]
        by2: dict[tuple[str, str, str], list[dict[str, str]]] = defaultdict(list)
        for r in passkey:
            by2[(r["method"], r["lag"], r["fraction"])].append(r)
        for (m, lag, frac), rs in sorted(by2.items()):
            lines.append(f"| {m} | {lag} | {frac} | {np.mean([float(r['visited']) for r in rs]):.3f} | "
                         f"{np.mean([int(r['correct']) for r in rs]):.2f} | {len(rs)} |")
    real_meta = [m for k, m in metas.items() if k.startswith("real_") and "dense_ppl_last_256" in m]
    if real_meta:
        m0 = real_meta[0]
        lines += ["", "## Real-model sanity", "",
                  (f"{m0['model']}, text {m0['text']}: dense perplexity over the last 256 positions "
                  f"of a {m0['context']}-token passage {m0['dense_ppl_last_256']}; greedy sample: "
                  f"`{m0['greedy_sample']!r}`; prefill {m0['prefill_seconds']} s.")]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Units", "", "| unit | seconds |", "| --- | --- |"]
    # A unit whose JSON holds no time shows "—", not 0 seconds.
    lines += [f"| {k} | {_fmt(m.get('seconds'), 0)} |" for k, m in sorted(metas.items())]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
