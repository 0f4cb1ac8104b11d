"""Per-token low-rank key summaries (issue 19): an estimator that is not a box.

Quest's record and every estimator read from it (eps_eval.estimators) describe a group by
per-channel ranges, which at d = 256 say little about which token a query meets. This
module keeps, for every token, r coefficients of its key in a fixed basis, and scores a
16-token block by the attention mass those approximate dot products give:

    ŝ_t = q·μ + (Bqᵀ q)·c_t,   c_t = Bkᵀ (k_t − μ) rounded to `bits` with one scale a block,
    score(block) = √d · log Σ_t exp(ŝ_t / √d)   (the block's log mass in score units).

Two bases of rank r, one per layer and KV head:
  key PCA        Bk = Bq = the top r eigenvectors of the keys' covariance (Loki's choice);
  query-aware    the r directions that keep E_q[(q·(k − μ))²] best for the queries'
                 second moment Σq: whiten with R = Σq^½ (q·k = (R⁻¹q)·(Rk)), take the top
                 r eigenvectors V of R Σk R, Bk = R V, Bq = R⁻¹ V. At r = d both give q·k
                 exactly.

A block's record is 16·r·bits/8 bytes of coefficients and a 2-byte scale (the basis is
per layer and KV head, not per block).

The rotated box keeps, instead of every token's coefficients, their per-coordinate
minimum and maximum over the block (2·r bytes at 8 bits, rounded outward, and a 4-byte
scale): quest's record in the basis instead of the channels, scored as questclt is,

    score(block) = q·μ + q'·mid + κ · sqrt(Σ_j q'_j² w_j²),   q' = Bqᵀ q,

mid and w the box's centre and half-width. The study (eps_eval.run_lowrank) measures both
against questclt and the exact lag-1 mass at equal bytes.

OwnBlocks describes each block in a basis of its own instead (its mean key, its r
principal directions, every token's r coefficients), scored as block_scores with a term
for what the r directions leave out (`run_lowrank --own`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from eps_eval.metrics import BLOCK

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Basis:
    """One rank-r basis per KV head (GQA: query head h reads KV head h // (H / kv))."""

    mu: F64  # [kv, d] the keys' mean
    keys: F64  # [kv, d, r] Bk: coefficients c = Bkᵀ (k − μ)
    queries: F64  # [kv, d, r] Bq: q·k ≈ q·μ + (Bqᵀ q)·c

    @property
    def rank(self) -> int:
        return int(self.keys.shape[2])


def _check(keys: np.ndarray, r: int) -> F64:
    k = np.asarray(keys, dtype=np.float64)
    if k.ndim != 3:
        raise ValueError(f"keys must be [kv, T, d], not of shape {k.shape}")
    if not 1 <= r <= k.shape[2]:
        raise ValueError(f"rank r={r} is not in [1, d={k.shape[2]}]")
    if k.shape[1] < 2:
        raise ValueError("a basis needs at least two keys")
    return k


def _stack(parts: list[tuple[F64, F64, F64]]) -> Basis:
    return Basis(*(np.stack([p[i] for p in parts]) for i in range(3)))


def key_pca(keys: np.ndarray, r: int) -> Basis:
    """The top r principal directions of each KV head's keys [kv, T, d] (centred)."""
    parts = []
    for kh in _check(keys, r):
        mu = kh.mean(axis=0)
        _, vecs = np.linalg.eigh((kh - mu).T @ (kh - mu) / len(kh))
        v = vecs[:, ::-1][:, :r]
        parts.append((mu, v, v))
    return _stack(parts)


def query_aware(keys: np.ndarray, queries: np.ndarray, r: int) -> Basis:
    """Per KV head, the rank-r basis that keeps q·(k − μ) best on average over its query
    heads' `queries` [N, H, d] (keys [kv, T, d]; H a multiple of kv)."""
    k = _check(keys, r)
    kv, _, d = k.shape
    q = np.asarray(queries, dtype=np.float64)
    if q.ndim != 3 or q.shape[2] != d or q.shape[1] % kv != 0:
        raise ValueError(f"queries must be [N, H, d={d}] with H a multiple of kv={kv}, "
                         f"not of shape {q.shape}")
    group = q.shape[1] // kv
    parts = []
    for j, kh in enumerate(k):
        qj = q[:, j * group:(j + 1) * group].reshape(-1, d)
        mu = kh.mean(axis=0)
        w, u = np.linalg.eigh(qj.T @ qj / len(qj))
        w = np.maximum(w, 1e-9 * max(float(w.max()), 1e-300))  # directions no query takes
        root, inv_root = (u * np.sqrt(w)) @ u.T, (u / np.sqrt(w)) @ u.T
        _, vecs = np.linalg.eigh(root @ ((kh - mu).T @ (kh - mu) / len(kh)) @ root)
        v = vecs[:, ::-1][:, :r]
        parts.append((mu, root @ v, inv_root @ v))
    return _stack(parts)


def _coefficients(k: F32, tokens: int, basis: Basis) -> F64:
    """Every key's coefficients [kv, tokens, r], each KV head in its own basis."""
    kk = k[:, :tokens].astype(np.float64) - basis.mu[:, None, :]
    return np.einsum("ktd,kdr->ktr", kk, basis.keys)


def block_coefficients(k: F32, tokens: int, basis: Basis, bits: int = 8) -> F64:
    """Coefficients [kv, blocks, 16, r] of the first `tokens` keys of k [kv, T, d], rounded
    to signed `bits` with one scale per (block, KV head) (bits 0: unrounded); the padding
    tokens of the last block are NaN."""
    kv, _, _ = k.shape
    nb = -(-tokens // BLOCK)
    c = _coefficients(k, tokens, basis)
    c = np.pad(c, ((0, 0), (0, nb * BLOCK - tokens), (0, 0))).reshape(kv, nb, BLOCK, -1)  # zeros
    if bits:
        top = float(2 ** (bits - 1) - 1)
        scale = np.abs(c).max(axis=(2, 3), keepdims=True) / top
        scale = np.where(scale > 0, scale, 1.0)
        c = np.round(c / scale) * scale
    pad = nb * BLOCK - tokens
    if pad:
        c[:, -1, BLOCK - pad:] = np.nan
    return c


def block_scores(q: F32, coeffs: F64, basis: Basis) -> F32:
    """Scores [H, blocks] of q [H, d]: √d · log Σ_t exp(ŝ_t / √d) over each block's tokens
    (GQA: head h reads KV head h // (H / kv))."""
    h, d = q.shape
    kv = coeffs.shape[0]
    qq = q.astype(np.float64)
    out = np.empty((h, coeffs.shape[1]))
    root_d = np.sqrt(d)
    for i in range(h):
        j = i // (h // kv)
        s = coeffs[j] @ (basis.queries[j].T @ qq[i]) + qq[i] @ basis.mu[j]  # [blocks, 16]
        s = np.where(np.isnan(s), -np.inf, s)
        top = s.max(axis=1, keepdims=True)
        out[i] = top[:, 0] + root_d * np.log(np.exp((s - top) / root_d).sum(axis=1))
    return out.astype(np.float32)


def block_boxes(k: F32, tokens: int, basis: Basis) -> tuple[F64, F64]:
    """Per-coordinate min and max [kv, blocks, r] of each block's coefficients, in int8
    with one scale per (block, KV head), rounded outward (the box holds every token)."""
    kv, _, _ = k.shape
    nb = -(-tokens // BLOCK)
    pad = nb * BLOCK - tokens
    c = _coefficients(k, tokens, basis)
    lo = np.pad(c, ((0, 0), (0, pad), (0, 0)), constant_values=np.inf)
    hi = np.pad(c, ((0, 0), (0, pad), (0, 0)), constant_values=-np.inf)
    lo = lo.reshape(kv, nb, BLOCK, -1).min(axis=2)
    hi = hi.reshape(kv, nb, BLOCK, -1).max(axis=2)
    scale = np.maximum(np.abs(lo), np.abs(hi)).max(axis=2, keepdims=True) / 127.0
    scale = np.where(scale > 0, scale * (1 + 1e-6), 1.0)
    return np.floor(lo / scale) * scale, np.ceil(hi / scale) * scale


def box_scores(q: F32, lo: F64, hi: F64, basis: Basis, kappa: float) -> F32:
    """Scores [H, blocks] of q [H, d] from the rotated boxes (GQA as block_scores)."""
    h = q.shape[0]
    kv = lo.shape[0]
    qq = q.astype(np.float64)
    mid, w = 0.5 * (hi + lo), 0.5 * (hi - lo)
    out = np.empty((h, lo.shape[1]))
    for i in range(h):
        j = i // (h // kv)
        qp = basis.queries[j].T @ qq[i]  # [r]
        out[i] = qq[i] @ basis.mu[j] + mid[j] @ qp + kappa * np.sqrt((w[j] ** 2) @ (qp ** 2))
    return out.astype(np.float32)


def box_bytes(r: int) -> float:
    """Bytes per (16-token block, KV head) of a rotated box: int8 min and max, a scale."""
    return 2.0 * r + 4.0


def record_bytes(r: int, bits: int) -> float:
    """Bytes per (16-token block, KV head): the coefficients and a 2-byte scale."""
    return BLOCK * r * (bits if bits else 16) / 8 + 2.0


def _int8(x: F64, axis: tuple[int, ...]) -> F64:
    """x rounded to int8 codes with one scale over `axis` (the scale kept exactly)."""
    scale = np.abs(x).max(axis=axis, keepdims=True) / 127.0
    scale = np.where(scale > 0, scale, 1.0)
    return np.round(x / scale) * scale


@dataclass
class OwnBlocks:
    """Each 16-token block's keys in a basis of its own (`own{r}`): the block's mean key μ_b,
    its r principal directions u_b (of k − μ_b), each token's r coefficients c_t, and the
    mean squared norm of what they leave out; all int8 with one scale a vector (μ_b, each
    u_b, the block's coefficients), the residual as a 2-byte number. Scored as block_scores
    does, with ŝ_t = q·μ_b + Σ_j c_tj (q·u_bj) + ‖q‖² ρ_b / (2 d √d) (the residual's mean
    energy ρ_b spread evenly over the d channels, as the log of E exp(x/√d) for a normal x).
    """

    mu: F64  # [kv, blocks, d]
    dirs: F64  # [kv, blocks, r, d]
    coeffs: F64  # [kv, blocks, 16, r]; padding tokens NaN
    resid: F64  # [kv, blocks]


def own_blocks(k: F32, tokens: int, r: int, rounded: bool = True) -> OwnBlocks:
    """OwnBlocks of the first `tokens` keys of k [kv, T, d] (0 ≤ r ≤ min(16, d)); `rounded`
    False keeps every number unrounded (at r = 16 the scores are then the exact log mass)."""
    kv, _, d = k.shape
    if not 0 <= r <= min(BLOCK, d):
        raise ValueError(f"rank {r} is not in [0, {min(BLOCK, d)}]")
    q8 = _int8 if rounded else (lambda x, axis: x)
    nb = -(-tokens // BLOCK)
    pad = nb * BLOCK - tokens
    kk = np.pad(k[:, :tokens].astype(np.float64), ((0, 0), (0, pad), (0, 0))).reshape(
        kv, nb, BLOCK, d)
    valid = np.ones((nb, BLOCK), dtype=bool)
    if pad:
        valid[-1, BLOCK - pad:] = False
    mu = kk.sum(axis=2) / valid.sum(axis=1)[None, :, None]
    centred = (kk - mu[:, :, None, :]) * valid[None, :, :, None]
    u, s, vt = np.linalg.svd(centred, full_matrices=False)
    coeffs = u[..., :r] * s[..., None, :r]
    resid = ((centred ** 2).sum(axis=(2, 3)) - (coeffs ** 2).sum(axis=(2, 3))) / valid.sum(1)
    coeffs = q8(coeffs, (2, 3))
    coeffs[:, ~valid] = np.nan
    return OwnBlocks(q8(mu, (2,)), q8(vt[..., :r, :], (3,)), coeffs, np.maximum(resid, 0.0))


def own_scores(q: F32, own: OwnBlocks) -> F32:
    """Scores [H, blocks] of q [H, d] from OwnBlocks (GQA as block_scores)."""
    h, d = q.shape
    kv = own.mu.shape[0]
    qq = q.astype(np.float64)
    root_d = np.sqrt(d)
    out = np.empty((h, own.mu.shape[1]))
    for i in range(h):
        j = i // (h // kv)
        along = np.einsum("brd,d->br", own.dirs[j], qq[i])  # [blocks, r]
        s = (own.mu[j] @ qq[i])[:, None] + np.einsum("btr,br->bt", own.coeffs[j], along)
        s = s + (own.resid[j] * (qq[i] @ qq[i]) / (2 * d * root_d))[:, None]
        s = np.where(np.isnan(s), -np.inf, s)
        top = s.max(axis=1, keepdims=True)
        out[i] = top[:, 0] + root_d * np.log(np.exp((s - top) / root_d).sum(axis=1))
    return out.astype(np.float32)


def own_bytes(r: int, d: int) -> float:
    """Bytes per (16-token block, KV head) of OwnBlocks: μ and r directions (d int8 and a
    2-byte scale each), 16·r coefficients and their scale, the residual."""
    return (r + 1) * (d + 2.0) + BLOCK * r + 2.0 + 2.0
