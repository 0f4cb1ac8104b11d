"""Tests of the per-token low-rank key summaries (eval/eps_eval/lowrank.py).

The `rng` fixture (conftest.py) prints its seed; EPS_TEST_SEED=N replays it.
"""

from __future__ import annotations

import numpy as np
import pytest
from eps_eval import lowrank
from eps_eval.metrics import BLOCK


def _keys_and_queries(rng: np.random.Generator, d: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    # Anisotropic keys and queries whose large directions differ, so that the basis
    # choice matters.
    mix_k = rng.standard_normal((d, d)) * rng.uniform(0.05, 3, d)
    mix_q = rng.standard_normal((d, d)) * rng.uniform(0.05, 3, d)
    k = (rng.standard_normal((1, n, d)) @ mix_k + rng.standard_normal(d)).astype(np.float32)
    q = (rng.standard_normal((4 * n, d)) @ mix_q).astype(np.float32)
    return k, q


def _exact_log_mass(q: np.ndarray, k: np.ndarray, tokens: int) -> np.ndarray:
    d = q.shape[1]
    s = q.astype(np.float64) @ k[0, :tokens].astype(np.float64).T  # [H, tokens]
    nb = -(-tokens // BLOCK)
    s = np.pad(s, ((0, 0), (0, nb * BLOCK - tokens)), constant_values=-np.inf)
    s = s.reshape(q.shape[0], nb, BLOCK)
    top = s.max(axis=2, keepdims=True)
    return top[..., 0] + np.sqrt(d) * np.log(np.exp((s - top) / np.sqrt(d)).sum(axis=2))


@pytest.mark.parametrize("make", ["pca", "query"])
def test_full_rank_unrounded_scores_are_each_blocks_exact_log_mass(
        rng: np.random.Generator, make: str) -> None:
    d = 16
    tokens = int(rng.integers(BLOCK + 1, 12 * BLOCK))
    k, q = _keys_and_queries(rng, d, tokens)
    basis = (lowrank.key_pca(k, d) if make == "pca" else lowrank.query_aware(k, q, d))
    c = lowrank.block_coefficients(k, tokens, basis, bits=0)
    heads = q[:4]
    np.testing.assert_allclose(lowrank.block_scores(heads, c, basis),
                               _exact_log_mass(heads, k, tokens), rtol=1e-4, atol=1e-3)


def test_query_aware_basis_beats_key_pca_on_its_queries(rng: np.random.Generator) -> None:
    d, n, r = 32, 2000, 6
    k, q = _keys_and_queries(rng, d, n)
    truth = q.astype(np.float64) @ k[0].astype(np.float64).T

    def err(b: lowrank.Basis) -> float:
        c = (k[0].astype(np.float64) - b.mu) @ b.keys
        approx = (q.astype(np.float64) @ b.mu)[:, None] + (q.astype(np.float64) @ b.queries) @ c.T
        return float(np.mean((approx - truth) ** 2))

    assert err(lowrank.query_aware(k, q, r)) < err(lowrank.key_pca(k, r))


def test_rounded_coefficients_stay_within_half_a_step(rng: np.random.Generator) -> None:
    d, r = 24, 5
    tokens = int(rng.integers(1, 9 * BLOCK))
    k, q = _keys_and_queries(rng, d, max(tokens, 2))
    basis = lowrank.query_aware(k, q, r)
    exact = lowrank.block_coefficients(k, tokens, basis, bits=0)
    for bits in (4, 8):
        c = lowrank.block_coefficients(k, tokens, basis, bits=bits)
        assert np.array_equal(np.isnan(c), np.isnan(exact))
        step = np.nanmax(np.abs(exact), axis=(2, 3), keepdims=True) / (2 ** (bits - 1) - 1)
        assert np.nanmax(np.abs(c - exact) / step) <= 0.5 + 1e-9
    # The padding tokens of a partial last block never count.
    nb = -(-tokens // BLOCK)
    assert np.isnan(exact[:, -1, tokens - (nb - 1) * BLOCK:]).all()
    assert not np.isnan(exact[:, :, :][:, : nb - 1]).any()


def test_bad_rank_is_refused(rng: np.random.Generator) -> None:
    k, q = _keys_and_queries(rng, 8, 40)
    for r in (0, 9):
        with pytest.raises(ValueError, match="rank"):
            lowrank.key_pca(k, r)
        with pytest.raises(ValueError, match="rank"):
            lowrank.query_aware(k, q, r)


def test_record_bytes() -> None:
    assert lowrank.record_bytes(16, 8) == 16 * 16 + 2
    assert lowrank.record_bytes(31, 8) == 16 * 31 + 2
    assert lowrank.record_bytes(8, 0) == 16 * 8 * 2 + 2


def test_rotated_box_holds_every_token_and_kappa_one_at_rank_one_is_the_box_bound(
        rng: np.random.Generator) -> None:
    d = 12
    tokens = int(rng.integers(BLOCK + 1, 10 * BLOCK))
    k, q = _keys_and_queries(rng, d, tokens)
    basis = lowrank.query_aware(k, q, d)
    lo, hi = lowrank.block_boxes(k, tokens, basis)
    c = lowrank.block_coefficients(k, tokens, basis, bits=0)
    held = np.isnan(c) | ((c >= lo[:, :, None, :]) & (c <= hi[:, :, None, :]))
    assert held.all()
    # At rank 1 the CLT spread is |q'| w, so κ = 1 is the box's worst case, an upper
    # bound of every token's approximate score (here exact: the basis is a projection).
    one = lowrank.query_aware(k, q, 1)
    lo1, hi1 = lowrank.block_boxes(k, tokens, one)
    heads = q[:3]
    bound = lowrank.box_scores(heads, lo1, hi1, one, 1.0).astype(np.float64)
    c1 = lowrank.block_coefficients(k, tokens, one, bits=0)[0]  # [blocks, 16, 1]
    per_token = (heads.astype(np.float64) @ one.mu)[:, None, None] + np.einsum(
        "hr,btr->hbt", heads.astype(np.float64) @ one.queries, c1)
    assert np.all(bound >= np.nanmax(np.where(np.isnan(per_token), -np.inf, per_token), axis=2)
                  - 1e-4 * (1 + np.abs(bound)))
    assert lowrank.box_bytes(64) == 132
