"""The issue-19 reports read several runs' units directories (--units) as one gathered
directory, and refuse a unit found in two of them."""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest
from eps_eval import report_fbmem, report_quality

# Committed units of two Gemma runs' contexts (docs/eval/issue19-estimators.md).
UNITS = Path(__file__).resolve().parents[2] / "docs/eval/q19est/gemma-16k-32k-36-units.tar.xz"
RUNS = {"run16k": "q19_gemma_16384_L5.csv", "run32k": "q19_gemma_32768_L5.csv"}


@pytest.fixture()
def runs(tmp_path: Path) -> Path:
    """tmp_path/run16k/units and tmp_path/run32k/units, one unit each as two runs' --out
    would hold them, and tmp_path/all/units with both, as `cp` gathered them."""
    with tarfile.open(UNITS) as tar:
        for run, name in RUNS.items():
            (tmp_path / run / "units").mkdir(parents=True)
            member = tar.extractfile(f"./units/{name}")
            assert member is not None
            (tmp_path / run / "units" / name).write_bytes(member.read())
    (tmp_path / "all" / "units").mkdir(parents=True)
    for run, name in RUNS.items():
        shutil.copy(tmp_path / run / "units" / name, tmp_path / "all" / "units")
    return tmp_path


def test_report_quality_reads_several_units_directories_as_the_gathered_one(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_quality.main([f"--out={runs / 'all'}"]) == 0
    # --out is created for the report; the glob's order does not matter.
    out = runs / "report" / "q19"
    assert report_quality.main([f"--out={out}", "--units", str(runs / "run32k" / "units"),
                                str(runs / "run16k" / "units")]) == 0
    gathered = (runs / "all" / "quality.md").read_text()
    assert "gemma" in gathered
    assert (out / "quality.md").read_text() == gathered
    assert not (out / "units").exists()


def test_report_fbmem_reads_several_units_directories_as_the_gathered_one(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_fbmem.main([f"--out={runs / 'all'}"]) == 0
    gathered = capsys.readouterr().out
    assert "context 16384" in gathered and "context 32768" in gathered
    assert report_fbmem.main(["--units", str(runs / "run16k" / "units"),
                              "--units", str(runs / "run32k" / "units")]) == 0
    assert capsys.readouterr().out == gathered


@pytest.mark.parametrize("module", [report_quality, report_fbmem])
def test_a_unit_in_two_units_directories_is_refused_naming_both(
        runs: Path, capsys: pytest.CaptureFixture[str], module) -> None:
    # Counted twice, its pairs would weigh double in every mean.
    out = runs / "report"
    with pytest.raises(SystemExit) as e:
        module.main([f"--out={out}", "--units", str(runs / "run16k" / "units"),
                     str(runs / "all" / "units")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (f"{RUNS['run16k']} is in both {runs / 'run16k' / 'units'} and "
            f"{runs / 'all' / 'units'}") in err, err
    assert not out.exists()


@pytest.mark.parametrize("module", [report_quality, report_fbmem])
def test_a_missing_units_directory_is_refused_by_name(
        runs: Path, capsys: pytest.CaptureFixture[str], module) -> None:
    missing = runs / "nowhere" / "units"
    with pytest.raises(SystemExit) as e:
        module.main([f"--out={runs / 'report'}", "--units", str(runs / "run16k" / "units"),
                     str(missing)])
    assert e.value.code == 2
    assert f"--units {missing}: no such directory" in capsys.readouterr().err
    assert not (runs / "report").exists()


# Hand-made rows as report_quality.load gives them (the NUMERIC columns as floats).
def _row(layer: int, lag: int, param: float, skip: float, recall: float, *,
         method: str = "quest", g: int = 1, budget: str = "threshold",
         summary_frac: float = 0.0) -> dict[str, object]:
    return {"workload": "real", "kind": "smollm2", "context": 8192.0, "layer": float(layer),
            "step": 0.0, "budget": budget, "method": method, "g": float(g), "lag": float(lag),
            "param": param, "temperature": 0.0, "floor": 0.0, "recall": recall, "skip": skip,
            "summary_frac": summary_frac, "visited": 1.0 - skip - summary_frac}


def _sweep(layer: int, lag: int, skips: tuple[float, ...], recalls: tuple[float, ...],
           **kw: object) -> list[dict[str, object]]:
    """A pair's sweep (params 1, 2, …) at one lag."""
    return [_row(layer, lag, float(i + 1), s, r, **kw)  # type: ignore[arg-type]
            for i, (s, r) in enumerate(zip(skips, recalls))]


def _cells(lines: list[str], start: str) -> list[str]:
    """The cells after `start` of the one table line that begins with it."""
    found = [line for line in lines if line.startswith(start)]
    assert len(found) == 1, (start, lines)
    return [c.strip() for c in found[0][len(start):].strip(" |").split(" | ")]


def _reuse_units(lags: tuple[int, ...]) -> list[dict[str, object]]:
    """Two pairs; at lag l pair 0's sweep recalls 0.9 and 0.7 less 0.02·(l − 1), pair 1's
    0.8 and 0.6 less 0.04·(l − 1); both sweeps' skips are 0.5 and 1.0 at lags 1 and 2, 0.6
    and 1.0 at lags 3 and 4."""
    rows = []
    for lag in lags:
        skips = (0.5, 1.0) if lag <= 2 else (0.6, 1.0)
        rows += _sweep(0, lag, skips, (0.9 - 0.02 * (lag - 1), 0.7 - 0.02 * (lag - 1)))
        rows += _sweep(1, lag, skips, (0.8 - 0.04 * (lag - 1), 0.6 - 0.04 * (lag - 1)))
    return rows


def _two_pairs(x: float, y: float) -> tuple[float, float, int]:
    """Mean and 95 % half-width of two pairs' values: 1.96 · (|x − y| / √2) / √2."""
    return (x + y) / 2, 0.98 * abs(x - y), 2


def test_reuse_with_lag_1_only_has_no_k_2_or_4() -> None:
    # An estimators-plan run measures lag 1 only: k = 2 and 4 used to repeat k = 1's value
    # (the mean over "lags 1…k" of the lags there were), printed as if measured.
    rows = _reuse_units((1,))
    cells = _cells(report_quality.table_reuse(rows, ("quest",), (1,)), "| real | 8192 | quest | 1 |")
    mean, half, _ = _two_pairs(0.8, 0.7)
    assert cells == [f"{mean:.3f} ± {half:.3f}", "—", "—"]
    for k in (2, 4):
        assert report_quality.reuse_rows(rows, k) == ([], 0)


def test_reuse_averages_every_lag_1_to_k_at_each_sweep_point() -> None:
    rows = _reuse_units((0, 1, 2, 3, 4))  # lag 0 is no reuse: left out of every k
    # k = 1 and 2: both sweeps' skips 0.5 and 1.0, so 75 % is halfway: pair 0 0.8, then
    # (0.8 + 0.78) / 2; pair 1 0.7, then (0.7 + 0.66) / 2.
    want = {1: _two_pairs(0.8, 0.7), 2: _two_pairs(0.79, 0.68)}
    # k = 4: skips average to 0.55 and 1.0, so 75 % is 4/9 of the way; the recalls to
    # 0.87 and 0.67 (pair 0), 0.74 and 0.54 (pair 1).
    t = (0.75 - 0.55) / (1.0 - 0.55)
    want[4] = _two_pairs(0.87 + t * (0.67 - 0.87), 0.74 + t * (0.54 - 0.74))
    for k, (mean, half, n) in want.items():
        avg, pairs = report_quality.reuse_rows(rows, k)
        assert pairs == 2
        got = report_quality.at_skip(avg)
        assert got == (pytest.approx(mean, abs=1e-12), pytest.approx(half, abs=1e-12), n), k
    cells = _cells(report_quality.table_reuse(rows, ("quest",), (1,)), "| real | 8192 | quest | 1 |")
    assert cells == [f"{want[k][0]:.3f} ± {want[k][1]:.3f}" for k in (1, 2, 4)]


def test_reuse_leaves_out_a_pair_short_of_a_lag_and_says_so() -> None:
    rows = [r for r in _reuse_units((1, 2, 3, 4))
            if not (r["layer"] == 1.0 and r["lag"] == 3.0)]  # pair 1 lacks lag 3
    # A missing lag at one sweep point is as short: pair 0's second point lacks lag 2.
    short = [r for r in rows if not (r["layer"] == 0.0 and r["lag"] == 2.0 and r["param"] == 2.0)]
    assert report_quality.reuse_rows(rows, 4)[1] == 1
    assert report_quality.reuse_rows(short, 2)[1] == 1
    cells = _cells(report_quality.table_reuse(rows, ("quest",), (1,)), "| real | 8192 | quest | 1 |")
    t = (0.75 - 0.55) / (1.0 - 0.55)
    alone = 0.87 + t * (0.67 - 0.87)  # pair 0 alone: no interval over one pair
    assert cells[2] == f"{alone:.3f} (1 of 2 pairs)"
    cells = _cells(report_quality.table_reuse(short, ("quest",), (1,)), "| real | 8192 | quest | 1 |")
    assert cells[1] == f"{(0.7 + 0.66) / 2:.3f} (1 of 2 pairs)"


def _fbmem_units() -> list[dict[str, object]]:
    """Two pairs (their oracle recalling `top` and top − 0.1 at skips 0.5 and 1.0): the exact
    lag-1 mass at g = 1 and 2, and two c2f rows whose sweeps pass 75 % skipped."""
    rows: list[dict[str, object]] = []
    for layer, top in ((0, 1.0), (1, 0.9)):
        rows += _sweep(layer, 0, (0.5, 1.0), (top, top - 0.1), method="oracle_mass")
        rows += _sweep(layer, 1, (0.5, 1.0), (top - 0.02, top - 0.1),
                       method="oracle_mass_lag")
        rows += _sweep(layer, 1, (0.6, 0.9), (top - 0.2, top - 0.4), method="oracle_mass_lag",
                       g=2)
        for name, drop in (("fbmem1-c2f4x2-q", 0.04), ("fbmem1-c2f8x3-q", 0.06)):
            rows += _sweep(layer, 1, (0.5, 0.75, 1.0),
                           (top - drop, top - (drop + 0.1) / 2, top - 0.1), budget="c2f",
                           method=name, summary_frac=0.02)
    return rows


def test_fbmem_table_gives_each_g_its_own_row_and_prints_no_nan() -> None:
    # At 75 % skipped the oracle recalls top − 0.05 on each pair; the exact lag-1 mass
    # top − 0.06 at g = 1, and top − 0.3 at g = 2 (halfway from 0.6 to 0.9). The two used to
    # be one row, both sweeps interpolated as one.
    lines = report_fbmem.table(_fbmem_units(), base_prefix="fbmem1-c2f4x2")
    assert _cells(lines, "| oracle_mass_lag (g = 1) |") == [
        "0.0100 ± 0.0000", "+0.0100 ± 0.0000", "—", "—"]
    assert _cells(lines, "| oracle_mass_lag (g = 2) |") == [
        "0.2500 ± 0.0000", "-0.2300 ± 0.0000", "—", "—"]
    # The base's own row has no gain; bytes 0.02 of dense over quest fp16's 1/16. No union
    # oracle in these units: "—", not "nan ± nan".
    assert _cells(lines, "| fbmem1-c2f4x2-q |") == ["0.0200 ± 0.0000", "", "0.32", "—"]
    assert _cells(lines, "| fbmem1-c2f8x3-q |") == ["0.0300 ± 0.0000", "-0.0100 ± 0.0000",
                                                   "0.32", "—"]


def test_fbmem_base_that_starts_several_rows_is_refused() -> None:
    # Their sweeps would be interpolated as one base.
    with pytest.raises(ValueError, match="--base=fbmem1-c2f starts 2 rows"):
        report_fbmem.table(_fbmem_units(), base_prefix="fbmem1-c2f")


def test_rows_of_two_sweeps_in_one_pair_are_refused_not_interpolated_together() -> None:
    g1 = _sweep(0, 1, (0.5, 1.0), (0.9, 0.7))
    g2 = _sweep(0, 1, (0.6, 0.9), (0.8, 0.5), g=2)
    with pytest.raises(ValueError, match="not one sweep"):
        report_quality.at_skip(g1 + g2)
    # One unit read twice: each point twice.
    with pytest.raises(ValueError, match="2 distinct"):
        report_quality.at_skip(g1 + g1)
    assert report_quality.at_skip(g1)[0] == pytest.approx(0.8)


def test_a_pair_whose_rows_two_units_hold_is_refused_before_the_report(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One run's units per layer, and the same run's pairs gathered into one file beside
    # them: each point of layer 5 twice, its sweep interpolated through both.
    units = runs / "run16k" / "units"
    name = RUNS["run16k"]
    (units / "q19_gemma_16384.csv").write_bytes((units / name).read_bytes())
    out = runs / "report"
    with pytest.raises(SystemExit) as e:
        report_quality.main([f"--out={out}", "--units", str(units)])
    assert e.value.code == 2
    assert "its rows are not one sweep" in capsys.readouterr().err
    assert not out.exists()


def test_sweep_points_of_pairs_with_sweeps_of_different_lengths_are_refused() -> None:
    # The k-th point stands for one share of the groups in every pair; with a pair short of
    # a point, the last mean was over the longer pairs alone.
    rows = _sweep(0, 1, (0.5, 0.7, 1.0), (0.9, 0.8, 0.7)) + _sweep(1, 1, (0.5, 1.0), (0.9, 0.7))
    with pytest.raises(ValueError, match="real 8192 quest g = 1, lag 1: .* 2 or 3 points"):
        report_quality.curve(rows)
    with pytest.raises(ValueError, match="real 8192 quest g = 1, lag 1: .* 2 or 3 points"):
        report_quality.fixed_skip_at_recall(rows, 0.95)
    x, y = report_quality.curve(rows[:3] + _sweep(1, 1, (0.5, 0.8, 1.0), (0.9, 0.8, 0.6)))
    assert x.tolist() == pytest.approx([0.5, 0.75, 1.0]) and y.tolist() == pytest.approx(
        [0.9, 0.8, 0.65])


def test_methods_table_names_a_cell_over_fewer_pairs_and_prints_no_nan() -> None:
    rows = (_sweep(0, 0, (0.5, 1.0), (1.0, 0.9), method="oracle_mass")
            + _sweep(1, 0, (0.5, 1.0), (1.0, 0.8), method="oracle_mass")
            + _sweep(0, 1, (0.5, 1.0), (0.9, 0.7))  # quest: pair 0 only
            + _sweep(0, 1, (0.5, 1.0), (0.9, 0.7), method="quest8")
            + _sweep(1, 1, (0.5, 1.0), (0.8, 0.6), method="quest8")
            # c2f with no sweep point near 75 % skipped: its bytes are "—", not "nan".
            + _sweep(0, 1, (0.1, 0.2), (0.9, 0.8), budget="c2f", method="c2f16x2")
            + _sweep(1, 1, (0.1, 0.2), (0.9, 0.8), budget="c2f", method="c2f16x2"))
    lines = report_quality.table_methods(rows, 1)
    assert "### real, context 8192, lag 1; pairs: 2; mass oracle at g = 1: 0.925 ± 0.049" \
        in "\n".join(lines)
    assert _cells(lines, "| quest |") == ["0.800 (1 of 2 pairs)"]
    assert _cells(lines, "| quest8 |") == ["0.750 ± 0.098"]
    assert _cells(lines, "| c2f16x2 |") == ["—", "—"]


def test_passkeys_count_retrieved_where_dense_does_over_the_prompts_a_variant_ran(
        tmp_path: Path) -> None:
    units = tmp_path / "units"
    units.mkdir()
    head = "prompt,method,g,correct,visited\n"
    rows = ["p1,dense,1,1,1", "p2,dense,1,1,1", "p3,dense,1,0,1",
            "p1,quest,1,1,0.25", "p2,quest,1,0,0.25", "p3,quest,1,1,0.25",
            "p1,questclt,2,1,0.25"]  # questclt ran p1 only
    (units / "q19gemma_passkey_4096.csv").write_text(head + "\n".join(rows) + "\n")
    lines = report_quality.table_passkeys([units])
    assert _cells(lines, "| quest, g = 1 |") == ["2 of 3", "1 of 2", "0.250"]
    # One dense-retrieved prompt run, one retrieved: not "1 of 2", as if it missed p2.
    assert _cells(lines, "| questclt, g = 2 |") == ["1 of 1", "1 of 1", "0.250"]


def test_estimators_table_gives_a_gain_over_one_pair_no_nan_interval() -> None:
    rows = (_sweep(0, 0, (0.5, 1.0), (1.0, 0.9), method="oracle_mass")
            + _sweep(1, 0, (0.5, 1.0), (1.0, 0.8), method="oracle_mass")
            + _sweep(0, 1, (0.5, 1.0), (0.9, 0.7), method="quest8")
            + _sweep(1, 1, (0.5, 1.0), (0.8, 0.6), method="quest8")
            + _sweep(0, 1, (0.5, 1.0), (0.95, 0.75), method="questclt1"))  # pair 0 only
    lines = report_quality.table_estimators(rows)
    # Paired over the one pair both have: +0.05, no interval (it printed "± nan").
    assert _cells(lines, "| questclt1 |") == ["0.850 (1 of 2 pairs) (+0.050 (1 of 2 pairs))"]
