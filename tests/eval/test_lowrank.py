"""Tests of the per-token low-rank key summaries (eval/eps_eval/lowrank.py).

The `rng` fixture (conftest.py) prints its seed; EPS_TEST_SEED=N replays it.
"""

from __future__ import annotations

import numpy as np
import pytest
from eps_eval import lowrank
from eps_eval.metrics import BLOCK


def _keys_and_queries(rng: np.random.Generator, d: int, n: int, kv: int = 1,
                      heads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Keys [kv, n, d] and queries [4n, heads, d], anisotropic, each KV head's own shape
    and large directions that differ from its queries', so that the basis choice matters."""
    keys, queries = [], []
    for _ in range(kv):
        mix_k = rng.standard_normal((d, d)) * rng.uniform(0.05, 3, d)
        keys.append(rng.standard_normal((n, d)) @ mix_k + rng.standard_normal(d))
        mix_q = rng.standard_normal((d, d)) * rng.uniform(0.05, 3, d)
        queries.append(rng.standard_normal((4 * n, heads // kv, d)) @ mix_q)
    return (np.stack(keys).astype(np.float32),
            np.concatenate(queries, axis=1).astype(np.float32))


def _exact_log_mass(q: np.ndarray, k: np.ndarray, tokens: int) -> np.ndarray:
    """√d · log Σ exp(q·k / √d) per block, q [H, d] over k [kv, T, d] (GQA)."""
    h, d = q.shape
    kv = k.shape[0]
    s = np.stack([q[i].astype(np.float64) @ k[i // (h // kv), :tokens].astype(np.float64).T
                  for i in range(h)])  # [H, tokens]
    nb = -(-tokens // BLOCK)
    s = np.pad(s, ((0, 0), (0, nb * BLOCK - tokens)), constant_values=-np.inf)
    s = s.reshape(h, nb, BLOCK)
    top = s.max(axis=2, keepdims=True)
    return top[..., 0] + np.sqrt(d) * np.log(np.exp((s - top) / np.sqrt(d)).sum(axis=2))


@pytest.mark.parametrize("make", ["pca", "query"])
def test_full_rank_unrounded_scores_are_each_blocks_exact_log_mass(
        rng: np.random.Generator, make: str) -> None:
    d, kv, heads = 16, 2, 4
    tokens = int(rng.integers(BLOCK + 1, 12 * BLOCK))
    k, q = _keys_and_queries(rng, d, tokens, kv, heads)
    basis = lowrank.key_pca(k, d) if make == "pca" else lowrank.query_aware(k, q, d)
    c = lowrank.block_coefficients(k, tokens, basis, bits=0)
    now = q[0]  # [H, d]: one query a head
    np.testing.assert_allclose(lowrank.block_scores(now, c, basis),
                               _exact_log_mass(now, k, tokens), rtol=1e-4, atol=1e-3)


def test_each_kv_head_gets_its_own_basis(rng: np.random.Generator) -> None:
    d = 12
    k, q = _keys_and_queries(rng, d, 400, kv=2, heads=4)
    both = lowrank.query_aware(k, q, 3)
    alone = lowrank.query_aware(k[1:], q[:, 2:], 3)  # KV head 1 and its query heads 2, 3
    np.testing.assert_allclose(both.mu[1], alone.mu[0])
    # Eigenvectors are unique up to sign (the test data's eigenvalues are distinct).
    np.testing.assert_allclose(np.abs(both.keys[1]), np.abs(alone.keys[0]), rtol=1e-6,
                               atol=1e-9)
    assert not np.allclose(both.mu[0], both.mu[1])


def test_query_aware_basis_beats_key_pca_on_its_queries(rng: np.random.Generator) -> None:
    d, n, r = 32, 2000, 6
    k, q = _keys_and_queries(rng, d, n)
    qq, kk = q[:, 0].astype(np.float64), k[0].astype(np.float64)
    truth = qq @ kk.T

    def err(b: lowrank.Basis) -> float:
        c = (kk - b.mu[0]) @ b.keys[0]
        approx = (qq @ b.mu[0])[:, None] + (qq @ b.queries[0]) @ c.T
        return float(np.mean((approx - truth) ** 2))

    assert err(lowrank.query_aware(k, q, r)) < err(lowrank.key_pca(k, r))


def test_rounded_coefficients_stay_within_half_a_step(rng: np.random.Generator) -> None:
    d, r = 24, 5
    tokens = int(rng.integers(2, 9 * BLOCK))
    k, q = _keys_and_queries(rng, d, tokens, kv=2, heads=2)
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
    assert not np.isnan(exact[:, : nb - 1]).any()


def test_bad_shapes_and_ranks_are_refused(rng: np.random.Generator) -> None:
    k, q = _keys_and_queries(rng, 8, 40, kv=2, heads=4)
    for r in (0, 9):
        with pytest.raises(ValueError, match="rank"):
            lowrank.key_pca(k, r)
        with pytest.raises(ValueError, match="rank"):
            lowrank.query_aware(k, q, r)
    with pytest.raises(ValueError, match=r"\[kv, T, d\]"):
        lowrank.key_pca(k[0], 2)
    with pytest.raises(ValueError, match="multiple of kv"):
        lowrank.query_aware(k, q[:, :3], 2)


def test_record_bytes() -> None:
    assert lowrank.record_bytes(16, 8) == 16 * 16 + 2
    assert lowrank.record_bytes(31, 8) == 16 * 31 + 2
    assert lowrank.record_bytes(8, 0) == 16 * 8 * 2 + 2
    assert lowrank.box_bytes(64) == 132


def test_rotated_box_holds_every_token_and_kappa_one_at_rank_one_is_the_box_bound(
        rng: np.random.Generator) -> None:
    d, kv, heads = 12, 2, 4
    tokens = int(rng.integers(BLOCK + 1, 10 * BLOCK))
    k, q = _keys_and_queries(rng, d, tokens, kv, heads)
    basis = lowrank.query_aware(k, q, d)
    lo, hi = lowrank.block_boxes(k, tokens, basis)
    c = lowrank.block_coefficients(k, tokens, basis, bits=0)
    held = np.isnan(c) | ((c >= lo[:, :, None, :]) & (c <= hi[:, :, None, :]))
    assert held.all()
    # At rank 1 the CLT spread is |q'| w, so κ = 1 is the box's worst case, an upper
    # bound of every token's approximate score.
    one = lowrank.query_aware(k, q, 1)
    lo1, hi1 = lowrank.block_boxes(k, tokens, one)
    now = q[0].astype(np.float64)  # [H, d]
    bound = lowrank.box_scores(q[0], lo1, hi1, one, 1.0).astype(np.float64)
    c1 = lowrank.block_coefficients(k, tokens, one, bits=0)  # [kv, blocks, 16, 1]
    for i in range(heads):
        j = i // (heads // kv)
        per_token = now[i] @ one.mu[j] + c1[j, :, :, 0] * (now[i] @ one.queries[j][:, 0])
        top = np.nanmax(np.where(np.isnan(per_token), -np.inf, per_token), axis=1)
        assert np.all(bound[i] >= top - 1e-4 * (1 + np.abs(bound[i])))


def test_own_blocks_at_full_rank_give_each_blocks_exact_log_mass(
        rng: np.random.Generator) -> None:
    d, kv, heads = 24, 2, 4
    tokens = int(rng.integers(BLOCK + 1, 12 * BLOCK))
    k, q = _keys_and_queries(rng, d, tokens, kv, heads)
    now = q[0]
    exact = _exact_log_mass(now, k, tokens)
    full = lowrank.own_blocks(k, tokens, BLOCK, rounded=False)
    assert np.allclose(full.resid, 0.0, atol=1e-9)
    np.testing.assert_allclose(lowrank.own_scores(now, full), exact, rtol=1e-4, atol=1e-3)
    # Rounded, and at lower rank, the estimate moves away from it, rank 2 more than rank 8.
    err = {r: np.abs(lowrank.own_scores(now, lowrank.own_blocks(k, tokens, r)) - exact).mean()
           for r in (2, 8)}
    assert 0 < err[8] < err[2]
    # At rank 0 the residual is each block's mean squared distance to its mean key.
    zero = lowrank.own_blocks(k, tokens, 0, rounded=False)
    first = k[:, :BLOCK].astype(np.float64)
    np.testing.assert_allclose(
        zero.resid[:, 0], ((first - first.mean(axis=1, keepdims=True)) ** 2).sum((1, 2)) / BLOCK)
    with pytest.raises(ValueError, match="rank"):
        lowrank.own_blocks(k, tokens, BLOCK + 1)
    assert lowrank.own_bytes(1, 256) == 2 * 258 + 16 + 4


def test_recall_at_is_nan_outside_the_sweep() -> None:
    from eps_eval.run_lowrank import recall_at

    # A sweep that never skips 75 % (a short context): no recall "at 75 %", not the end's.
    assert np.isnan(recall_at(np.array([0.9, 0.95, 0.99]), np.array([0.1, 0.25, 0.4])))
    assert recall_at(np.array([0.9, 0.8]), np.array([0.7, 0.8])) == pytest.approx(0.85)


def test_a_wider_forced_window_keeps_recent_blocks_the_lagged_query_misses(
    rng: np.random.Generator,
) -> None:
    # run_lowrank --window: the current query reads blocks 116-123 (not the newest two,
    # which every row forces), the previous query, orthogonal to it, blocks 10-17 and,
    # more weakly, 30-53 (enough to fill the lists at 75 % skipped); forcing the newest 12
    # blocks must keep what the lag loses, and the forced blocks cost no summary bytes.
    from eps_eval import run_lowrank

    d, nb = 32, 128
    c = nb * BLOCK
    k = rng.standard_normal((1, c, d)).astype(np.float32) * 0.1
    v = rng.standard_normal((1, c, d)).astype(np.float32)
    now = rng.standard_normal(d)
    now /= np.linalg.norm(now)
    before = rng.standard_normal(d)
    before -= (before @ now) * now
    before /= np.linalg.norm(before)
    k[0, 116 * BLOCK:124 * BLOCK] += 3.0 * now
    k[0, 10 * BLOCK:18 * BLOCK] += 3.0 * before
    k[0, 30 * BLOCK:54 * BLOCK] += 1.5 * before
    q, q_lag = (8.0 * now)[None, :].astype(np.float32), (8.0 * before)[None, :].astype(np.float32)
    out = run_lowrank.pair_rows(k, v, q, q_lag, c, {}, windows=(2, 12))
    assert out["w2-lag1"] == pytest.approx(out["lag1"])
    assert out["w12-lag1"] > out["lag1"] + 0.3
    assert out["w12-questclt1"] > out["questclt1"] + 0.3
    assert run_lowrank.record_of("w12-questclt1", d) == run_lowrank.record_of("questclt1", d)
