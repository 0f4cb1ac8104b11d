"""Prints a markdown table of eps-load JSON reports (one row per file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _row(path: Path, report: dict[str, Any]) -> str:
    sel, ping, cfg = report["select"], report["ping"], report["config"]
    ratio = report["ratio"]["p50"]
    target = "uds" if cfg["target"].startswith("unix://") else "tcp"
    errors = sel["errors"] + ping["errors"]
    load = report["machine"]["loadavg_start"].split(" ")[0]

    def us(block: dict[str, Any], key: str) -> str:
        value = block.get(key)
        return "-" if value is None else f"{value:.0f}"

    reply = " async" if cfg.get("reply") == "async" else ""
    return (
        f"| {path.stem} | {target} {cfg['mode']}{reply} | {cfg['sessions']} | {cfg['rate']} | "
        f"{sel['rps']:.0f} | {us(sel, 'p50_us')} | {us(sel, 'p90_us')} | {us(sel, 'p99_us')} | "
        f"{us(sel, 'p999_us')} | {us(sel, 'max_us')} | {us(ping, 'p50_us')} | "
        f"{us(ping, 'p99_us')} | {'-' if ratio is None else f'{ratio:.1f}'} | "
        f"{us(report['server'], 'prepass_p50_us')} | {us(report['server'], 'overhead_p50_us')} | "
        f"{errors} | {load} |"
    )


def main(paths: list[str]) -> int:
    print(
        "| run | transport | sessions | rate | select rps | p50 µs | p90 µs | p99 µs | p99.9 µs "
        "| max µs | ping p50 µs | ping p99 µs | select/ping p50 | server p50 µs "
        "| rtt − server p50 µs | errors | load avg |"
    )
    print(
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: | ---: |"
    )
    for name in paths:
        path = Path(name)
        print(_row(path, json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
