"""Tests of issue 19's scorers and the mass-budget binding (eval/eps_eval/quality.py).

The `rng` fixture (conftest.py) prints its seed; EPS_TEST_SEED=N replays it.
"""

from __future__ import annotations

import numpy as np
import pytest
from eps_eval import core, plans, quality
from eps_eval.metrics import BLOCK, dots, group_max


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


@pytest.mark.parametrize("g", [1, 2, 8])
def test_quest8_pow2_scale_stays_a_bound_and_is_what_an_incremental_writer_keeps(
        rng: np.random.Generator, g: int) -> None:
    kv, h, d = 2, 4, 64
    tokens = int(rng.integers(1, 20 * BLOCK))
    k = (rng.standard_normal((kv, tokens, d)) * rng.uniform(0.1, 30, d)).astype(np.float32)
    q = rng.standard_normal((h, d)).astype(np.float32)
    pow2 = quality.QuestTables(k, tokens, g, "pow2")
    blocks = group_max(np.pad(dots(q, k), ((0, 0), (0, -(-tokens // BLOCK) * BLOCK - tokens)),
                              constant_values=-np.inf).reshape(h, -1, BLOCK).max(2), g)
    assert np.all(pow2.scores(q) >= blocks - 1e-3 * np.abs(blocks) - 1e-4)
    # A writer that sees the keys one at a time, with a power-of-two scale that grows as
    # it must and codes requantized by floor (minima) and ceil (maxima), ends with the
    # same record (here for the first group of the first KV head).
    gt = g * BLOCK
    keys = k[0, :min(gt, tokens)].astype(np.float64)
    scale, lo, hi = 0.0, None, None
    for key in keys:
        need = float(quality.quest8_pow2_scale(np.array(np.abs(key).max())))
        if lo is not None and need > scale:
            step = need / scale  # an integer power of two
            lo, hi = np.floor(lo / step), np.ceil(hi / step)
        scale = max(scale, need)
        lo = np.floor(key / scale) if lo is None else np.minimum(lo, np.floor(key / scale))
        hi = np.ceil(key / scale) if hi is None else np.maximum(hi, np.ceil(key / scale))
    np.testing.assert_array_equal(lo * scale, pow2.min8[0, 0])
    np.testing.assert_array_equal(hi * scale, pow2.max8[0, 0])
    with pytest.raises(ValueError, match="quest8 scale"):
        quality.QuestTables(k, tokens, g, "fp16")


def _smallest_holding_power_of_two(a: float) -> float:
    """The quest8 scale by its definition: the smallest 2^e, e >= -149, with 127·2^e >= a."""
    e = -149
    while 127 * 2.0**e < a:
        e += 1
    return 2.0**e


def test_cores_quest8_scale_is_the_smallest_power_of_two_that_holds_the_largest_key(
        rng: np.random.Generator) -> None:
    # core's Quest8ScaleFor through libeps_eval, at 127·2^e exactly (2^e: the harness once
    # widened it by 1e-6 first and took 2^(e+1)), one float32 below (2^e) and one above
    # (2^(e+1)), from the smallest float32 scale to the largest, and at random magnitudes.
    e = np.concatenate([[-149, -126, 0, 120], rng.integers(-149, 121, 30)])
    exact = np.ldexp(np.float32(127.0), e).astype(np.float32)
    assert np.all(exact.astype(np.float64) == 127 * np.ldexp(1.0, e))  # no rounding
    amax = np.concatenate([exact, np.nextafter(exact, np.float32(0)),
                           np.nextafter(exact, np.float32(np.inf)),
                           (10.0 ** rng.uniform(-44, 38, 200)).astype(np.float32),
                           [np.float32(1e-45)]])
    scales = core.quest8_scales(amax)
    assert scales.dtype == np.float32 and scales.shape == amax.shape
    for a, s in zip(amax, scales):
        assert s == _smallest_holding_power_of_two(float(a)), (a, s)
    np.testing.assert_array_equal(scales[: len(e)], np.ldexp(1.0, e))
    for bad in (0.0, -1.0, np.nan, np.inf):
        with pytest.raises(core.CoreError, match=r"amax\[1\]=.* is not a finite number > 0"):
            core.quest8_scales([1.0, bad])


def test_the_harness_pow2_scale_is_cores_for_float64_magnitudes_too(
        rng: np.random.Generator) -> None:
    # quality reads float64 magnitudes: one float64 step below 127·2^e still gets 2^e, one
    # above gets 2^(e+1), although neither is a float32; 0 gets 1 (its codes are 0).
    e = rng.integers(-149, 121, 30)
    exact = 127 * np.ldexp(1.0, e)
    amax = np.concatenate([exact, np.nextafter(exact, 0), np.nextafter(exact, np.inf),
                           10.0 ** rng.uniform(-44, 38, 200)])
    for a, s in zip(amax, quality.quest8_pow2_scale(amax)):
        assert s == _smallest_holding_power_of_two(a), (a, s)
    grid = np.abs(rng.standard_normal((2, 5, 1)).astype(np.float32)).astype(np.float64)
    np.testing.assert_array_equal(quality.quest8_pow2_scale(grid), core.quest8_scales(grid))
    assert quality.quest8_pow2_scale(np.array([0.0])) == 1.0


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


def test_mark_mass_union_takes_the_fewest_groups_whose_mean_share_reaches_the_target(
        rng: np.random.Generator) -> None:
    # core MarkByMassList (through libeps_eval) against the rule recomputed in numpy.
    h, d, n = 4, 64, int(rng.integers(8, 300))
    scores = (rng.standard_normal((h, n)) * 20).astype(np.float32)
    scores[0, 3] = -np.inf  # an empty group: no share
    targets = [0.5, 0.9, 0.99, 1.0]
    tau = 1.0
    w = np.exp((scores.astype(np.float64) - scores.max(axis=1, keepdims=True)) / (tau * np.sqrt(d)))
    w[~np.isfinite(scores)] = 0.0
    share = (w / w.sum(axis=1, keepdims=True)).mean(axis=0)
    forced = np.zeros(n, bool)
    forced[[0, n - 2, n - 1]] = True
    marks = quality.mark_mass_union(scores, targets, temperature=tau, head_dim=d)
    assert marks.shape == (len(targets), 1, n)
    for i, p in enumerate(targets):
        m = marks[i, 0] == 1
        assert m[forced].all()
        assert share[m].sum() >= p - 1e-6 or m.all()  # core rounds shares to float
        # fewest: dropping the smallest-share unforced group taken falls short of the target
        taken = np.nonzero(m & ~forced)[0]
        if p < 1.0 and taken.size:
            assert share[m].sum() - share[taken].min() < p + 1e-6
    counts = marks.sum(axis=2)[:, 0]
    assert np.all(np.diff(counts) >= 0), "a higher target never keeps fewer groups"
    # the floor: the first min_pages unforced groups by share, whatever the target
    floor = quality.mark_mass_union(scores, [0.01], temperature=tau, head_dim=d, min_pages=5)
    assert floor[0, 0, ~forced].sum() == min(5, int((~forced).sum()))
    with pytest.raises(core.CoreError, match="mass_target=1.5 not in"):
        quality.mark_mass_union(scores, [1.5], temperature=tau, head_dim=d)


def test_mark_mass_union_never_keeps_more_than_the_union_of_per_head_budgets(
        rng: np.random.Generator) -> None:
    # With one head the two budgets are the same rule; with several, a union list
    # needs no head to reach the target alone.
    kv, d, n = 1, 64, int(rng.integers(20, 300))
    one = (rng.standard_normal((1, n)) * 20).astype(np.float32)
    targets = [0.5, 0.8, 0.95]
    per_head = core.mark_mass(one, kv, targets, temperature=1.0, head_dim=d)
    union = quality.mark_mass_union(one, targets, temperature=1.0, head_dim=d)
    assert np.array_equal(per_head, union)
    many = (rng.standard_normal((8, n)) * 20).astype(np.float32)
    per_head = core.mark_mass(many, kv, targets, temperature=1.0, head_dim=d)
    union = quality.mark_mass_union(many, targets, temperature=1.0, head_dim=d)
    assert np.all(union.sum(axis=2) <= per_head.sum(axis=2))


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


def test_estimator_plan_rows_cost_the_quest8_record(rng: np.random.Generator) -> None:
    from eps_eval import estimators, synthetic

    tokens, d = 1024, 32
    tr = synthetic.make_layer("multi", tokens, [tokens - 2, tokens - 1], q_heads=4, kv_heads=2,
                              head_dim=d, seed=int(rng.integers(1 << 30)))
    plan = plans.ESTIMATOR_PLAN
    state = quality.LayerState(plan, 4, 2, d, tokens)
    rows = quality.step_rows(state, tr.k, tr.v, tr.q, tokens - 1, {"workload": "test"})
    frac = {(r["method"], r["g"], r["param"]): r["summary_frac"] for r in rows
            if r["budget"] == "threshold"}
    for name in estimators.ESTIMATORS:
        for g in plan.group_blocks:
            keys = [key for key in frac if key[0] == name and key[1] == g]
            assert keys, (name, g)
            for key in keys:
                assert frac[key] == frac[("quest8", g, key[2])]
    c2f = {r["method"] for r in rows if r["budget"] == "c2f"}
    assert c2f == {f"c2f{gc}x{c:g}" + ("" if s == "quest8" else f"-{s}")
                   for gc in plan.c2f_coarse for c in plan.c2f_candidates for s in plan.c2f_scorers}


def test_paired_gain_of_a_constant_shift_is_that_shift(rng: np.random.Generator) -> None:
    from eps_eval import report_quality

    base, shifted = [], []
    for layer in range(3):
        for step in range(4):
            pair = {"workload": "w", "kind": "k", "context": 1.0, "layer": float(layer),
                    "step": float(step)}
            for skip in (0.5, 0.7, 0.9):
                rec = float(rng.uniform(0.3, 0.8))
                base.append({**pair, "skip": skip, "recall": rec})
                shifted.append({**pair, "skip": skip, "recall": rec + 0.1})
    mean, half, n = report_quality.paired_gain(shifted, base)
    assert n == 12 and abs(mean - 0.1) < 1e-12 and half < 1e-12
    # Unpaired, the same data carry an interval much wider than the paired one.
    assert report_quality.at_skip(base)[1] > 0.01


def test_core_questclt_is_the_centre_plus_the_root_of_the_squared_spreads(
        rng: np.random.Generator) -> None:
    kv, h, d, groups = 2, 4, 64, 12
    tokens = groups * BLOCK
    k = (rng.standard_normal((kv, tokens, d)) * rng.uniform(0.1, 5, d)).astype(np.float32)
    q = rng.standard_normal((h, d)).astype(np.float32)
    s = core.Sequence(q_heads=h, kv_heads=kv, head_dim=d, group_blocks=1, sketch_dim=8,
                      features=core.QUEST, max_tokens=tokens)
    s.append(k)
    got = s.scores("questclt", q)  # [h, groups]
    blocks = k.reshape(kv, groups, BLOCK, d).astype(np.float64)
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)  # [kv, groups, d]
    qk = q.astype(np.float64)[:, None, :]  # [h, 1, d], head i reads KV head i // (h // kv)
    c, w = ((lo + hi) / 2)[np.arange(h) // (h // kv)], ((hi - lo) / 2)[np.arange(h) // (h // kv)]
    want = (qk * c).sum(-1) + np.sqrt(((qk * w) ** 2).sum(-1))
    # The record keeps min and max in binary16, rounded outward: a relative 2^-10 per channel.
    tol = 2.0 ** -9 * (np.abs(qk) * (np.abs(lo) + np.abs(hi))[np.arange(h) // (h // kv)]).sum(-1)
    assert np.all(np.abs(got - want) <= tol + 1e-4)
    # Never above quest's bound, which it relaxes.
    assert np.all(got <= s.scores("quest", q) + 1e-4)


def test_core_questclt_over_quest8_is_the_harness_pow2_estimate(rng: np.random.Generator) -> None:
    # The product's quest8 part (core/, features.quest8) quantizes as the harness's pow2
    # column of docs/eval (quality.QuestTables with scale "pow2"), so core's questclt over
    # it equals the harness's questclt1 over those tables: the evaluation measured the
    # product. Keys are appended a few at a time, as a decode does.
    kv, h, d, groups = 2, 4, 64, 10
    tokens = groups * BLOCK
    k = (rng.standard_normal((kv, tokens, d)) * rng.uniform(0.1, 5, d)).astype(np.float32)
    k[:, : BLOCK // 2] *= 100.0  # a group whose scale grows within it
    q = rng.standard_normal((h, d)).astype(np.float32)
    s = core.Sequence(q_heads=h, kv_heads=kv, head_dim=d, group_blocks=1, sketch_dim=8,
                      features=core.QUEST8, max_tokens=tokens)
    for start in range(0, tokens, 7):
        s.append(k[:, start:start + 7])
    got = s.scores("questclt", q)  # [h, groups]
    tables = quality.QuestTables(k, tokens, 1, scale_mode="pow2")
    want = tables.estimate("questclt1", q)
    # float rounding of each (head, group)'s sums; one code of any channel is far more
    head_kv = np.arange(h) // (h // kv)
    size = np.abs(tables.min8) + np.abs(tables.max8)  # [kv, groups, d]
    tol = 1e-5 * (np.abs(q).astype(np.float64)[:, None, :] * size[head_kv]).sum(-1)
    assert np.all(np.abs(got - want) <= tol)
    step = (tables.max8 - tables.min8).max(axis=2) / 254.0  # <= one code step, [kv, groups]
    assert np.all(tol < 0.1 * step[head_kv] * np.abs(q).max())



def test_c2f_feedback_ranks_the_previous_steps_blocks_by_their_exact_mass() -> None:
    # One head, 4 coarse groups of 2 blocks (nb = 8); the estimate puts block 3 last among
    # the candidates but the previous step visited it and its exact mass is the largest:
    # feedback takes it, the estimate alone does not. Blocks 0-1 (first group) and 4-7 (the
    # last two groups) are forced; blocks 2-3 are the only unforced ones.
    gc, nb = 2, 8
    coarse = np.array([[0.0, 5.0, 0.0, 0.0]], dtype=np.float32)
    fine = np.array([[0.0, 0.0, 4.0, 1.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    plain, read = quality._c2f_pick(coarse, fine, gc, 0.5, 2.0, 1)
    assert read == 2 and plain[0, 2] == 1 and plain[0, 3] == 0
    visited = np.zeros(nb, dtype=bool)
    visited[[2, 3]] = True
    exact = np.array([[0.0, 0.0, 3.0, 9.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    fed, read_fed = quality._c2f_pick(coarse, fine, gc, 0.5, 2.0, 1, visited=visited, exact=exact)
    assert read_fed == read, "feedback reads no summary beyond the candidates'"
    assert fed[0, 3] == 1 and fed[0, 2] == 0
    assert fed[0, [0, 1, 4, 5, 6, 7]].all()


def test_c2f_feedback_shifts_the_unvisited_estimates_by_the_visited_median() -> None:
    # Blocks 2 and 3 are candidates; 2 was visited (exact 10, estimate 4: median difference
    # 6), 3 was not (estimate 5 -> 11 after the shift): 3 outranks 2 only with the shift.
    gc = 2
    coarse = np.array([[0.0, 5.0, 0.0, 0.0]], dtype=np.float32)
    fine = np.array([[0.0, 0.0, 4.0, 5.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    visited = np.zeros(8, dtype=bool)
    visited[2] = True
    exact = np.zeros((1, 8), dtype=np.float32)
    exact[0, 2] = 10.0
    fed, _ = quality._c2f_pick(coarse, fine, gc, 0.5, 2.0, 1, visited=visited, exact=exact)
    assert fed[0, 3] == 1 and fed[0, 2] == 0


def test_feedback_plan_rows_name_each_variant(rng: np.random.Generator) -> None:
    from eps_eval import synthetic

    tokens, d = 1024, 32
    tr = synthetic.make_layer("multi", tokens, [tokens - 4, tokens - 3, tokens - 2, tokens - 1],
                              q_heads=4, kv_heads=2, head_dim=d, seed=int(rng.integers(1 << 30)))
    plan = plans.FEEDBACK_PLAN
    state = quality.LayerState(plan, 4, 2, d, tokens)
    rows = quality.step_rows(state, tr.k, tr.v, tr.q, tokens - 1, {"workload": "test"})
    names = {r["method"] for r in rows}
    assert {"fb-questclt1-o0", "fb-questclt1-o1", "fb-questclt1-cal"} <= names
    assert {f"{fb}-c2f{gc}x{c:g}-questclt1" for fb in ("fb", "fb2") for gc in plan.c2f_coarse
            for c in plan.c2f_candidates} <= names
    fed = [r for r in rows if r["method"].startswith(("fb-c2f", "fb2-c2f"))]
    assert all(r["lag"] == 1 and 0.0 <= r["recall"] <= 1.0 + 1e-6 for r in fed)


def test_report_quality_refuses_a_directory_without_units_and_keeps_its_report(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # Once it wrote an empty quality.md over the report and exited 0.
    from eps_eval import report_quality

    (tmp_path / "units").mkdir()
    (tmp_path / "quality.md").write_text("earlier report\n")
    with pytest.raises(SystemExit) as e:
        report_quality.main([f"--out={tmp_path}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "units") in err and "q19_*.csv" in err
    assert (tmp_path / "quality.md").read_text() == "earlier report\n"


def test_report_quality_refuses_a_missing_directory_by_name(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from eps_eval import report_quality

    missing = tmp_path / "nowhere"
    with pytest.raises(SystemExit) as e:
        report_quality.main([f"--out={missing}"])
    assert e.value.code == 2
    assert f"--out={missing}: no such directory" in capsys.readouterr().err
    assert not missing.exists()
