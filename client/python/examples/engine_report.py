"""Numbers and tables of the reference engine (numpy only, so they are tested without torch).

- ``summarize``: a decode run's per-step lists -> p50/p95 and the breakdown.
- ``attention_limit_ms``: the step time if attention cost exactly its share of bytes read.
- ``account_fallbacks``: every step that ran densely has a counted reason.
- ``gating``: how many steps of a gated run did not run gated.
- ``markdown``: the tables printed last and pasted into docs/benchmarks/reference-engine.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def pct(values: Sequence[float], p: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), p)) if len(values) else \
        float("nan")


def mean(values: Sequence[float]) -> float:
    return float(np.mean(np.asarray(values, dtype=np.float64))) if len(values) else \
        float("nan")


def summarize(run: Any, warmup: int) -> dict[str, float]:
    """p50/p95 and mean of the step, the p50 of each part and the mean wait for the lists,
    after ``warmup`` steps: the GPU and host times by position in the run, the selections'
    statistics and round trips by step number (decode step t read selection step
    ``run.first_step`` + t - t % ``run.reuse``; the statistics of the sync steps around the
    run, calibration's and the one that collects the last ones, are not the run's)."""
    steps = len(run.step_ms)
    w = min(warmup, max(steps - 1, 0))
    measured = range(run.first_step + w, run.first_step + steps)
    stats = [s for s in run.stats if not s.error and s.step in measured]
    rtt = [us for step, us in zip(run.accepted_steps, run.rtt_us, strict=True)
           if step in measured]
    visited = sum(s.pages_visited for s in stats)
    total = sum(s.pages_total for s in stats)
    return {
        "step_ms_p50": pct(run.step_ms[w:], 50),
        "step_ms_p95": pct(run.step_ms[w:], 95),
        # a run that reuses selections has two kinds of step (waiting or not): its p50 is
        # one kind's, the mean is the decode rate
        "step_ms_mean": mean(run.step_ms[w:]),
        "graph_ms_p50": pct(run.graph_ms[w:], 50),
        "wait_selection_ms_p50": pct(run.wait_selection_ms[w:], 50),
        "wait_selection_ms_p95": pct(run.wait_selection_ms[w:], 95),
        # with reuse k only one step in k waits: the mean is what a step pays
        "wait_selection_ms_mean": mean(run.wait_selection_ms[w:]),
        "wait_summaries_ms_p50": pct(run.wait_summaries_ms[w:], 50),
        "host_ms_p50": pct(run.host_ms[w:], 50),
        "rpc_us_p50": pct(rtt, 50),
        "rpc_us_p95": pct(rtt, 95),
        "prepass_us_p50": pct([s.prepass_us for s in stats], 50),
        "pages_read_fraction": visited / total if total else float("nan"),
        "steps": steps,
    }


def attention_limit_ms(dense_step_ms: float, dense_attention_ms: float,
                       fraction_read: float) -> float:
    """The gated step if attention cost exactly its share of the KV bytes read and nothing
    else changed: dense step - dense attention * (1 - fraction read)."""
    return dense_step_ms - dense_attention_ms * (1.0 - fraction_read)


def account_fallbacks(fallback_steps: Sequence[int], accepted_steps: Sequence[int],
                      first_step: int, dense_marks: Sequence[bool], watchdog_releases: int,
                      device_errors: int) -> dict[str, Any]:
    """Every step whose lists were dense on the device (``dense_marks[t]`` for selection step
    first_step + t) must have a counted reason: a client fallback (released by the engine at
    once), or an accepted step released later (by the watchdog, or by the release of a later
    fallback: counters only grow), or a step that failed on the device (reported by epsd)."""
    dense = {first_step + t for t, d in enumerate(dense_marks) if d}
    fell_back = set(fallback_steps) & {first_step + t for t in range(len(dense_marks))}
    accepted_dense = dense & set(accepted_steps)
    unexplained = dense - fell_back - accepted_dense
    not_dense = fell_back - dense
    return {
        "dense_steps": len(dense),
        "client_fallbacks": len(fell_back),
        "accepted_then_released": len(accepted_dense),
        "watchdog_releases": watchdog_releases,
        "released_by_a_later_fallback_or_failed": max(len(accepted_dense) - watchdog_releases, 0),
        "device_errors": device_errors,
        "unexplained_dense_steps": sorted(unexplained),
        "fallbacks_not_dense": sorted(not_dense),
        "ok": not unexplained and not not_dense and watchdog_releases <= len(accepted_dense),
    }


def gating(run: Any) -> dict[str, int]:
    """A gated run's steps that did not run gated, which its quality, pass-key and speed
    numbers would otherwise count as gated: ``dense_steps`` (lists dense on the device when
    the step's attention read them: client fallbacks, steps the watchdog or a later fallback
    released, steps that failed on the device), ``fallbacks`` (client fallbacks alone),
    ``watchdog_releases`` (a released step whose lists epsd then wrote late may read as not
    dense, yet its attention may have read part of them dense), ``device_errors`` (steps
    of the run that epsd reported failed on the device) and ``refused_lists`` ((layer, row)
    lists that flash_attention_views refused and read as the engine's row: a list reused
    past the window, one never written)."""
    steps = range(run.first_step, run.first_step + len(run.dense_marks))
    return {"dense_steps": sum(1 for dense in run.dense_marks if dense),
            "fallbacks": len(run.fallback_steps),
            "watchdog_releases": run.watchdog_releases,
            "device_errors": sum(1 for s in run.stats if s.error and s.step in steps),
            "refused_lists": run.refused_lists}


def ran_gated(counts: Mapping[str, Any]) -> bool:
    """Every step of the run ran with epsd's lists (``gating``'s counts all 0)."""
    return all(counts[k] == 0 for k in ("dense_steps", "fallbacks", "watchdog_releases",
                                         "device_errors", "refused_lists"))


def delta_ppl_percent(delta_nll_per_token: float) -> float:
    return 100.0 * (math.exp(delta_nll_per_token) - 1.0)


def markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    for row in rows:  # a short row shifts every later column under the wrong heading
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} headings: {row}")

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
