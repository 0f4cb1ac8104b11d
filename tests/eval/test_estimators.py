"""Tests of the estimators from the quest8 record (eval/eps_eval/estimators.py).

The `rng` fixture (conftest.py) prints its seed; EPS_TEST_SEED=N replays it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from eps_eval import estimators, quality
from eps_eval.metrics import BLOCK


def _tables(rng: np.random.Generator, d: int, g: int) -> tuple[quality.QuestTables, np.ndarray]:
    kv, h = 2, 4
    tokens = int(rng.integers(1, 30 * BLOCK))
    k = (rng.standard_normal((kv, tokens, d)) * rng.uniform(0.1, 20, d)).astype(np.float32)
    q = rng.standard_normal((h, d)).astype(np.float32)
    return quality.QuestTables(k, tokens, g), q


@pytest.mark.parametrize("g", [1, 4])
def test_clt_with_one_channel_and_unit_kappa_is_quest8(rng: np.random.Generator, g: int) -> None:
    # With d = 1 the L2 and L1 spreads coincide: κ = 1 is the worst case of the box.
    t, q = _tables(rng, 1, g)
    np.testing.assert_allclose(t.estimate("questclt1", q), t.scores(q), rtol=1e-5, atol=1e-4)


def test_blend_at_one_is_quest8_and_at_zero_is_the_centre(rng: np.random.Generator) -> None:
    t, q = _tables(rng, 64, 2)
    np.testing.assert_allclose(t.estimate("questblend1", q), t.scores(q), rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(t.estimate("questblend0", q), t.estimate("questclt0", q),
                               rtol=1e-5, atol=1e-3)


def test_clt_grows_with_kappa_and_stays_below_quest8_up_to_one(rng: np.random.Generator) -> None:
    t, q = _tables(rng, 64, 1)
    kappas = (0, 0.25, 0.5, 1, 1.5, 3)
    sc = [t.estimate(f"questclt{k:g}", q).astype(np.float64) for k in kappas]
    for lo, hi in itertools.pairwise(sc):
        assert np.all(hi >= lo - 1e-3)
    # sqrt(Σ q²w²) <= Σ |q| w: at κ <= 1 the estimate never exceeds the bound.
    assert np.all(sc[3] <= t.scores(q) + 1e-3)


def test_lognormal_estimate_matches_the_mass_of_keys_uniform_on_their_box(
        rng: np.random.Generator) -> None:
    # One group of many tokens whose channels are independent and uniform on [lo, hi]:
    # √d · log mean exp(q·k / √d) is what questlgn estimates (CLT over d channels).
    d, n = 128, 1 << 15
    lo = rng.uniform(-2, 0, d)
    hi = lo + rng.uniform(0.5, 3, d)
    k = (lo + (hi - lo) * rng.random((1, n, d))).astype(np.float32)
    q = (rng.standard_normal((1, d)) * 0.8).astype(np.float32)
    t = quality.QuestTables(k, n, n // BLOCK)
    est = float(t.estimate("questlgn", q)[0, 0])
    x = (k[0].astype(np.float64) @ q[0].astype(np.float64)) / np.sqrt(d)
    truth = np.sqrt(d) * (np.log(np.mean(np.exp(x - x.max()))) + x.max())
    spread = float(np.sqrt(d) * x.std())
    # The int8 record widens each range by at most one code; the rest is the CLT's error.
    assert abs(est - truth) < 0.05 * spread + 0.05, (est, truth, spread)


def test_moment_record_scores_the_mass_of_normal_keys(rng: np.random.Generator) -> None:
    # Keys normal per channel (independent): q·k is normal, so the lognormal mass is exact
    # up to sampling and the int8 rounding of the mean and std.
    d, n, g = 64, 1 << 14, 64
    mu, sd = rng.uniform(-1, 1, d), rng.uniform(0.2, 1.5, d)
    k = (mu + sd * rng.standard_normal((1, n, d))).astype(np.float32)
    q = (rng.standard_normal((1, d)) * 0.7).astype(np.float32)
    est = estimators.MomentTables(k, n, g).scores(q)[0]  # [n / (16 g)] groups
    x = (k[0].astype(np.float64) @ q[0].astype(np.float64)).reshape(-1, g * BLOCK) / np.sqrt(d)
    top = x.max(axis=1, keepdims=True)
    truth = np.sqrt(d) * (np.log(np.mean(np.exp(x - top), axis=1)) + top[:, 0])
    spread = float(np.sqrt(d) * x.std())
    assert np.all(np.abs(est - truth) < 0.1 * spread), (est - truth, spread)


def test_moment_record_of_one_repeated_key_scores_that_key(rng: np.random.Generator) -> None:
    d = 32
    key = rng.standard_normal(d).astype(np.float32)
    k = np.broadcast_to(key, (1, 3 * BLOCK, d)).copy()
    q = rng.standard_normal((2, d)).astype(np.float32)
    est = estimators.MomentTables(k, 3 * BLOCK, 1).scores(q)
    np.testing.assert_allclose(est, np.repeat((q @ key)[:, None], 3, axis=1),
                               atol=np.abs(q).sum() * np.abs(key).max() / 127)


def test_estimators_cost_quest8_bytes() -> None:
    for name in estimators.ESTIMATORS:
        assert quality.record_bytes(name, 256) == quality.record_bytes("quest8", 256)


def test_an_unknown_estimator_is_refused() -> None:
    with pytest.raises(ValueError, match="questfoo"):
        estimators.estimate("questfoo", np.zeros((1, 4), np.float32), np.zeros((1, 1, 4)),
                            np.zeros((1, 1, 4)))


def test_meanclt_is_questclt_moved_from_the_midpoint_to_the_mean(rng: np.random.Generator) -> None:
    # Same spread term; only the centre differs: meanclt − questclt = q·(mean8 − mid).
    t, q = _tables(rng, 64, 2)
    mid = 0.5 * (t.min8 + t.max8)
    shift = np.stack([(t.mean8[i // 2] - mid[i // 2]) @ q[i].astype(np.float64) for i in range(4)])
    np.testing.assert_allclose(t.estimate("meanclt1", q) - t.estimate("questclt1", q), shift,
                               rtol=1e-4, atol=1e-2)


def test_meanclt_of_one_repeated_key_scores_that_key(rng: np.random.Generator) -> None:
    # A group of one key repeated has no spread: its score is q·key up to int8 rounding.
    d = 32
    key = rng.standard_normal(d).astype(np.float32)
    k = np.broadcast_to(key, (1, 3 * BLOCK, d)).copy()
    q = rng.standard_normal((2, d)).astype(np.float32)
    est = quality.QuestTables(k, 3 * BLOCK, 1).estimate("meanclt1", q)
    np.testing.assert_allclose(est, np.repeat((q @ key)[:, None], 3, axis=1),
                               atol=3 * np.abs(q).sum() * np.abs(key).max() / 127)


def test_meanclt_costs_the_mean_beside_quest8() -> None:
    assert quality.record_bytes("meanclt1", 256) == quality.record_bytes("quest8", 256) + 256 + 4


def test_meanclt_without_the_mean_is_refused() -> None:
    with pytest.raises(ValueError, match="mean key"):
        estimators.estimate("meanclt1", np.zeros((1, 4), np.float32), np.zeros((1, 1, 4)),
                            np.zeros((1, 1, 4)))
