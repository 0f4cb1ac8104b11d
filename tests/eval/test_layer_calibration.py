"""Tests of the per-layer calibration of the mass budget (eval/eps_eval/layer_calibration.py).

The `rng` fixture (conftest.py) prints its seed; EPS_TEST_SEED=N replays it.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from eps_eval import layer_calibration as lc


def _row(layer: int, step: int, budget: str, param: float, recall: float, skip: float,
         tau: float = 1.0, floor: float = 0.0) -> dict[str, str]:
    return {"method": "questclt", "g": "2", "lag": "1", "layer": str(layer), "context": "8192",
            "step": str(step), "budget": budget, "param": str(param), "temperature": str(tau),
            "floor": str(floor), "recall": str(recall), "skip": str(skip)}


def test_each_layer_gets_the_most_frugal_setting_that_is_safe_on_all_its_pairs(
        rng: np.random.Generator) -> None:
    rows = []
    targets = [0.9, 0.95, 0.99]
    # Layer L: target p gives recall p + 0.02·L - 0.01·step; skip falls as p rises.
    for layer in range(3):
        for step in range(4):
            for p in targets:
                noise = float(rng.uniform(-0.001, 0.001))
                rows.append(_row(layer, step, "mass", p, p + 0.02 * layer - 0.01 * step + noise,
                                 1.0 - p + noise))
    mass, _ = lc.tables(rows, "questclt", "2")
    pairs = sorted({p for pts in mass.values() for p in pts})
    chosen = lc.calibrate(mass, pairs, 0.95, None)
    # Worst step is 3 (−0.03): layer 0 needs p with p − 0.03 ≥ 0.95, none of the targets
    # but 0.99; layer 1 (+0.02) needs p ≥ 0.96: 0.99; layer 2 (+0.04) needs p ≥ 0.94: 0.95.
    assert {layer: float(s[0]) for layer, s in chosen.items()} == {0: 0.99, 1: 0.99, 2: 0.95}


def test_a_layer_with_no_safe_setting_is_left_out() -> None:
    rows = [_row(0, s, "mass", 0.9, 0.8, 0.5) for s in range(2)]
    mass, _ = lc.tables(rows, "questclt", "2")
    assert lc.calibrate(mass, sorted(next(iter(mass.values()))), 0.95, None) == {}


def test_the_fixed_budget_is_interpolated_between_the_points_around_the_target() -> None:
    # Two pairs; budget A: recall 0.97 at skip 0.5, budget B: recall 0.93 at skip 0.7.
    rows = []
    for step in range(2):
        rows.append(_row(0, step, "threshold", 10, 0.97, 0.5))
        rows.append(_row(0, step, "threshold", 5, 0.93, 0.7))
    _, fixed = lc.tables(rows, "questclt", "2")
    pairs = sorted({p for pts in fixed.values() for p in pts})
    swept, interpolated = lc.best_fixed(fixed, pairs)
    assert swept == pytest.approx(0.5)
    assert interpolated == pytest.approx(0.6)  # halfway: 0.95 is halfway from 0.97 to 0.93


def test_one_setting_for_all_layers_is_the_most_frugal_safe_on_every_layer() -> None:
    # Layer 0 is safe at p = 0.9, layer 1 only at 0.95: per layer 0.9 and 0.95, one for all 0.95.
    rows = []
    for step in range(2):
        rows.append(_row(0, step, "massunion", 0.9, 0.96, 0.6))
        rows.append(_row(0, step, "massunion", 0.95, 0.98, 0.5))
        rows.append(_row(1, step, "massunion", 0.9, 0.93, 0.6))
        rows.append(_row(1, step, "massunion", 0.95, 0.97, 0.5))
    mass, _ = lc.tables(rows, "questclt", "2", budget="massunion")
    assert lc.tables(rows, "questclt", "2")[0] == {}  # the per-head budget's rows: none here
    pairs = sorted({p for pts in mass.values() for p in pts})
    per_layer = lc.calibrate(mass, pairs, 0.95, None)
    assert {layer: float(s[0]) for layer, s in per_layer.items()} == {0: 0.9, 1: 0.95}
    one = lc.calibrate(mass, pairs, 0.95, None, per_layer=False)
    assert {layer: float(s[0]) for layer, s in one.items()} == {0: 0.95, 1: 0.95}


def test_a_radius_pools_each_layers_pairs_with_its_neighbours() -> None:
    # Layers 0, 5, 10: 5 is safe at p = 0.9 alone, 10 only at 0.95; with radius 1, layer 5
    # (pooled with 0 and 10) and 10 (with 5) take 0.95, layer 0 (with 5) keeps 0.9.
    rows = []
    for layer, safe_low in ((0, True), (5, True), (10, False)):
        for step in range(2):
            rows.append(_row(layer, step, "massunion", 0.9, 0.96 if safe_low else 0.93, 0.6))
            rows.append(_row(layer, step, "massunion", 0.95, 0.98, 0.5))
    mass, _ = lc.tables(rows, "questclt", "2", budget="massunion")
    pairs = sorted({p for pts in mass.values() for p in pts})
    alone = lc.calibrate(mass, pairs, 0.95, None)
    assert {layer: float(s[0]) for layer, s in alone.items()} == {0: 0.9, 5: 0.9, 10: 0.95}
    pooled = lc.calibrate(mass, pairs, 0.95, None, radius=1)
    assert {layer: float(s[0]) for layer, s in pooled.items()} == {0: 0.9, 5: 0.95, 10: 0.95}


def test_a_given_setting_is_reported_without_calibration() -> None:
    rows = [_row(0, s, "massunion", 0.95, 0.96, 0.4) for s in range(2)]
    rows += [_row(0, s, "threshold", 8, 0.95, 0.3) for s in range(2)]
    for r in rows:
        r["lag"] = "0"
    lines = lc.report(rows, rows, 0.99, None, "massunion", lag="0",
                      setting=("0.95", "1.0", "0.0"))
    assert lines[-1].split("|")[3:6] == [" 2 of 2 ", " 0.400 ", " 0.960 "]
    assert lc.report(rows, rows, 0.99, None, "massunion", lag="1")[-1].startswith("| ---")


def test_emitted_settings_are_the_per_layer_choice(tmp_path) -> None:
    rows = []
    for step in range(2):
        rows.append(_row(0, step, "mass", 0.9, 0.97, 0.6))
        rows.append(_row(0, step, "mass", 0.99, 0.99, 0.3, tau=2.0, floor=0.05))
        rows.append(_row(1, step, "mass", 0.9, 0.90, 0.6))
        rows.append(_row(1, step, "mass", 0.99, 0.99, 0.3, tau=2.0, floor=0.05))
    out = lc.settings(rows, 0.95, None)
    assert out["mass_scope"] == "head"
    assert out["settings"] == {"questclt g=2": {
        "0": {"mass_target": 0.9, "mass_temperature": 1.0, "floor": 0.0},
        "1": {"mass_target": 0.99, "mass_temperature": 2.0, "floor": 0.05}}}
    # The command line writes the same, calibrated on the --split-steps pairs.
    csv_path = tmp_path / "q19_real_8192_L0.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    json_path = tmp_path / "settings.json"
    assert lc.main(["--calibrate", str(csv_path), "--split-steps", "0", "--margin", "0.95",
                    "--emit", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["settings"] == out["settings"]


def _unit_csv(tmp_path, rows: list[dict[str, str]]):
    path = tmp_path / "q19_real_8192_L0.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.mark.parametrize(("args", "said"), [
    (["--split-steps=a,b"], "--split-steps"),
    (["--split-steps=0", "--margin=nan"], "--margin"),
    (["--split-steps=0", "--lag=-1"], "--lag"),
    (["--split-steps=0", "--lag=7"], "--lag=7: the test rows have no --budget=mass row"),
    (["--split-steps=0", "--setting=bad"], "--setting"),
    (["--split-steps=0", "--setting=0.5,1.0,0.0"], "--setting=0.5,1.0,0.0: no test row"),
    (["--split-steps=0", "--emit=/nonexistent/dir/x.json"], "--emit"),
    (["--split-steps=0", "--floors=x"], "--floors"),
    (["--split-steps=0", "--floors=1.5"], "--floors"),
    # a floor never swept left every layer uncalibrated, exit 0
    (["--split-steps=0", "--floors=0.05"],
     "--floors: 0.05 not among the calibration rows' floors at --budget=mass --lag=1 (0.0)"),
])
def test_a_bad_command_line_is_an_argparse_error_before_any_output(
        tmp_path, capsys: pytest.CaptureFixture[str], args: list[str], said: str) -> None:
    # Once tracebacks, or an empty table with exit 0 (eps_eval/args.py's promise: exit 2).
    rows = [_row(0, s, "mass", 0.9, 0.97, 0.6) for s in range(2)]
    path = _unit_csv(tmp_path, rows)
    with pytest.raises(SystemExit) as e:
        lc.main([f"--calibrate={path}", *args])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert said in err, err
    assert out == ""


def test_what_is_no_unit_csv_is_named(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "units").mkdir()
    wrong = tmp_path / "settings.json"
    wrong.write_text(json.dumps({"settings": {}}) + "\n")
    rows = [_row(0, s, "mass", 0.9, 0.97, 0.6) for s in range(2)]
    path = _unit_csv(tmp_path, rows)
    for args, said in (([f"--calibrate={tmp_path / 'units'}", "--split-steps=0"],
                        "is not a file"),
                       ([f"--calibrate={path}", f"--test={wrong}"],
                        f"{wrong} is not a unit CSV of run_quality")):
        with pytest.raises(SystemExit) as e:
            lc.main(args)
        assert e.value.code == 2
        assert said in capsys.readouterr().err


def test_the_fixed_budget_is_compared_on_the_pairs_of_the_layers_with_a_setting() -> None:
    # Layer 0 has a safe setting, layer 1 none. The fixed budget reaches 0.95 on average
    # over layer 0's pairs at both budgets, over all pairs only at the larger one: compared
    # on every test pair it read 0.5, as if layer 1's pairs had been tested.
    rows = []
    for step in range(2):
        rows.append(_row(0, step, "mass", 0.95, 0.96, 0.6))
        rows.append(_row(1, step, "mass", 0.95, 0.80, 0.6))
        for layer, small in ((0, 0.96), (1, 0.90)):
            rows.append(_row(layer, step, "threshold", 5, small, 0.7))
            rows.append(_row(layer, step, "threshold", 10, 0.99, 0.5))
    out = lc.report(rows, rows, 0.95, None)
    assert out[-1] == "| questclt | 2 | 2 of 2 (1 layers without a setting) | 0.600 | 0.960 | " \
                      "0.700 / 0.700 |", out


def test_a_fixed_budget_that_never_reaches_the_target_is_a_dash_not_nan() -> None:
    rows = [_row(0, s, b, 0.95, 0.9, 0.6) for s in range(2) for b in ("mass", "threshold")]
    out = lc.report(rows, rows, 0.95, None)
    assert out[-1] == "| questclt | 2 | no layer calibrated | | | — / — |", out


def test_floors_are_matched_by_value_not_spelling(tmp_path, capsys) -> None:
    # --floors=0 was compared as text with the rows' "0.0": no setting matched, and every
    # layer was reported uncalibrated (exit 0).
    rows = [_row(0, s, "mass", 0.9, 0.97, 0.6) for s in range(2)]
    rows += [_row(0, s, "threshold", 5, 0.97, 0.6) for s in range(2)]
    path = _unit_csv(tmp_path, rows)
    tables = []
    for floors in ("0", "0.0"):
        assert lc.main([f"--calibrate={path}", "--split-steps=0", f"--floors={floors}"]) == 0
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1]
    assert "no layer calibrated" not in tables[0] and "| 1 of 1 |" in tables[0], tables[0]
