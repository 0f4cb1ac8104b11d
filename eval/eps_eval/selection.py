"""Selection of one (layer, step) by every method, through the shipped core.

Scores come from core/bounds.h (jl, 1pc, fro, quest via libeps_eval) or, for
the references, from the keys (exact sum of squares, oracles); the visit marks
of every method come from core/select.h (MarkForced + MarkByThreshold) over a
top_pages sweep. Strict mode and a cross-check run PageSelector::Select.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from eps_eval import core
from eps_eval.metrics import BLOCK, Dense, dense, dots, evaluate, group_max

F32 = npt.NDArray[np.float32]
FRACTIONS = (0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.45)
CORE_METHODS = ("1pc", "fro", "quest")
TWO_LEVEL = ("jl8", "1pc", "quest")
ORACLES = ("oracle_max", "oracle_mass")


@dataclass
class Plan:
    group_blocks: tuple[int, ...] = (1, 4, 8, 16)
    jl_dims: tuple[int, ...] = (4, 8, 16, 32)
    lags: tuple[int, ...] = (0, 1, 4)
    per_kv_head_lags: tuple[int, ...] = (1,)
    fractions: tuple[float, ...] = FRACTIONS
    strict_fractions: tuple[float, ...] = (0.04, 0.1)
    two_level: bool = True
    exact: bool = True
    extra: dict[str, object] = field(default_factory=dict)


def record_bytes(method: str, d: int, g: int, tokens: int | None = None) -> float:
    """Summary bytes read per (group, KV head) by `method` at group size g, over a context of
    `tokens` (a two-level method's mean: it reads a g = 1 record per 16-token block, and a
    partial last group has fewer than g blocks; None: g blocks in every group)."""
    if method.endswith("-2l"):
        per_block = record_bytes(method[:-3], d, 1)
        if tokens is None:
            return g * per_block
        return per_block * -(-tokens // BLOCK) / -(-tokens // (g * BLOCK))
    if method.startswith("jl"):
        return core.record_bytes(d, int(method[2:]), 0)
    if method == "fro":
        return core.record_bytes(d, 8, 0)
    if method == "1pc":
        return core.record_bytes(d, 8, core.PRINCIPAL)
    if method == "quest":
        return 4.0 * d  # Quest's own record: per-channel min and max in fp16
    if method == "exact":
        return (d * (d + 1) // 2 + 3) * 4.0  # the packed d×d Gram in fp32
    if method == "strict":
        return core.record_bytes(d, 8, core.ALL_FEATURES)
    return 0.0  # oracles


class LayerSequences:
    """The core's summaries of one layer for every group size and sketch dim."""

    def __init__(self, plan: Plan, q_heads: int, kv_heads: int, d: int, max_tokens: int) -> None:
        self.plan = plan
        self.seqs: dict[tuple[int, int], core.Sequence] = {}
        gs = set(plan.group_blocks) | ({1} if plan.two_level else set())
        for g in sorted(gs):
            for m in plan.jl_dims if g in plan.group_blocks else (8,):
                feats = core.ALL_FEATURES if m == 8 else 0
                self.seqs[(g, m)] = core.Sequence(
                    q_heads=q_heads, kv_heads=kv_heads, head_dim=d, group_blocks=g,
                    sketch_dim=m, features=feats, max_tokens=max_tokens,
                )
        self.tokens = 0

    def extend_to(self, k: F32, tokens: int) -> None:
        if tokens > self.tokens:
            chunk = np.ascontiguousarray(k[:, self.tokens:tokens])
            for s in self.seqs.values():
                s.append(chunk)
            self.tokens = tokens


def top_pages_for(groups: int, fractions: tuple[float, ...]) -> list[int]:
    unforced = max(1, groups - 3)
    return sorted({max(1, round(f * unforced)) for f in fractions})


def step_rows(
    seqs: LayerSequences,
    k: F32,
    v: F32,
    q_by_pos: dict[int, F32],
    position: int,
) -> list[dict[str, object]]:
    """Every method's metrics at decode position `position` (context position + 1)."""
    plan = seqs.plan
    c = position + 1
    seqs.extend_to(k, c)
    kc, vc = k[:, :c], v[:, :c]
    d = k.shape[2]
    kvh = k.shape[0]
    dn: Dense = dense(q_by_pos[position], kc, vc)
    lag_q = {lag: q_by_pos[position - lag] for lag in plan.lags}
    lag_dots = {lag: dots(lag_q[lag], kc).astype(np.float64) for lag in plan.lags if plan.exact}
    rows: list[dict[str, object]] = []
    for g in plan.group_blocks:
        s8 = seqs.seqs[(g, 8)]
        G = s8.groups
        tps = top_pages_for(G, plan.fractions)
        batches: list[tuple[str, int, str, npt.NDArray[np.uint8], list[int]]] = []

        def add(method: str, lag: int, scores: F32, per_kv: bool = False,
                tps: list[int] = tps,
                batches: list[tuple[str, int, str, npt.NDArray[np.uint8], list[int]]] = batches,
                ) -> None:
            masks = core.mark(scores, kvh, tps, per_kv_head=per_kv)
            batches.append((method, lag, "per_kv_head" if per_kv else "union", masks, tps))

        for lag in plan.lags:
            q = lag_q[lag]
            score_sets: dict[str, F32] = {}
            for m in plan.jl_dims:
                score_sets[f"jl{m}"] = seqs.seqs[(g, m)].scores("jl", q)
            for name in CORE_METHODS:
                score_sets[name] = s8.scores(name, q)
            if plan.exact:
                sq = np.pad(lag_dots[lag] ** 2, ((0, 0), (0, G * g * BLOCK - c)))
                score_sets["exact"] = np.sqrt(sq.reshape(sq.shape[0], G, -1).sum(2)).astype(
                    np.float32
                )
            if plan.two_level and g > 1:
                s1 = seqs.seqs[(1, 8)]
                for name in TWO_LEVEL:
                    blk = s1.scores("jl" if name == "jl8" else name, q)
                    score_sets[f"{name}-2l"] = group_max(blk, g).astype(np.float32)
            for name, sc in score_sets.items():
                add(name, lag, sc)
                if lag in plan.per_kv_head_lags:
                    add(name, lag, sc, per_kv=True)
        # Oracles use the true attention of this step (lag does not apply).
        add("oracle_max", 0, group_max(dn.maxdot, g).astype(np.float32))
        add("oracle_mass", 0, np.log(np.maximum(group_sum_mass(dn, g), 1e-300)).astype(np.float32))
        for method, lag, gran, masks, tp in batches:
            rb = record_bytes(method, d, g, c)
            met = evaluate(dn, g, masks, tp, [rb] * len(tp))
            for i, t in enumerate(tp):
                rows.append(_row(method, g, lag, gran, t, G, {k2: v2[i] for k2, v2 in met.items()}))
        # Strict mode and the cross-check go through PageSelector::Select.
        if g == (8 if 8 in plan.group_blocks else max(plan.group_blocks)):
            for lag in sorted({0, 1} & set(plan.lags)):
                stps = top_pages_for(G, plan.strict_fractions)
                masks = []
                for t in stps:
                    vis, _st = s8.select("jl", lag_q[lag], t, strict=True)
                    masks.append(vis)
                met = evaluate(dn, g, np.stack(masks), stps, [record_bytes("strict", d, g)] * len(stps))
                for i, t in enumerate(stps):
                    rows.append(_row("strict", g, lag, "union", t, G, {k2: v2[i] for k2, v2 in met.items()}))
            # lag 1 (the served query) where the plan has it, else its smallest lag (a plan
            # of lags (0, 4) asked for lag 1, which lag_q did not hold: KeyError)
            _cross_check(s8, lag_q[1 if 1 in lag_q else min(lag_q)], tps, dn, g)
    return rows


def group_sum_mass(dn: Dense, g: int) -> npt.NDArray[np.float64]:
    from eps_eval.metrics import group_sum

    return group_sum(dn.mass, g)


def _row(method: str, g: int, lag: int, gran: str, tp: int, groups: int,
         met: dict[str, float]) -> dict[str, object]:
    row: dict[str, object] = {
        "method": method, "g": g, "lag": lag, "granularity": gran, "top_pages": tp,
        "groups": groups,
    }
    row.update({k: float(v) for k, v in met.items()})
    return row


def _cross_check(s8: core.Sequence, q: F32, tps: list[int], dn: Dense, g: int) -> None:
    """The sweep path (scores + marks) must equal PageSelector::Select, bytes included."""
    t = tps[len(tps) // 2]
    marks = core.mark(s8.scores("jl", q), s8.kv_heads, [t])[0]
    vis, st = s8.select("jl", q, t)
    if not np.array_equal(marks, vis):
        raise AssertionError(f"mark path differs from PageSelector::Select (g={g}, top_pages={t})")
    met = evaluate(dn, g, vis[None], [t], [0.0])
    if round(met["kv_bytes_read"][0]) != st["kv_bytes_read_est"]:
        raise AssertionError(
            f"kv bytes {met['kv_bytes_read'][0]} != StepStats {st['kv_bytes_read_est']}"
        )
