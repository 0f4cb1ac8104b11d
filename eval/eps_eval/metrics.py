"""Dense attention of one (layer, step) and the metrics of visit masks against it.

All metrics are per query head, then averaged (recall also gives its minimum):
  recall     softmax attention mass of the visited tokens
  top10      share of the head's 10 largest-logit tokens that are visited (Quest's metric)
  false_skip share of the true top-M groups by max_i q·k_i (M = top_pages) left out
  out_err    ‖o_visited − o_dense‖ / ‖o_dense‖, o the attention output
and per list of the step:
  visited    share of the context's tokens read (K and V)
  skip       1 − (KV bytes read + summary bytes read) / dense KV bytes
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
BLOCK = 16


@dataclass
class Dense:
    """Block-level aggregates (16-token blocks) of the true attention of every query head."""

    tokens: int
    kv_heads: int
    head_dim: int
    mass: npt.NDArray[np.float64]  # [H, nb] softmax mass
    maxdot: F32  # [H, nb] max_i q·k_i
    pv: F32  # [H, nb, d] Σ p_i v_i
    out: F32  # [H, d] dense output
    top10_block: npt.NDArray[np.int64]  # [H, 10]


def dots(q: F32, k: F32) -> F32:
    """q [H, d], k [kv, c, d] -> q·k [H, c] (GQA: head h reads KV head h // (H/kv))."""
    h, kv = q.shape[0], k.shape[0]
    r = h // kv
    return np.concatenate([q[i * r:(i + 1) * r] @ k[i].T for i in range(kv)], axis=0)


def dense(q: F32, k: F32, v: F32) -> Dense:
    h, d = q.shape
    kv, c, _ = k.shape
    r = h // kv
    nb = -(-c // BLOCK)
    pad = nb * BLOCK - c
    s = dots(q, k).astype(np.float64)
    logit = s / np.sqrt(d)
    p = np.exp(logit - logit.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    pp = np.pad(p, ((0, 0), (0, pad)))
    mass = pp.reshape(h, nb, BLOCK).sum(axis=2)
    maxdot = np.pad(s, ((0, 0), (0, pad)), constant_values=-np.inf).reshape(h, nb, BLOCK).max(2)
    vp = np.pad(v, ((0, 0), (0, pad), (0, 0))).reshape(kv, nb, BLOCK, d)
    pv = np.empty((h, nb, d), dtype=np.float32)
    for i in range(h):
        pv[i] = np.einsum("bt,btd->bd", pp[i].reshape(nb, BLOCK).astype(np.float32), vp[i // r])
    out = pv.sum(axis=1)
    top = np.argpartition(-s, min(10, c) - 1, axis=1)[:, : min(10, c)] // BLOCK
    return Dense(c, kv, d, mass, maxdot.astype(np.float32), pv, out, top)


def group_sum(x: np.ndarray, g: int) -> np.ndarray:
    """Sums 16-token blocks [H, nb, ...] into groups of g blocks [H, G, ...]."""
    nb = x.shape[1]
    G = -(-nb // g)
    pad = [(0, 0), (0, G * g - nb)] + [(0, 0)] * (x.ndim - 2)
    return np.pad(x, pad).reshape(x.shape[0], G, g, *x.shape[2:]).sum(axis=2)


def group_max(x: np.ndarray, g: int) -> np.ndarray:
    nb = x.shape[1]
    G = -(-nb // g)
    xp = np.pad(x, ((0, 0), (0, G * g - nb)), constant_values=-np.inf)
    return xp.reshape(x.shape[0], G, g).max(axis=2)


def group_tokens(tokens: int, g: int) -> npt.NDArray[np.int64]:
    gt = g * BLOCK
    G = -(-tokens // gt)
    t = np.full(G, gt, dtype=np.int64)
    t[-1] = tokens - (G - 1) * gt
    return t


def evaluate(
    dn: Dense,
    g: int,
    masks: npt.NDArray[np.uint8],
    top_pages: list[int],
    summary_bytes_per_record: list[float],
) -> dict[str, npt.NDArray[np.float64]]:
    """Metrics of masks [P, lists, G] (lists 1 = union, kv_heads = per KV head)."""
    P, lists, G = masks.shape
    H = dn.mass.shape[0]
    r = H // dn.kv_heads
    head_list = (np.arange(H) // r) if lists > 1 else np.zeros(H, dtype=np.int64)
    mh = masks[:, head_list, :].astype(np.float32)  # [P, H, G]
    mass = group_sum(dn.mass, g)  # [H, G]
    recall = np.einsum("phg,hg->ph", mh, mass)
    top_group = dn.top10_block // g  # [H, 10]
    top10 = np.take_along_axis(mh, np.broadcast_to(top_group[None], (P, H, top_group.shape[1])), 2)
    top10 = top10.mean(axis=2)
    # True top-M by max q·k per head: rank of every group.
    gmax = group_max(dn.maxdot, g)
    rank = np.argsort(np.argsort(-gmax, axis=1, kind="stable"), axis=1)  # [H, G]
    M = np.minimum(np.asarray(top_pages), G)[:, None, None]
    true_top = rank[None] < M  # [P, H, G]
    false_skip = (true_top & (mh == 0)).sum(axis=2) / M[:, :, 0]
    pv = group_sum(dn.pv, g)  # [H, G, d]
    zg = mass.astype(np.float32)
    err = np.empty((P, H))
    for h in range(H):
        num = mh[:, h, :] @ pv[h]  # [P, d]
        den = mh[:, h, :] @ zg[h]  # [P]
        o = num / np.maximum(den, 1e-30)[:, None]
        err[:, h] = np.linalg.norm(o - dn.out[h][None], axis=1) / np.linalg.norm(dn.out[h])
    tok = group_tokens(dn.tokens, g).astype(np.float64)
    visited_tokens = (masks.astype(np.float64) @ tok).sum(axis=1)  # [P] over lists
    heads_per_list = dn.kv_heads if lists == 1 else 1
    kv_tok_bytes = 2 * dn.head_dim * 2  # fp16 K and V
    dense_bytes = dn.tokens * dn.kv_heads * kv_tok_bytes
    read = visited_tokens * heads_per_list * kv_tok_bytes
    summary = np.asarray(summary_bytes_per_record) * G * dn.kv_heads
    return {
        "recall": recall.mean(axis=1),
        "recall_min": recall.min(axis=1),
        "top10": top10.mean(axis=1),
        "false_skip": false_skip.mean(axis=1),
        "out_err": err.mean(axis=1),
        "visited": read / dense_bytes,
        "summary_frac": summary / dense_bytes,
        "skip": 1.0 - (read + summary) / dense_bytes,
        "kv_bytes_read": read,
    }
