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
