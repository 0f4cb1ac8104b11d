"""Synthetic long-context attention workloads (numpy), one "layer" per kind.

Keys per KV head follow core/testing/synthetic.h's structure: a mean with a
slow drift, per-channel outliers (3 % of channels at 4x), RoPE by position,
attention sinks, needles (single tokens aligned with the queries) at random
depths and relevant spans. Queries move from step to step (a per-head
direction plus AR(1) noise, RoPE at their own position), so query lag matters.
Kinds:
  needle  one strong needle, a few weak spans
  multi   eight needles of varied strength, eight spans
  spread  aggregation: 64 spans of moderate logits, no needle
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
KINDS = ("needle", "multi", "spread")
# The earliest query position make_layer accepts: the 4 sinks and at least one position for
# the needles and spans lie before it.
FIRST_QUERY = 5


@dataclass
class LayerTrace:
    """What the harness needs of one layer: keys/values and queries by position."""

    k: F32  # [kv_heads, T, d], RoPE applied
    v: F32  # [kv_heads, T, d]
    q: dict[int, F32]  # position -> [q_heads, d], RoPE applied
    info: dict[str, object]


def rope_halves(x: F32, positions: npt.NDArray[np.int64], base: float) -> F32:
    """Rotates pairs (i, i + d/2) by pos·base^(-2i/d) (the layout of core/testing/synthetic.h)."""
    d = x.shape[-1]
    half = d // 2
    inv = base ** (-2.0 * np.arange(half) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1).astype(np.float32)


def make_layer(
    kind: str,
    tokens: int,
    q_positions: list[int],
    *,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 128,
    seed: int = 1,
    rope_base: float = 10000.0,
) -> LayerTrace:
    if kind not in KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r}; known: {KINDS}")
    # Needles and spans are planted at [4, earliest query - 1): with an earliest query below
    # FIRST_QUERY they landed at or after it (invisible to it) or past the last key.
    if not q_positions or min(q_positions) < FIRST_QUERY or max(q_positions) >= tokens:
        raise ValueError(f"query positions {min(q_positions, default=None)}.."
                         f"{max(q_positions, default=None)} must lie in [{FIRST_QUERY}, "
                         f"{tokens}) (tokens={tokens})")
    rng = np.random.default_rng(seed)
    d, r = head_dim, q_heads // kv_heads
    ref = min(q_positions)  # needles are planted against the queries at this position
    pos = np.arange(tokens, dtype=np.int64)
    qpos = np.asarray(sorted(q_positions), dtype=np.int64)
    ks = np.empty((kv_heads, tokens, d), dtype=np.float32)
    vs = rng.standard_normal((kv_heads, tokens, d), dtype=np.float32)
    qs = np.empty((len(qpos), q_heads, d), dtype=np.float32)
    needles: list[list[int]] = []
    if kind == "needle":
        n_needles, needle_logits, n_spans, span_logit, span_len = 1, (12.0, 12.0), 4, (2.0, 5.0), 256
    elif kind == "multi":
        n_needles, needle_logits, n_spans, span_logit, span_len = 8, (8.0, 12.0), 8, (2.0, 6.0), 256
    else:
        n_needles, needle_logits, n_spans, span_logit, span_len = 0, (0.0, 0.0), 64, (2.0, 4.5), 256
    for kvh in range(kv_heads):
        channel = np.where(rng.random(d) < 0.03, 4.0, 1.0).astype(np.float32)
        mean0 = rng.standard_normal(d).astype(np.float32) * 0.5
        da = rng.standard_normal(d).astype(np.float32) * 0.5
        db = rng.standard_normal(d).astype(np.float32) * 0.5
        period = max(2048.0, tokens / 3.0)
        ph = 2 * np.pi * pos / period
        base = (
            mean0[None, :]
            + np.cos(ph)[:, None].astype(np.float32) * da[None, :]
            + np.sin(ph)[:, None].astype(np.float32) * db[None, :]
            + rng.standard_normal((tokens, d), dtype=np.float32)
        ) * channel[None, :]
        k = rope_halves(base.astype(np.float32), pos, rope_base)
        # Queries: shared direction + per-head deviation (norm sqrt(d)), AR(1) drift per step.
        shared = rng.standard_normal(d)
        heads_q = []
        for _ in range(r):
            u = shared + 0.5 * rng.standard_normal(d)
            u *= np.sqrt(d) / np.linalg.norm(u)
            noise = np.zeros(d)
            rows = []
            for _p in qpos:
                noise = 0.8 * noise + 0.6 * 0.3 * rng.standard_normal(d)  # stationary std 0.3
                rows.append((u + noise) * channel / 2)
            heads_q.append(rope_halves(np.asarray(rows, dtype=np.float32), qpos, rope_base))
        qh = np.stack(heads_q, axis=1)  # [P, r, d]
        qs[:, kvh * r:(kvh + 1) * r] = qh
        ref_q = qh[list(qpos).index(ref)]  # [r, d]
        target = ref_q.mean(axis=0)
        qnorm = float(np.linalg.norm(target))
        target = target / qnorm

        def plant(t: npt.NDArray[np.int64], logit: npt.ArrayLike, k: F32 = k,
                  target: F32 = target, qnorm: float = qnorm) -> None:
            along = np.asarray(logit, dtype=np.float32) * np.sqrt(d) / qnorm
            k[t] = 0.3 * k[t] + np.atleast_1d(along)[:, None] * target[None, :]

        plant(np.arange(min(4, tokens)), 8.0)
        hi = max(5, min(q_positions) - 1)
        positions = rng.integers(4, hi, size=n_needles)
        plant(positions, rng.uniform(*needle_logits, size=n_needles))
        needles.append(sorted(int(p) for p in positions))
        for _ in range(n_spans):
            b = int(rng.integers(4, hi))
            e = min(hi, b + int(rng.integers(16, span_len + 1)))
            if e > b:
                lg = rng.uniform(*span_logit) + 0.5 * rng.standard_normal(e - b)
                plant(np.arange(b, e), lg)
        ks[kvh] = k
    q = {int(p): np.ascontiguousarray(qs[i]) for i, p in enumerate(qpos)}
    return LayerTrace(k=ks, v=vs, q=q, info={"kind": kind, "seed": seed, "needles": needles})
