"""Tests of the evaluation harness (eval/eps_eval) against hand-computed cases.

The `rng` fixture (conftest.py) prints its seed; EPS_TEST_SEED=N replays it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from eps_eval import core, metrics, run, selection, synthetic


def _seq(kv: int = 2, q: int = 4, d: int = 32, g: int = 1, m: int = 8, tokens: int = 0,
         features: int = core.ALL_FEATURES) -> core.Sequence:
    return core.Sequence(q_heads=q, kv_heads=kv, head_dim=d, group_blocks=g, sketch_dim=m,
                         features=features, max_tokens=max(tokens, 1))


def test_mark_path_equals_page_selector_select(rng: np.random.Generator) -> None:
    for _ in range(6):
        kv = int(rng.choice([1, 2, 4]))
        q = kv * int(rng.choice([1, 2, 3]))
        g = int(rng.choice([1, 2, 8]))
        tokens = int(rng.integers(17, 3000))
        s = _seq(kv, q, 32, g, int(rng.choice([4, 8])), tokens)
        s.append(rng.standard_normal((kv, tokens, 32)))
        queries = rng.standard_normal((q, 32)).astype(np.float32)
        for method in ("jl", "1pc", "fro", "quest"):
            for per_kv in (False, True):
                tp = int(rng.integers(1, s.groups + 1))
                marks = core.mark(s.scores(method, queries), kv, [tp], per_kv_head=per_kv)[0]
                vis, stats = s.select(method, queries, tp, per_kv_head=per_kv)
                assert np.array_equal(marks, vis), (method, per_kv, tp)
                dn = metrics.dense(queries, _keys_of(s, rng, kv, tokens), np.ones((kv, tokens, 32),
                                                                                    np.float32))
                met = metrics.evaluate(dn, g, vis[None], [tp], [0.0])
                assert round(met["kv_bytes_read"][0]) == stats["kv_bytes_read_est"]


def test_coarse_level_keeps_the_best_coarse_groups_candidates(rng: np.random.Generator) -> None:
    """epsd's coarse level through libeps_eval: its coarse records equal a g = gc
    sequence's (same keys, same writer), so the candidates are computable here; every visited
    block lies in one (or is forced), and with every coarse group a candidate the selection
    is the flat one."""
    features = core.KEY_SUM | core.QUEST8
    for gc in (2, 4, 8):
        kv, q, d, tokens = 2, 4, 32, int(rng.integers(900, 3000))
        keys = rng.standard_normal((kv, tokens, d)).astype(np.float32)
        fine = core.Sequence(q_heads=q, kv_heads=kv, head_dim=d, group_blocks=1, sketch_dim=8,
                             features=features, max_tokens=tokens, coarse_blocks=gc)
        flat = _seq(kv, q, d, 1, 8, tokens, features)
        coarse = _seq(kv, q, d, gc, 8, tokens, features)
        for s in (fine, flat, coarse):
            s.append(keys)
        queries = rng.standard_normal((q, d)).astype(np.float32)
        nb, nc = fine.groups, coarse.groups
        for tp, cand in ((5, 1.0), (12, 2.0), (30, 1.5)):
            vis, stats = fine.select("questclt", queries, tp, coarse_candidates=cand)
            want = -(-int(np.ceil(cand * tp)) // gc)  # ceil(c · top_pages / r)
            forced = np.zeros(nb, bool)
            forced[0] = forced[-2:] = True
            cforced = np.zeros(nc, bool)
            cforced[np.flatnonzero(forced) // gc] = True
            cs = coarse.scores("questclt", queries)
            cand_mask = cforced.copy()
            for h in range(q):
                free = np.flatnonzero(~cforced)
                cut = np.sort(cs[h, free])[::-1][min(want, free.size) - 1]
                cand_mask[free[cs[h, free] >= cut]] = True
            allowed = np.repeat(cand_mask, gc)[:nb]
            assert not (vis[0].astype(bool) & ~allowed).any(), (gc, tp, cand)
            assert vis[0][forced].all()
            rb = core.record_bytes(d, 8, features)
            assert stats["summary_bytes_read"] == (nc + allowed.sum()) * kv * rb
            everything, _ = fine.select("questclt", queries, tp, coarse_candidates=1024.0)
            plain, _ = flat.select("questclt", queries, tp)
            assert np.array_equal(everything, plain), (gc, tp)


def test_feedback_through_the_core(rng: np.random.Generator) -> None:
    """StepInputs::feedback through libeps_eval: all-NaN feedback selects as none; a
    block fed a mass far above the rest is visited, one fed far below is not."""
    kv, q, d, tokens = 2, 4, 32, 1600
    s = core.Sequence(q_heads=q, kv_heads=kv, head_dim=d, group_blocks=1, sketch_dim=8,
                      features=core.KEY_SUM | core.QUEST8, max_tokens=tokens, coarse_blocks=4)
    s.append(rng.standard_normal((kv, tokens, d)).astype(np.float32))
    queries = rng.standard_normal((q, d)).astype(np.float32)
    base, _ = s.select("questclt", queries, 8)
    nan = np.full((q, s.groups), np.nan, np.float32)
    same, _ = s.select("questclt", queries, 8, feedback=nan)
    assert np.array_equal(base, same)
    unforced = np.arange(1, s.groups - 2)
    kept = unforced[base[0, unforced] == 1][0]
    left = unforced[base[0, unforced] == 0][0]
    fb = np.where(np.broadcast_to(base[0].astype(bool), (q, s.groups)), 0.0, np.nan)
    fb = fb.astype(np.float32)
    fb[:, kept] = -1000.0
    fb[:, left] = 1000.0
    vis, _ = s.select("questclt", queries, 8, feedback=fb)
    assert vis[0, left] == 1 and vis[0, kept] == 0


def _keys_of(s: core.Sequence, rng: np.random.Generator, kv: int, tokens: int) -> np.ndarray:
    # Byte accounting does not depend on the keys' values, only on the context length.
    return rng.standard_normal((kv, tokens, 32)).astype(np.float32)


def test_visiting_everything_skips_no_kv_bytes_and_has_exact_output(
    rng: np.random.Generator,
) -> None:
    kv, q, d, tokens = 2, 4, 16, 1000
    k = rng.standard_normal((kv, tokens, d)).astype(np.float32)
    v = rng.standard_normal((kv, tokens, d)).astype(np.float32)
    qs = rng.standard_normal((q, d)).astype(np.float32)
    dn = metrics.dense(qs, k, v)
    G = -(-tokens // 16)
    all_on = np.ones((1, 1, G), np.uint8)
    met = metrics.evaluate(dn, 1, all_on, [G], [0.0])
    assert met["skip"][0] == pytest.approx(0.0)
    assert met["recall"][0] == pytest.approx(1.0)
    assert met["out_err"][0] == pytest.approx(0.0, abs=1e-5)
    assert met["false_skip"][0] == 0.0
    assert met["top10"][0] == 1.0
    # With summaries read, skip is minus their share.
    met = metrics.evaluate(dn, 1, all_on, [G], [100.0])
    assert met["skip"][0] == pytest.approx(-100.0 * G * kv / (tokens * kv * 2 * d * 2))


def test_skip_counts_the_partial_last_block_and_summary_bytes() -> None:
    kv, d, tokens = 1, 8, 100  # 7 blocks, the last holds 4 tokens
    qs = np.ones((1, d), np.float32)
    k = np.zeros((kv, tokens, d), np.float32)
    dn = metrics.dense(qs, k, np.ones_like(k))
    mask = np.zeros((1, 1, 7), np.uint8)
    mask[0, 0, [0, 6]] = 1
    met = metrics.evaluate(dn, 1, mask, [1], [64.0])
    dense_bytes = tokens * 2 * d * 2
    assert met["visited"][0] == pytest.approx(20 / 100)
    assert met["skip"][0] == pytest.approx(1 - (20 * 2 * d * 2 + 64 * 7) / dense_bytes)
    # Uniform attention: recall is the visited token share.
    assert met["recall"][0] == pytest.approx(0.2)


def test_two_level_summary_bytes_count_the_blocks_of_a_partial_last_group(
    rng: np.random.Generator,
) -> None:
    # 300 tokens at g = 8: 3 groups but 19 blocks, so 19 block records per KV head, not the
    # 24 that "g per group" charged for the partial last group.
    kv, q, d, tokens, g = 2, 4, 32, 300, 8
    tr = synthetic.make_layer("needle", tokens, [tokens - 2, tokens - 1], q_heads=q,
                              kv_heads=kv, head_dim=d, seed=int(rng.integers(1 << 30)))
    plan = selection.Plan(group_blocks=(g,), jl_dims=(8,), lags=(1,), per_kv_head_lags=(),
                          fractions=(0.3,), exact=False)
    rows = selection.step_rows(selection.LayerSequences(plan, q, kv, d, tokens), tr.k, tr.v,
                               tr.q, tokens - 1)
    dense_bytes = tokens * kv * 2 * d * 2
    for name in selection.TWO_LEVEL:
        (row,) = [r for r in rows if r["method"] == f"{name}-2l"]
        block_record = selection.record_bytes(name, d, 1)
        assert row["summary_frac"] == pytest.approx(19 * kv * block_record / dense_bytes)
    # a context of whole groups: g records per group, as before
    assert selection.record_bytes("quest-2l", d, g, 256) == g * selection.record_bytes(
        "quest", d, 1)


def test_oracle_by_mass_reaches_recall_one_at_its_budget(rng: np.random.Generator) -> None:
    # All attention mass in 3 unforced groups (besides forced ones): a budget of 3 recalls it all.
    kv, q, d, tokens = 1, 2, 32, 64 * 16
    k = (0.01 * rng.standard_normal((kv, tokens, d))).astype(np.float32)
    qs = np.zeros((q, d), np.float32)
    qs[:, 0] = 10.0
    hot = rng.choice(np.arange(2, 60), size=3, replace=False)
    for b, x in zip(hot, (50.0, 49.0, 48.0)):
        k[0, b * 16 + int(rng.integers(16)), 0] = x  # logits ≈ 88, 87, 85
    dn = metrics.dense(qs, k, rng.standard_normal((kv, tokens, d)).astype(np.float32))
    scores = np.log(np.maximum(metrics.group_sum(dn.mass, 1), 1e-300)).astype(np.float32)
    masks = core.mark(scores, kv, [3, 2])
    met = metrics.evaluate(dn, 1, masks, [3, 2], [0.0, 0.0])
    assert met["recall"][0] == pytest.approx(1.0, abs=1e-9)
    assert met["false_skip"][0] == 0.0
    # A budget of 2 leaves out the weakest needle's group, and exactly its mass.
    weakest = metrics.group_sum(dn.mass, 1)[:, hot[2]].mean()
    assert weakest > 1e-3
    assert met["recall"][1] == pytest.approx(1.0 - weakest, abs=1e-9)


def test_step_rows_cover_every_method_and_strict_mode_never_false_skips(
    rng: np.random.Generator,
) -> None:
    seed = int(rng.integers(1 << 30))
    tokens = 2048
    positions = [tokens - 2, tokens - 1]
    tr = synthetic.make_layer("multi", tokens, [p - lag for p in positions for lag in (0, 1, 4)],
                              q_heads=4, kv_heads=2, head_dim=32, seed=seed)
    plan = selection.Plan(group_blocks=(1, 4), jl_dims=(4, 8), fractions=(0.05, 0.3))
    seqs = selection.LayerSequences(plan, 4, 2, 32, tokens)
    rows = []
    for p in positions:
        rows += selection.step_rows(seqs, tr.k, tr.v, tr.q, p)
    methods = {r["method"] for r in rows}
    assert {"jl4", "jl8", "1pc", "fro", "quest", "exact", "oracle_max", "oracle_mass",
            "jl8-2l", "quest-2l", "1pc-2l", "strict"} <= methods
    for r in rows:
        assert 0.0 <= float(r["recall"]) <= 1.0 + 1e-9
        if r["method"] in ("strict", "oracle_max"):
            assert r["false_skip"] == 0.0, r
    # More budget never lowers an oracle's recall.
    om = sorted((r["top_pages"], r["recall"]) for r in rows
                if r["method"] == "oracle_mass" and r["g"] == 1)
    assert all(a[1] <= b[1] + 1e-12 for a, b in itertools.pairwise(om) if a[0] < b[0])
    # A plan without lag 1 cross-checks with its smallest lag (it raised KeyError).
    no_lag1 = selection.Plan(group_blocks=(4,), jl_dims=(8,), lags=(0, 4), fractions=(0.3,))
    rows = selection.step_rows(selection.LayerSequences(no_lag1, 4, 2, 32, tokens), tr.k, tr.v,
                               tr.q, positions[-1])
    assert {int(r["lag"]) for r in rows} == {0, 4}


def test_resume_skips_finished_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = run.Settings(
        synthetic_contexts=(1024,), synthetic_steps={1024: 1}, real_context=0, real_layers=(),
        real_steps=0, ppl_positions=0, passkey_prompts=0, passkey_context=0,
        plan=selection.Plan(group_blocks=(1,), jl_dims=(8,), lags=(0, 1), fractions=(0.1,),
                            two_level=False),
    )
    units = tmp_path / "units"
    run.run_synthetic(s, units)
    done = sorted(p.name for p in units.glob("*.csv"))
    assert done == [f"synthetic_1024_L{i}.csv" for i in range(3)]
    stamps = {p: p.stat().st_mtime_ns for p in units.glob("*.csv")}
    (units / "synthetic_1024_L1.csv").unlink()  # as if interrupted while on layer 1
    made = []
    real_make = synthetic.make_layer

    def counting(kind: str, *a: object, **kw: object) -> synthetic.LayerTrace:
        made.append(kind)
        return real_make(kind, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(run.synthetic, "make_layer", counting)
    run.run_synthetic(s, units)
    assert made == ["multi"]
    for p, t in stamps.items():
        if p.name != "synthetic_1024_L1.csv":
            assert p.stat().st_mtime_ns == t


def test_core_errors_name_the_problem() -> None:
    with pytest.raises(core.CoreError, match="num_q_heads"):
        core.Sequence(q_heads=3, kv_heads=2, head_dim=32, group_blocks=1, sketch_dim=8,
                      features=0, max_tokens=16)
    s = _seq(tokens=20)
    with pytest.raises(core.CoreError, match="exceeds max_tokens"):
        s.append(np.zeros((2, 21, 32), np.float32))
    bad = np.zeros((2, 4, 32), np.float32)
    bad[1, 2, 5] = np.nan
    with pytest.raises(core.CoreError, match="is nan"):
        s.append(bad)
    with pytest.raises(ValueError, match="keys shape"):
        s.append(np.zeros((3, 4, 32), np.float32))
    s.append(np.ones((2, 4, 32), np.float32))
    with pytest.raises(core.CoreError, match="unknown method"):
        s.scores("bogus", np.zeros((4, 32), np.float32))
    with pytest.raises(core.CoreError, match="top_pages"):
        core.mark(np.zeros((4, 5), np.float32), 2, [0])
    with pytest.raises(ValueError, match="unknown synthetic kind"):
        synthetic.make_layer("nope", 64, [63])


def test_scores_refuse_a_method_whose_part_the_records_lack() -> None:
    # They used to return fro's scores under quest's (or 1pc's) name.
    s = core.Sequence(q_heads=2, kv_heads=1, head_dim=32, group_blocks=1, sketch_dim=8,
                      features=core.KEY_SUM, max_tokens=64)
    s.append(np.ones((1, 48, 32), np.float32))
    q = np.ones((2, 32), np.float32)
    assert s.scores("fro", q).shape[-1] == 3
    for method in ("quest", "1pc", "questclt"):
        with pytest.raises(core.CoreError, match=f"method={method} needs"):
            s.scores(method, q)


def test_a_run_refuses_a_directory_of_units_made_with_other_settings(tmp_path) -> None:
    # Units are resumed by name (context, layer): a full run in a quick run's directory
    # used to reuse the quick units and report them as the full run's.
    units = tmp_path / "units"
    units.mkdir()
    (units / "synthetic_1024_L0.csv").write_text("x\n1\n")
    (tmp_path / "settings.json").write_text(json.dumps({"mode": "quick", "settings": {}}))
    with pytest.raises(SystemExit) as e:
        run.main(["--out", str(tmp_path), "--only", "synthetic"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):  # nothing to report on
        run.main(["--out", str(tmp_path / "empty"), "--only", "report"])
