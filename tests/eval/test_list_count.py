"""Tests of the list-count budget through core (eval/eps_eval/list_count.py, the budget
argument of libeps_eval's select).

The `rng` fixture (conftest.py) prints its seed; EPS_TEST_SEED=N replays it.
"""

from __future__ import annotations

import numpy as np
import pytest
from eps_eval import core
from eps_eval.list_count import ListCountConfig, ListCountSim, block_lse, group_lse
from eps_eval.metrics import BLOCK, dense, dots

FEATURES = core.KEY_SUM | core.QUEST8


def _seq(q: int, kv: int, d: int, g: int, tokens: int, coarse: int = 0) -> core.Sequence:
    return core.Sequence(q_heads=q, kv_heads=kv, head_dim=d, group_blocks=g, sketch_dim=8,
                         features=FEATURES, max_tokens=tokens, coarse_blocks=coarse)


def _forced(groups: int) -> np.ndarray:
    forced = np.zeros(groups, bool)
    forced[[0, groups - 2, groups - 1]] = True  # first_n = 1, last_n = 2
    return forced


def _n_best_by_summed_share(scores: np.ndarray, n: int, d: int) -> np.ndarray:
    """The rule in numpy: U = Σ_h softmax(s_h / √d) (−∞: no share), forced groups and the n
    best unforced groups by U."""
    s = scores.astype(np.float64) / np.sqrt(d)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    u = (w / w.sum(axis=1, keepdims=True)).sum(axis=0)
    forced = _forced(scores.shape[1])
    free = np.flatnonzero(~forced)
    keep = forced.copy()
    keep[free[np.argsort(-u[free], kind="stable")[:n]]] = True
    return keep


def _apply_feedback(scores: np.ndarray, entry: np.ndarray, d: int) -> np.ndarray:
    """core ApplyFeedback in numpy: fed groups score √d·entry, the others their score plus
    the head's median of (√d·entry − score) over the fed groups."""
    fed = np.isfinite(entry)
    out = scores.astype(np.float64).copy()
    for h in range(scores.shape[0]):
        offset = np.median(np.sqrt(d) * entry[h, fed[h]] - out[h, fed[h]]) if fed[h].any() else 0
        out[h] = np.where(fed[h], np.sqrt(d) * entry[h], out[h] + offset)
    return out


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_list_count_budget_keeps_the_n_best_groups_by_summed_softmax_share(
        rng: np.random.Generator, per_kv_head: bool) -> None:
    q, kv, d = 6, 2, 32
    for _ in range(4):
        tokens = int(rng.integers(400, 3000))
        s = _seq(q, kv, d, 1, tokens)
        s.append(rng.standard_normal((kv, tokens, d)) * 2)
        queries = (rng.standard_normal((q, d)) * 2).astype(np.float32)
        scores = s.scores("questclt", queries)
        n = int(rng.integers(1, s.groups - 3))
        vis, _ = s.select("questclt", queries, n, budget=core.list_count(n),
                          per_kv_head=per_kv_head)
        heads = [range(q)] if not per_kv_head else [range(i * q // kv, (i + 1) * q // kv)
                                                   for i in range(kv)]
        for lst, hs in enumerate(heads):
            want = _n_best_by_summed_share(scores[list(hs)], n, d)
            assert np.array_equal(vis[lst].astype(bool), want), (tokens, n, lst)
            assert vis[lst].sum() == n + 3
        # The mark path (core MarkByMassList on the same scores) agrees.
        marks = core.mark_mass(scores, kv, [1.0], temperature=1.0, head_dim=d, min_pages=n,
                               max_pages=n, per_kv_head=per_kv_head, scope="list")[0]
        assert np.array_equal(marks, vis)


def test_list_count_with_feedback_ranks_the_fed_scores(rng: np.random.Generator) -> None:
    q, kv, d, tokens = 4, 1, 32, 2000
    s = _seq(q, kv, d, 1, tokens)
    s.append(rng.standard_normal((kv, tokens, d)) * 2)
    queries = (rng.standard_normal((q, d)) * 2).astype(np.float32)
    scores = s.scores("questclt", queries)
    G = s.groups
    fed = rng.random(G) < 0.3
    entry = np.where(fed[None], rng.standard_normal((q, G)) * 3, np.nan).astype(np.float32)
    for n in (5, 20, 60):
        vis, _ = s.select("questclt", queries, n, budget=core.list_count(n), feedback=entry)
        want = _n_best_by_summed_share(_apply_feedback(scores, entry, d), n, d)
        assert np.array_equal(vis[0].astype(bool), want), n


def test_coarse_level_list_count_stays_in_the_candidates_or_fed_groups(
        rng: np.random.Generator) -> None:
    q, kv, d, gc, tokens = 4, 2, 32, 4, 2500
    keys = rng.standard_normal((kv, tokens, d)) * 2
    fine, flat = _seq(q, kv, d, 1, tokens, coarse=gc), _seq(q, kv, d, 1, tokens)
    coarse = _seq(q, kv, d, gc, tokens)
    for s in (fine, flat, coarse):
        s.append(keys)
    queries = (rng.standard_normal((q, d)) * 2).astype(np.float32)
    nb = fine.groups
    for n, top in ((10, 10), (30, 8), (60, 60)):
        vis, _ = fine.select("questclt", queries, top, coarse_candidates=2.0,
                             budget=core.list_count(n))
        # The candidates: each head's ceil(c · top_pages / gc) best unforced coarse groups.
        cs = coarse.scores("questclt", queries)
        cforced = np.zeros(cs.shape[1], bool)
        cforced[np.flatnonzero(_forced(nb)) // gc] = True
        want = -(-2 * top // gc)
        cand = cforced.copy()
        for h in range(q):
            free = np.flatnonzero(~cforced)
            cand[free[np.argsort(-cs[h, free], kind="stable")[:want]]] = True
        allowed = np.repeat(cand, gc)[:nb]
        assert not (vis[0].astype(bool) & ~allowed).any(), (n, top)
        # Within them, the n best by the summed share of each head's allowed groups.
        sc = np.where(allowed[None], fine.scores("questclt", queries), -np.inf)
        assert np.array_equal(vis[0].astype(bool), _n_best_by_summed_share(sc, n, d) & allowed)
    # With every coarse group a candidate, the flat selection.
    every, _ = fine.select("questclt", queries, 20, coarse_candidates=1024.0,
                           budget=core.list_count(20))
    plain, _ = flat.select("questclt", queries, 20, budget=core.list_count(20))
    assert np.array_equal(every, plain)


def test_block_lse_is_the_log_mass_and_groups_combine_it(rng: np.random.Generator) -> None:
    q, kv, d, tokens = 4, 2, 16, 1000
    k = rng.standard_normal((kv, tokens, d)).astype(np.float32)
    qs = rng.standard_normal((q, d)).astype(np.float32)
    lse = block_lse(qs, k)
    logits = dots(qs, k).astype(np.float64) / np.sqrt(d)
    total = np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert np.allclose(np.exp(lse - total), dense(qs, k, k).mass)
    g2 = group_lse(lse, 2)
    pad = np.pad(logits, ((0, 0), (0, 2 * BLOCK * g2.shape[1] - tokens)),
                 constant_values=-np.inf).reshape(q, g2.shape[1], 2 * BLOCK)
    assert np.allclose(g2, np.log(np.exp(pad).sum(axis=2)))


def test_steady_state_feeds_each_step_the_previous_lists_exact_log_mass(
        rng: np.random.Generator) -> None:
    """ListCountSim's fed list at a measured step is what running core by hand gives: the
    first warm-up step unfed, every later one fed the lse of the list before it under that
    step's query, over that step's keys."""
    q, kv, d, tokens, warmup = 4, 1, 32, 1500, 3
    k = (rng.standard_normal((kv, tokens, d)) * 2).astype(np.float32)
    qs = {p: (rng.standard_normal((q, d)) * 2).astype(np.float32) for p in range(tokens)}
    cfg = ListCountConfig(4, 1, 2.0, "list", 0.5)
    fractions = (0.1, 0.3)
    sim = ListCountSim((cfg,), fractions, q, kv, d, tokens, warmup, 2.0 * d + 4)
    position = tokens - 2
    sweeps = sim.sweeps(k, qs, position, dense(qs[position], k[:, :position + 1],
                                               k[:, :position + 1]))
    assert [s[0] for s in sweeps] == ["epsd-lc-c2f4x2t0.5-questclt",
                                      "epsd-lcfb-c2f4x2t0.5-questclt"]
    for fi, f in enumerate(fractions):
        seq = _seq(q, kv, d, 1, tokens, coarse=4)
        prev = None
        for s in range(position - warmup, position + 1):
            seq.append(k[:, seq.tokens:s + 1])
            n = max(1, round(f * (seq.groups - 3)))
            fb = None
            if prev is not None:
                lse = block_lse(qs[s - 1], k[:, :s])
                fb = np.full((q, seq.groups), np.nan, np.float32)
                fb[:, :prev.size] = np.where(prev[None], lse, np.nan)
            vis, _ = seq.select("questclt", qs[s - 1], max(1, -(-n // 2)),
                                coarse_candidates=2.0, feedback=fb, budget=core.list_count(n))
            prev = vis[0].astype(bool)
        assert prev is not None
        assert np.array_equal(sim.previous[(cfg, fi)], prev), f


def test_select_refuses_an_unknown_budget_or_scope() -> None:
    s = _seq(2, 1, 16, 1, 200)
    s.append(np.zeros((1, 200, 16)))
    queries = np.ones((2, 16), np.float32)
    with pytest.raises(core.CoreError, match="unknown budget cheap"):
        s.select("questclt", queries, 4, budget=core.budget("cheap"))
    with pytest.raises(core.CoreError, match="unknown mass_scope layer"):
        s.select("questclt", queries, 4, budget=core.budget("mass", mass_scope="layer"))
    with pytest.raises(core.CoreError, match="min_pages=5 exceeds max_pages=2"):
        s.select("questclt", queries, 4, budget=core.budget("mass", min_pages=5, max_pages=2))


def test_core_list_count_is_the_simulations_list_level_rule(rng: np.random.Generator) -> None:
    """Given the same scores, core's list-count budget marks what feedback_memory's
    list-level rule (union_scores, then the n best for the list) marks."""
    from eps_eval.feedback_memory import union_scores

    q, kv, d, tokens = 8, 2, 64, 3000
    s = _seq(q, kv, d, 1, tokens)
    s.append(rng.standard_normal((kv, tokens, d)) * 2)
    queries = (rng.standard_normal((q, d)) * 2).astype(np.float32)
    scores = s.scores("questclt", queries)
    for n in (3, 40, 150):
        vis, _ = s.select("questclt", queries, n, budget=core.list_count(n))
        sim = core.mark(union_scores(scores.astype(np.float64), d), 1, [n])[0]
        assert np.array_equal(vis, sim), n
