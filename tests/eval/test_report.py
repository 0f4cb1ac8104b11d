"""eps_eval.report (summary.md of a run): a value the units do not hold is "—", never 0."""

from __future__ import annotations

import json
from pathlib import Path

from eps_eval import report


def test_a_unit_without_its_time_is_a_dash_not_zero_seconds(tmp_path: Path) -> None:
    units = tmp_path / "units"
    units.mkdir()
    for name, meta in (("real_2048_L0", {"seconds": 9.6}), ("real_2048_L5", {})):
        (units / f"{name}.csv").write_text("workload\n")  # no rows: nothing to aggregate
        (units / f"{name}.json").write_text(json.dumps(meta))
    report.write(tmp_path)
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert "| real_2048_L0 | 10 |" in lines
    assert "| real_2048_L5 | — |" in lines, lines[-3:]
