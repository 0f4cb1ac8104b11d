"""The mass budget calibrated per layer, tested on other positions or other contexts.

`python -m eps_eval.layer_calibration --calibrate='DIR/units/q19_real_8192_*.csv'
--test='DIR/units/q19_real_4096_*.csv' [--margin=0.97] [--floors=0.0] [--budget=massunion]
[--scope=all]` (comma-separated globs; a pair is (layer, context, step))

Reads the unit CSVs of `run_quality --plan=mass` (lag 1; every (τ, p, floor) of the
mass budget and the threshold budget's sweep for each (method, g)). For each layer it
picks the (τ, p, floor) with the most bytes skipped whose recall reaches `margin` on
every calibration pair of that layer, then reports on the test pairs: how many reach
the target recall (0.95) and the mean skip, beside the best single fixed budget whose
mean recall over the same test pairs reaches 0.95 (at a swept point, and interpolated
linearly between the two swept points around 0.95; "—" where none does). A layer that no
setting is safe on is left out of both sides and counted in the row. With
--split-steps=0,2,4 the calibration and test pairs come from the same files, split by
step. --budget picks the
adaptive budget's rows (mass: core's per-head MarkByMass; massunion: the list-level
budget of quality.py); --scope=all calibrates one setting for every layer, --radius=N
pools each layer's calibration pairs with those of N layers on each side; --emit=FILE writes
the per-layer settings chosen on the calibration pairs as JSON (epsd's
SelectOptions.mass_layers, per (method, g)); --setting=p,τ,floor
takes that setting without calibrating (e.g. --setting=0.95,1.0,0.0 --lag=0 with the exact
mass of the current query: the best an adaptive budget can do); --lag picks the rows' lag.
"""

from __future__ import annotations

import argparse
import csv
import glob
import itertools
import json
import math
import os
from collections import defaultdict
from pathlib import Path

from eps_eval.args import index_list, non_negative_int, unit_interval

TARGET = 0.95
Pair = tuple[int, int, int]  # (layer, context, step)
Point = tuple[float, float]  # (recall, skip)
Table = dict[tuple[str, ...], dict[Pair, Point]]


# The columns of run_quality's unit CSVs that this module reads.
COLUMNS = ("method", "g", "lag", "layer", "context", "step", "budget", "param", "temperature",
           "floor", "recall", "skip")


def load(patterns: str) -> list[dict[str, str]]:
    """The rows of every unit CSV matching the comma-separated globs. A match that is no
    unit CSV (a directory, a file without its columns) is a ValueError naming it."""
    rows: list[dict[str, str]] = []
    for pattern in patterns.split(","):
        for path in sorted(glob.glob(pattern)):
            if not Path(path).is_file():
                raise ValueError(f"{path} is not a file (give globs of unit CSVs, "
                                 "e.g. DIR/units/q19_real_8192_*.csv)")
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
                if missing:
                    raise ValueError(f"{path} is not a unit CSV of run_quality: it has no "
                                     f"{', '.join(missing)} column")
                file_rows = list(reader)
            for line, r in enumerate(file_rows, start=2):
                try:
                    int(r["layer"]), int(r["context"]), int(r["step"])
                    float(r["recall"]), float(r["skip"])
                except (TypeError, ValueError):
                    raise ValueError(f"{path}:{line}: a row whose layer, context, step, recall "
                                     "or skip is not a number") from None
            rows += file_rows
    return rows


def _setting(arg: str) -> tuple[str, ...]:
    """--setting: p,τ,floor, three numbers, kept as written (the CSVs' spelling)."""
    parts = tuple(arg.split(","))
    try:
        ok = len(parts) == 3 and all(math.isfinite(float(v)) for v in parts)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{arg!r} is not p,τ,floor (three numbers)")
    return parts


def _floor_list(arg: str) -> list[float]:
    """--floors: one or more floors, shares of the unforced groups in [0, 1)."""
    try:
        values = [float(v) for v in arg.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{arg!r} is not a list of numbers") from None
    if not values or not all(0.0 <= v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{arg!r}: floors are shares in [0, 1), one or more")
    return values


def _emit_path(arg: str) -> Path:
    """--emit: a file in an existing, writable directory (checked before the work)."""
    path = Path(arg)
    parent = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{arg!r} is a directory")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{arg!r}: {parent} is not a writable directory")
    return path


def tables(rows: list[dict[str, str]], method: str, g: str,
           budget: str = "mass", lag: str = "1") -> tuple[Table, Table]:
    """(mass[(p, τ, floor)], threshold[(param,)]) -> pair -> (recall, skip), lag 1."""
    mass: Table = defaultdict(dict)
    fixed: Table = defaultdict(dict)
    for r in rows:
        if r["method"] != method or r["g"] != g or r["lag"] != lag:
            continue
        pair = (int(r["layer"]), int(r["context"]), int(r["step"]))
        point = (float(r["recall"]), float(r["skip"]))
        if r["budget"] == budget:
            mass[(r["param"], r["temperature"], r["floor"])][pair] = point
        elif r["budget"] == "threshold":
            fixed[(r["param"],)][pair] = point
    return mass, fixed


def calibrate(mass: Table, pairs: list[Pair], margin: float, floors: set[str] | None,
              per_layer: bool = True, radius: int = 0) -> dict[int, tuple[str, ...]]:
    """Per layer (or one for all: per_layer False), the setting with the most mean skip
    reaching `margin` on all its pairs; with radius r > 0 a layer's pairs are pooled with
    those of the r layers on each side of it (in the order of the layers sampled)."""
    chosen: dict[int, tuple[str, ...]] = {}
    layers = sorted({p[0] for p in pairs})
    for at, layer in enumerate(layers if per_layer else [-1]):
        near = set(layers[max(0, at - radius):at + radius + 1])
        mine = [p for p in pairs if p[0] in near or not per_layer]
        best: tuple[float, tuple[str, ...]] | None = None
        for setting, points in mass.items():
            if floors is not None and setting[2] not in floors:
                continue
            if not all(p in points and points[p][0] >= margin for p in mine):
                continue
            skip = sum(points[p][1] for p in mine) / len(mine)
            if best is None or skip > best[0]:
                best = (skip, setting)
        if best is not None:
            for at in [layer] if per_layer else layers:
                chosen[at] = best[1]
    return chosen


def best_fixed(fixed: Table, pairs: list[Pair]) -> tuple[float, float]:
    """(swept, interpolated) mean skip of the best fixed budget with mean recall >= TARGET."""
    curve = sorted((sum(pts[p][1] for p in pairs) / len(pairs),
                    sum(pts[p][0] for p in pairs) / len(pairs))
                   for pts in fixed.values() if all(p in pts for p in pairs))
    swept = max((s for s, r in curve if r >= TARGET), default=float("nan"))
    interpolated = swept
    for (s1, r1), (s2, r2) in itertools.pairwise(curve):
        if r1 >= TARGET > r2:
            interpolated = max(interpolated, s1 + (s2 - s1) * (r1 - TARGET) / (r1 - r2))
    return swept, interpolated


def report(calib_rows: list[dict[str, str]], test_rows: list[dict[str, str]], margin: float,
           floors: set[str] | None, budget: str = "mass", per_layer: bool = True,
           lag: str = "1", setting: tuple[str, ...] | None = None,
           radius: int = 0) -> list[str]:
    header = ("| method | g | test pairs >= 0.95 | test mean skip | test mean recall | "
              "best fixed (swept / interpolated) skip |")
    scope = ("one setting" if not per_layer else
             f"per layer with {radius} on each side" if radius else "per layer")
    floors_text = sorted(floors) if floors else "all"
    out = [f"budget {budget}, {scope}, margin {margin}, floors {floors_text}", header,
           "| --- | --- | --- | --- | --- | --- |"]
    methods = sorted({(r["method"], r["g"]) for r in test_rows
                      if r["budget"] == budget and r["lag"] == lag})
    for method, g in methods:
        cm, _ = tables(calib_rows, method, g, budget, lag)
        tm, tf = tables(test_rows, method, g, budget, lag)
        cpairs = sorted({p for pts in cm.values() for p in pts})
        tpairs = sorted({p for pts in tm.values() for p in pts})
        if setting is not None:
            if setting not in tm:
                continue
            chosen = {p[0]: setting for p in tpairs}
        else:
            chosen = calibrate(cm, cpairs, margin, floors, per_layer, radius)
        covered = [p for p in tpairs if p[0] in chosen]
        points = [tm[chosen[p[0]]][p] for p in covered]
        uncalibrated = len({p[0] for p in tpairs} - set(chosen))
        if not points:
            swept, interpolated = best_fixed(tf, tpairs)
            out.append(f"| {method} | {g} | no layer calibrated | | | {_skip(swept)} / "
                       f"{_skip(interpolated)} |")
            continue
        # The fixed budget on the pairs the adaptive one is reported on: a layer without a
        # setting leaves its pairs out of both sides of the comparison.
        swept, interpolated = best_fixed(tf, covered)
        ok = sum(r >= TARGET for r, _ in points)
        skip = sum(s for _, s in points) / len(points)
        recall = sum(r for r, _ in points) / len(points)
        note = f" ({uncalibrated} layers without a setting)" if uncalibrated else ""
        out.append(f"| {method} | {g} | {ok} of {len(points)}{note} | {skip:.3f} | "
                   f"{recall:.3f} | {_skip(swept)} / {_skip(interpolated)} |")
    return out


def _skip(x: float) -> str:
    """A fixed budget's skip; "—" where no swept budget reaches TARGET on average."""
    return "—" if math.isnan(x) else f"{x:.3f}"


def settings(calib_rows: list[dict[str, str]], margin: float, floors: set[str] | None,
             budget: str = "mass", lag: str = "1", radius: int = 0) -> dict[str, object]:
    """The per-layer settings calibrated on `calib_rows`, for an engine to send as
    SelectOptions.mass_layers (epsd's per-layer mass budget): per (method, g), per layer,
    mass_target, mass_temperature and floor (a share of the layer's unforced groups: the
    engine turns it into min_pages = round(floor · unforced groups) at each step)."""
    out: dict[str, object] = {"budget": budget, "margin": margin, "lag": lag,
                              "mass_scope": "list" if budget == "massunion" else "head"}
    found: dict[str, dict[str, dict[str, float]]] = {}
    for method, g in sorted({(r["method"], r["g"]) for r in calib_rows
                             if r["budget"] == budget and r["lag"] == lag}):
        mass, _ = tables(calib_rows, method, g, budget, lag)
        pairs = sorted({p for pts in mass.values() for p in pts})
        chosen = calibrate(mass, pairs, margin, floors, True, radius)
        found[f"{method} g={g}"] = {
            str(layer): {"mass_target": float(p), "mass_temperature": float(tau),
                         "floor": float(floor)}
            for layer, (p, tau, floor) in sorted(chosen.items())}
    out["settings"] = found
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calibrate", required=True, help="comma-separated globs of unit CSVs")
    ap.add_argument("--test", default="", help="globs of unit CSVs (default: --split-steps)")
    ap.add_argument("--split-steps", type=index_list, default=None,
                    help="calibration steps, e.g. 0,2,4")
    ap.add_argument("--margin", type=unit_interval, default=0.97,
                    help="the recall a setting must reach on every calibration pair, (0, 1]")
    ap.add_argument("--floors", type=_floor_list, default=None,
                    help="e.g. 0,0.05: floors the calibration rows hold (default: every swept "
                         "floor)")
    ap.add_argument("--budget", choices=("mass", "massunion"), default="mass")
    ap.add_argument("--scope", choices=("layer", "all"), default="layer")
    ap.add_argument("--radius", type=non_negative_int, default=0,
                    help="with --scope=layer: pool each layer's pairs with N layers each side")
    ap.add_argument("--lag", type=non_negative_int, default=1,
                    help="the rows' lag (one the CSVs hold: run_quality writes 0 and 1)")
    ap.add_argument("--setting", type=_setting, default=None,
                    help="p,τ,floor as in the CSVs: no calibration")
    ap.add_argument("--emit", type=_emit_path, default=None,
                    help="also write the per-layer settings calibrated on the calibration "
                         "pairs as JSON here (SelectOptions.mass_layers for an engine)")
    a = ap.parse_args(argv)
    lag = str(a.lag)
    try:
        if a.test:
            calib, test = load(a.calibrate), load(a.test)
        else:
            if a.split_steps is None:
                ap.error("give --test or --split-steps")
            steps = set(a.split_steps)
            rows = load(a.calibrate)
            calib = [r for r in rows if int(r["step"]) in steps]
            test = [r for r in rows if int(r["step"]) not in steps]
    except ValueError as e:
        ap.error(str(e))
    if not calib or not test:
        ap.error(f"no {'calibration' if not calib else 'test'} rows: the globs match no unit "
                 "CSV with rows, or --split-steps leaves nothing on one side")
    floors = None
    if a.floors is not None:
        # By value, in the CSVs' spelling: "0" was compared as text with the rows' "0.0" and
        # matched nothing, and a floor never swept was taken, both leaving every layer
        # uncalibrated (and --emit an empty setting) with exit 0.
        swept = {r["floor"] for r in calib if r["budget"] == a.budget and r["lag"] == lag}
        floors = {f for f in swept if float(f) in a.floors}
        if missing := sorted(set(a.floors) - {float(f) for f in floors}):
            ap.error(f"--floors: {', '.join(f'{f:g}' for f in missing)} not among the "
                     f"calibration rows' floors at --budget={a.budget} --lag={lag} "
                     f"({', '.join(sorted(swept, key=float)) or 'none'})")
    # What would otherwise print a table without a row, exit 0.
    lags = sorted({r["lag"] for r in test if r["budget"] == a.budget})
    if lag not in lags:
        ap.error(f"--lag={lag}: the test rows have no --budget={a.budget} row at this lag "
                 f"(their lags: {', '.join(lags) or 'none'})")
    if a.setting is not None and not any(
            (r["param"], r["temperature"], r["floor"]) == a.setting for r in test
            if r["budget"] == a.budget and r["lag"] == lag):
        ap.error(f"--setting={','.join(a.setting)}: no test row of --budget={a.budget} at "
                 f"--lag={lag} has this p,τ,floor (write them as the CSVs do)")
    print("\n".join(report(calib, test, a.margin, floors, a.budget, a.scope == "layer", lag,
                            a.setting, a.radius)))
    if a.emit is not None:
        a.emit.write_text(json.dumps(
            settings(calib, a.margin, floors, a.budget, lag, a.radius), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
