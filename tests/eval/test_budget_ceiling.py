"""eps_eval.budget_ceiling: the fixed budget's interpolation and the per-pair budgets on a
hand example, the greedy list on a hand example, and on fresh random attention that no
ranking's greedy list beats the fewest groups that hold the target."""

from __future__ import annotations

import numpy as np
import pytest
from eps_eval import budget_ceiling as bc
from eps_eval.metrics import BLOCK, Dense, dense


def test_summarize_by_hand() -> None:
    fractions = (0.1, 0.2, 0.3)
    recall = np.array([[0.90, 0.96, 0.99], [0.94, 0.95, 0.97], [0.80, 0.90, 0.96]])
    skip = np.array([[0.8, 0.7, 0.6], [0.85, 0.75, 0.65], [0.9, 0.8, 0.7]])
    greedy = np.array([0.72, 0.76, 0.71])
    got = bc.summarize(recall, skip, greedy, 0.95, fractions)
    # mean recall 0.88, 0.9367, 0.9733: the target between the second and third budgets.
    a = (0.95 - 0.9366667) / (0.9733333 - 0.9366667)
    assert got["fixed"] == pytest.approx((1 - a) * 0.75 + a * 0.65, abs=1e-6)
    # On ≥ 95 % of three pairs means all three: the third budget.
    assert got["fixed_safe"] == pytest.approx(0.65)
    # Each pair's own budget: the second, the second, the third.
    assert got["per_pair"] == pytest.approx((0.7 + 0.75 + 0.7) / 3)
    assert got["per_pair_reached"] == 1.0
    assert got["greedy"] == pytest.approx(0.73)
    assert got["needed_p50"] == pytest.approx(0.2)


def _hand_dense(mass: np.ndarray, head_dim: int = 4) -> Dense:
    h, nb = mass.shape
    return Dense(tokens=nb * BLOCK, kv_heads=1, head_dim=head_dim, mass=mass,
                 maxdot=np.zeros((h, nb), np.float32), pv=np.zeros((h, nb, head_dim), np.float32),
                 out=np.ones((h, head_dim), np.float32), top10_block=np.zeros((h, 1), np.int64))


def test_greedy_by_hand() -> None:
    mass = np.array([[0.1, 0.5, 0.05, 0.05, 0.1, 0.2],
                     [0.1, 0.05, 0.5, 0.05, 0.1, 0.2]])
    dn = _hand_dense(mass)
    # Forced: group 0 and the last two (recall 0.4). Each head's order is its own mass: the
    # heads' next groups 1 and 2 add 0.275 each (head 0's first), then group 2 joins: 0.95.
    got = bc.greedy_skip(dn, mass.astype(np.float32), 1, 8.0, 0.9)
    assert got == pytest.approx(1 - (5 * BLOCK * 16 + 8 * 6) / (6 * BLOCK * 16))
    # Stopped at 0.6 after group 1 alone.
    assert bc.greedy_skip(dn, mass.astype(np.float32), 1, 0.0, 0.6) == pytest.approx(2 / 6)
    # Both heads ranking group 3 (mass 0.05) first, then 2 and 1: the list takes group 3 on
    # the way, then 2 (0.725), then 1: every group.
    worst = np.tile(np.array([0, 1, 2, 3, 0, 0], np.float32), (2, 1))
    assert bc.greedy_skip(dn, worst, 1, 0.0, 0.9) == pytest.approx(0.0)


def test_no_ranking_beats_the_fewest_groups(rng: np.random.Generator) -> None:
    h, kv, d, c = 4, 1, 16, 40 * BLOCK
    k = rng.standard_normal((kv, c, d)).astype(np.float32) * 1.5
    v = rng.standard_normal((kv, c, d)).astype(np.float32)
    q = rng.standard_normal((h, d)).astype(np.float32) * 1.5
    dn = dense(q, k, v)
    for g in (1, 2):
        groups = -(-dn.mass.shape[1] // g)
        mean_mass = np.add.reduceat(dn.mass, np.arange(0, dn.mass.shape[1], g), axis=1).mean(0)
        best = bc.greedy_skip(dn, np.tile(mean_mass, (h, 1)).astype(np.float32), g, 0.0, 0.9)
        # The fewest groups by hand: forced first and last two, then by mean mass.
        order = [i for i in np.argsort(-mean_mass, kind="stable") if 0 < i < groups - 2]
        held, n = mean_mass[[0, groups - 2, groups - 1]].sum(), 3
        for i in order:
            if held >= 0.9:
                break
            held += mean_mass[i]
            n += 1
        assert best == pytest.approx(1 - n * g * BLOCK / c, abs=1e-9)  # c: whole groups
        for _ in range(5):
            other = rng.standard_normal((h, groups)).astype(np.float32)
            assert bc.greedy_skip(dn, other, g, 0.0, 0.9) <= best + 1e-12


def test_a_target_no_budget_reaches_is_not_reported_as_reached() -> None:
    # Recall never reaches 0.95: the fixed budgets are NaN ("—"), not the largest budget's
    # skip, and the per-pair skip counts only the pairs that reach it (none here).
    recall = np.array([[0.5, 0.6, 0.7], [0.55, 0.65, 0.7]])
    skip = np.array([[0.8, 0.7, 0.6], [0.85, 0.75, 0.65]])
    got = bc.summarize(recall, skip, np.array([0.7, 0.7]), 0.95, (0.1, 0.2, 0.3))
    assert np.isnan(got["fixed"]) and np.isnan(got["fixed_safe"]) and np.isnan(got["per_pair"])
    assert got["per_pair_reached"] == 0.0
    row = bc.table({(512, "oracle", 1): got}, 0.95).splitlines()[-1]
    assert "| — | — | — (0%) |" in row, row


def test_a_pair_no_swept_share_serves_needs_more_than_the_largest_not_it() -> None:
    # Pairs 0 and 1 reach 0.95 at shares 0.1 and 0.2; pair 2 at none of 0.1-0.3. Its need
    # was counted as 0.3, the largest share, and p90 read 0.28 as if measured.
    recall = np.array([[0.96, 0.97, 0.98], [0.90, 0.95, 0.97], [0.80, 0.85, 0.90]])
    skip = np.array([[0.8, 0.7, 0.6], [0.8, 0.7, 0.6], [0.8, 0.7, 0.6]])
    got = bc.summarize(recall, skip, np.array([0.7, 0.7, 0.7]), 0.95, (0.1, 0.2, 0.3))
    # np.percentile's linear rule over (0.1, 0.2, above 0.3): p10 at 0.2 of the way from the
    # first to the second, p50 the second, p90 between the second and the unserved one.
    assert got["needed_p10"] == pytest.approx(0.12)
    assert got["needed_p50"] == pytest.approx(0.2)
    assert got["needed_p90"] == np.inf
    row = bc.table({(512, "oracle", 1): got}, 0.95, (0.1, 0.2, 0.3)).splitlines()[-1]
    assert row.endswith("| 0.120 / 0.200 / > 0.300 |"), row
    # Served by every share, the percentiles are np.percentile's.
    served = bc.summarize(recall[:2], skip[:2], np.array([0.7, 0.7]), 0.95, (0.1, 0.2, 0.3))
    for q in (10, 50, 90):
        assert served[f"needed_p{q}"] == pytest.approx(np.percentile([0.1, 0.2], q))


@pytest.mark.parametrize("arg", ["--g=0", "--context=0", "--g=", "--context=1k"])
def test_a_run_with_nothing_to_measure_is_refused_before_the_model_loads(
        tmp_path, capsys: pytest.CaptureFixture[str], arg: str) -> None:
    # Once --g=0 prefilled the model, then failed on an empty unit list leaving a 0-byte
    # CSV; --context=0 wrote an empty report and exited 0.
    with pytest.raises(SystemExit) as e:
        bc.main([f"--out={tmp_path}", arg])
    assert e.value.code == 2
    assert arg.split("=")[0] in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.csv")) and not list(tmp_path.rglob("*.md"))
