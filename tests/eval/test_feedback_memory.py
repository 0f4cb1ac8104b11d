"""Tests of the feedback-memory simulation (eval/eps_eval/feedback_memory.py).

The `rng` fixture (conftest.py) prints its seed; EPS_TEST_SEED=N replays it.
"""

from __future__ import annotations

import itertools

import numpy as np
from eps_eval import feedback_memory as fm
from eps_eval import quality
from eps_eval.metrics import BLOCK, dense


def _sim(depth: int, heads: int, blocks: int, gc: int = 4) -> fm.FeedbackMemory:
    return fm.FeedbackMemory((depth,), (0.2,), gc, 2.0, 132.0, heads, 1, blocks, 0, "t")


def test_block_log_mass_is_dense_mass_up_to_each_heads_total(rng: np.random.Generator) -> None:
    h, d, tokens = 4, 64, int(rng.integers(3 * BLOCK, 20 * BLOCK))
    k = rng.standard_normal((1, tokens, d)).astype(np.float32)
    q = rng.standard_normal((h, d)).astype(np.float32)
    lse = fm.block_log_mass(q, k)
    everything = np.ones(lse.shape[1], dtype=bool)
    share = fm.log_share(lse, everything, d)
    mass = dense(q, k, np.zeros_like(k)).mass
    np.testing.assert_allclose(share, np.log(mass) * np.sqrt(d), atol=1e-6)


def test_log_share_of_the_visited_blocks_sums_to_one(rng: np.random.Generator) -> None:
    h, nb, d = 3, 40, 256
    lse = rng.standard_normal((h, nb)) * 30
    visited = rng.random(nb) < 0.3
    visited[0] = True
    share = fm.log_share(lse, visited, d)
    np.testing.assert_allclose(np.exp(share[:, visited] / np.sqrt(d)).sum(axis=1), 1.0)


def test_one_step_memory_ranks_as_the_harness_feedback_rule(rng: np.random.Generator) -> None:
    h, gc, Gc = 4, 4, 30
    nb = gc * Gc
    coarse = rng.standard_normal((h, Gc)).astype(np.float32)
    fine = rng.standard_normal((h, nb))
    exact = rng.standard_normal((h, nb)) * 3
    visited = rng.random(nb) < 0.25
    sim = _sim(1, h, nb, gc)
    mem = fm._Memory.empty(h, nb)
    mem.val[:, visited] = exact[:, visited]
    mem.stamp[visited] = 9
    cands = fm._Candidates.of(coarse, nb, gc, 0.2, 2.0, 1)
    got = sim._pick(mem, 1, "old", 10, fine, cands)
    want, _ = quality._c2f_pick(coarse, fine.astype(np.float32), gc, 0.2, 2.0, 1,
                                visited=visited, exact=exact.astype(np.float32))
    np.testing.assert_array_equal(got, want)


def test_old_memory_admits_a_block_outside_the_candidates(rng: np.random.Generator) -> None:
    h, gc, Gc = 2, 4, 30
    nb = gc * Gc
    # The candidates: the first coarse groups (eleven at this budget) and the forced ones.
    coarse = np.tile(-np.arange(Gc, dtype=np.float32), (h, 1))
    fine = rng.standard_normal((h, nb))
    cands = fm._Candidates.of(coarse, nb, gc, 0.2, 2.0, 1)
    outside = 80  # coarse group 20, no candidate
    assert not cands.cblock[outside]
    mem = fm._Memory.empty(h, nb)
    mem.val[:, outside] = 100.0
    mem.stamp[outside] = 7  # visited three steps before step 10
    assert sim_pick(mem, 4, cands, fine)[0, outside] == 1
    assert sim_pick(mem, 2, cands, fine)[0, outside] == 0  # older than K steps


def sim_pick(mem: fm._Memory, depth: int, cands: fm._Candidates,
             fine: np.ndarray) -> np.ndarray:
    return _sim(depth, fine.shape[0], fine.shape[1])._pick(mem, depth, "old", 10, fine, cands)


def test_union_scores_of_exact_shares_give_the_best_list_of_n_blocks(
        rng: np.random.Generator) -> None:
    h, nb, d, n = 3, 8, 64, 3
    mass = rng.dirichlet(np.full(nb, 0.3), size=h)  # [h, nb], each head sums to 1
    u = fm.union_scores(np.log(mass) * np.sqrt(d), d)[0]
    chosen = np.argsort(-u)[:n]
    best = max(mass[:, list(c)].sum() for c in itertools.combinations(range(nb), n))
    np.testing.assert_allclose(mass[:, chosen].sum(), best)
