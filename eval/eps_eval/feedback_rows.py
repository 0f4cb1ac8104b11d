"""Selection feedback simulated in the harness, lag 1: under the threshold budget
(QualityPlan.feedback, rows fb-<estimator>-<variant>) and under the adaptive budget
(QualityPlan.mass_feedback, rows fbm-questclt), with core ApplyFeedback's rule (fed_scores).

The mass budget's estimate of a group's share of the attention is the weak part of the
adaptive budget (docs/eval/issue19-budgets-feedback.md, "The list-level budget in epsd": the
estimate, not the rule, keeps it from beating a well-chosen fixed budget). With selection
feedback the groups the previous step visited carry their exact lag-1 mass, and the others are
shifted by each head's median error over those (core ApplyFeedback's rule). Rows "fbm-questclt":
the previous step selects with the query two positions back under the same budget and
setting (so what is fed depends on the budget, as in an engine), then this step selects
with the fed scores; threshold rows beside them (the best fixed budget with feedback).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from eps_eval import core
from eps_eval.metrics import BLOCK, Dense, evaluate, group_sum

F32 = npt.NDArray[np.float32]
METHOD = "fbm-questclt"
TEMPERATURES = (0.5, 1.0, 2.0)
RowMaker = Callable[..., list[dict[str, object]]]


def fed_scores(estimate: F32, exact: npt.NDArray[np.float64],
               visited: npt.NDArray[np.bool_]) -> F32:
    """core ApplyFeedback on [q_heads, groups]: a visited group scores its exact value,
    every other its estimate plus the head's median of (exact - estimate) over the
    visited groups (0 when none)."""
    est = estimate.astype(np.float64)
    if not visited.any():
        return estimate
    diff = np.where(visited[None, :], exact - est, np.nan)
    offset = np.nan_to_num(np.nanmedian(diff, axis=1, keepdims=True))
    return np.where(visited[None, :], exact, est + offset).astype(np.float32)


def mass_rows(workload: dict[str, object], dn: Dense, est_now: F32, est_before: F32,
         exact: npt.NDArray[np.float64], g: int, kvh: int, d: int, tps: list[int],
         record_bytes: float, targets: tuple[float, ...], floors: tuple[float, ...],
         union: bool, make_rows: RowMaker) -> list[dict[str, object]]:
    """The threshold budget's sweep and the mass budget's (per head; with `union` also over
    the list) at every (τ, target, floor), each step fed by the previous one's list.
    exact: [q_heads, groups] sqrt(d)·log of each group's exact mass under the previous
    step's query (est_now's query). make_rows: quality._rows."""
    groups = est_now.shape[1]
    out: list[dict[str, object]] = []
    masks = []
    for tp in tps:
        visited = core.mark(est_before, kvh, [tp])[0, 0].astype(bool)
        masks.append(core.mark(fed_scores(est_now, exact, visited), kvh, [tp])[0])
    out += make_rows(workload, "threshold", METHOD, g, 1, [float(t) for t in tps], 0.0, groups,
                     evaluate(dn, g, np.stack(masks), tps, [record_bytes] * len(tps)))
    scopes = (("mass", "head"), ("massunion", "list")) if union else (("mass", "head"),)
    for budget, scope in scopes:
        for tau in TEMPERATURES:
            for floor in floors:
                min_pages = round(floor * max(1, groups - 3))
                masks = []
                kv_arg = kvh if scope == "head" else 1  # as quality.py passes it
                how = {"temperature": tau, "head_dim": d, "min_pages": min_pages, "scope": scope}
                for p in targets:
                    visited = core.mark_mass(est_before, kv_arg, [p], **how)[0, 0].astype(bool)
                    fed = fed_scores(est_now, exact, visited)
                    masks.append(core.mark_mass(fed, kv_arg, [p], **how)[0])
                met = evaluate(dn, g, np.stack(masks), [1] * len(targets),
                               [record_bytes] * len(targets))
                for r in make_rows(workload, budget, METHOD, g, 1, list(targets), tau, groups,
                                   met):
                    r["floor"] = floor
                    out.append(r)
    return out


def threshold_rows(workload: dict[str, object], dn: Dense, tables: object, q: F32,
                   q_before: F32, q_mass: npt.NDArray[np.float64], g: int, kvh: int,
                   tps: list[int], names: tuple[str, ...],
                   record_bytes: Callable[[str, int], float],
                   make_rows: RowMaker) -> list[dict[str, object]]:
    """Selection feedback (QualityPlan.feedback), lag 1: for each budget, the previous step's
    groups (estimator `name` with q_before) take the exact log mass of q (the previous step's
    query; q_mass its per-block mass) times sqrt(d), the others the estimate plus an offset.
    tables: quality.QuestTables; record_bytes, make_rows: quality's."""
    d = q.shape[-1]
    exact = np.log(np.maximum(group_sum(q_mass, g), 1e-300)) * np.sqrt(d)
    spread = np.sqrt(d) * np.log(BLOCK * g)
    out: list[dict[str, object]] = []
    for name in names:
        before = core.mark(tables.estimate(name, q_before), kvh, tps)  # type: ignore[attr-defined]
        est = tables.estimate(name, q)  # type: ignore[attr-defined]
        # o0, o1: offsets of 0 and sqrt(d)·log(tokens)/2; cal: each head's median of
        # exact − estimate over the groups the previous step visited (known to an engine).
        for variant in ("o0", "o1", "cal"):
            masks = np.zeros_like(before)
            for i, tp in enumerate(tps):
                visited = before[i, 0].astype(bool)
                if variant == "cal":
                    sc = fed_scores(est, exact, visited)
                else:
                    offset = 0.0 if variant == "o0" else 0.5 * spread
                    sc = np.where(visited[None, :], exact,
                                  est.astype(np.float64) + offset).astype(np.float32)
                masks[i] = core.mark(sc, kvh, [tp])[0]
            out += make_rows(workload, "threshold", f"fb-{name}-{variant}", g, 1,
                             [float(t) for t in tps], 0.0, masks.shape[2],
                             evaluate(dn, g, masks, tps, [record_bytes(name, d)] * len(tps)))
    return out
