"""Tests of issue 19's scorers and the mass-budget binding (eval/eps_eval/quality.py).

Fresh random inputs each run; the seed is printed (EPS_TEST_SEED=N replays it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "eval"))

from eps_eval import core, quality
from eps_eval.metrics import BLOCK, dots, group_max


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(os.environ.get("EPS_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"EPS_TEST_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("g", [1, 2, 8])
def test_quest8_stays_an_upper_bound_and_near_quest(rng: np.random.Generator, g: int) -> None:
    kv, h, d = 2, 4, 64
    tokens = int(rng.integers(1, 40 * BLOCK))
    k = (rng.standard_normal((kv, tokens, d)) * rng.uniform(0.1, 30, d)).astype(np.float32)
    q = rng.standard_normal((h, d)).astype(np.float32)
    tables = quality.QuestTables(k, tokens, g)
    q8 = tables.scores(q)
    blocks = group_max(np.pad(dots(q, k), ((0, 0), (0, -(-tokens // BLOCK) * BLOCK - tokens)),
                              constant_values=-np.inf).reshape(h, -1, BLOCK).max(2), g)
    assert np.all(q8 >= blocks - 1e-3 * np.abs(blocks) - 1e-4)
    s = core.Sequence(q_heads=h, kv_heads=kv, head_dim=d, group_blocks=g, sketch_dim=8,
                      features=core.QUEST, max_tokens=tokens)
    s.append(k)
    quest = s.scores("quest", q)
    # Each channel's range widens by at most one code on each side, and a code is the
    # group's scale: the largest |k| over all of the group's channels / 127 (not the
    # channel's own), at most the KV head's largest |k| / 127.
    code = np.abs(k).max(axis=(1, 2)) / 127.0 * (1 + 1e-6)  # [kv]
    widen = np.abs(q).sum(axis=1)[:, None] * code[None, :]  # [h, kv] bound of the widening
    slack = 2 * widen[np.arange(h), np.arange(h) // 2][:, None] + 1e-3
    assert np.all(q8 <= quest + slack)
    # The mean-key score is a lower bound of the group maximum.
    assert np.all(tables.mean_scores(q) <= blocks + 1e-3 * np.abs(blocks) + 1e-4)


def test_mark_mass_reaches_the_target_share_of_the_estimate(rng: np.random.Generator) -> None:
    kv, h, d, n = 2, 4, 64, int(rng.integers(5, 400))
    scores = (rng.standard_normal((h, n)) * 20).astype(np.float32)
    targets = [0.5, 0.9, 0.99]
    for tau in (0.5, 1.0, 3.0):
        marks = core.mark_mass(scores, kv, targets, temperature=tau, head_dim=d)
        for i, p in enumerate(targets):
            for head in range(h):
                w = np.exp((scores[head].astype(np.float64) - scores[head].max()) / (tau * np.sqrt(d)))
                assert w[marks[i, 0] == 1].sum() >= p * w.sum() - 1e-9
        counts = marks.sum(axis=2)[:, 0]
        assert np.all(np.diff(counts) >= 0), "a higher target never keeps fewer groups"


def test_mark_mass_refuses_a_bad_target() -> None:
    with pytest.raises(core.CoreError, match="mass_target=1.5"):
        core.mark_mass(np.zeros((1, 8), np.float32), 1, [1.5], temperature=1.0, head_dim=16)


@pytest.mark.parametrize("g", [1, 4])
def test_growing_quest_tables_score_as_tables_built_from_scratch(rng: np.random.Generator,
                                                                 g: int) -> None:
    kv, h, d = 1, 4, 32
    total = int(rng.integers(3 * g * BLOCK, 12 * g * BLOCK))
    k = (rng.standard_normal((kv, total, d)) * rng.uniform(0.1, 10, d)).astype(np.float32)
    grow = quality.GrowingQuestTables(g)
    start = int(rng.integers(1, total - 2 * g * BLOCK))
    grow.grow(k, start)
    fork = grow.copy()
    for tokens in range(start, total + 1, max(1, (total - start) // 9)):
        q = rng.standard_normal((h, d)).astype(np.float32)
        want = quality.QuestTables(k, tokens, g).scores(q)
        np.testing.assert_allclose(grow.scores(k, tokens, q), want, rtol=1e-6, atol=1e-5)
    # The copy made before growing still scores its own, shorter prefix.
    q = rng.standard_normal((h, d)).astype(np.float32)
    np.testing.assert_allclose(fork.scores(k, start, q), quality.QuestTables(k, start, g).scores(q),
                               rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(("method", "features"), [("jl", 0), ("quest", core.QUEST)])
def test_the_passkey_gates_minimal_record_scores_as_the_full_one(
        rng: np.random.Generator, method: str, features: int) -> None:
    """run_gemma's gates build only the record their method reads."""
    tokens = int(rng.integers(BLOCK, 30 * BLOCK))
    k = rng.standard_normal((1, tokens, 64)).astype(np.float32)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    out = []
    for feats in (core.ALL_FEATURES, features):
        s = core.Sequence(q_heads=4, kv_heads=1, head_dim=64, group_blocks=2, sketch_dim=8,
                          features=feats, max_tokens=tokens)
        s.append(k)
        out.append(s.scores(method, q))
    np.testing.assert_array_equal(out[0], out[1])
