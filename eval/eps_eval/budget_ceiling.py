"""How far any adaptive budget could beat the fixed one, for a given ranking:
`python -m eps_eval.budget_ceiling --out=DIR [--model=gemma|smollm2] [--context=16384,32768]
[--steps=12] [--g=1,2,8] [--target=0.95] --cache=DIR`.

Issue 19's adaptive-budget goal asks for recall ≥ target on ≥ 95 % of the (layer, position)
pairs while skipping more KV bytes on average than the best fixed budget, the one whose
*mean* recall reaches the target. An adaptive rule (epsd's mass budget, per head or over the
list) decides how many groups each list keeps; which groups come first is the ranking's
(questclt's scores, or the exact masses). This measures, per ranking and group size g, on
the contexts run_lowrank reads (union lists, lag-1 queries for questclt, summary bytes
counted as in metrics.evaluate):

  fixed     the threshold budget swept (top_pages a share of the unforced groups): the
            skip of the smallest budget whose mean recall reaches the target
            (interpolated), and of the smallest that reaches it on ≥ 95 % of the pairs;
  per-pair  each pair's smallest swept budget that reaches the target (a rule that knew
            the right top_pages of every pair);
  greedy    per pair, the union of every head's prefix of the ranking, grown by the group
            that adds the most true mass to the list's recall among the heads' next ones,
            until the recall reaches the target: a rule that knew every head's true masses
            but keeps each head's order (greedy, so near the best such rule, not proven
            the best).

If `greedy` does not skip more than `fixed` (mean), no rule that stops a ranking's lists
can meet the goal with that ranking, however it is calibrated.

Rankings: `questclt1` (the quest8 record, lag-1 query) and `oracle` (the current query's
exact masses, the ideal of the section "The mass budget over the list" in
docs/eval/issue19-groups-gemma.md).
Units: DIR/units/ceiling_{model}_{context}.csv (a row per pair, ranking and g: the greedy
skip, the needed share and every swept budget's recall and skip); the table is printed
and written to DIR/ceiling_{model}.md.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from eps_eval import core
from eps_eval.args import (
    check_contexts,
    output_dir,
    positive_int,
    positive_int_list,
    unit_interval,
)
from eps_eval.metrics import Dense, dense, evaluate, group_sum, group_tokens
from eps_eval.quality import QuestTables
from eps_eval.run import log
from eps_eval.run_lowrank import Source, mass_scores

F64 = npt.NDArray[np.float64]
# Shares of the unforced groups a list keeps, finely enough for the interpolation.
FRACTIONS = tuple(round(x, 4) for x in np.linspace(0.01, 0.8, 80))
FIRST, LAST = 1, 2  # forced groups, as core.mark's defaults


def budgets(groups: int, fractions: tuple[float, ...] = FRACTIONS) -> list[int]:
    """top_pages for each share of the unforced groups (not deduplicated: one per share)."""
    unforced = max(1, groups - FIRST - LAST)
    return [max(1, round(f * unforced)) for f in fractions]


def sweep(dn: Dense, scores: npt.NDArray[np.float32], g: int, record_bytes: float,
          kv_heads: int, fractions: tuple[float, ...] = FRACTIONS) -> tuple[F64, F64]:
    """Recall and skip [len(fractions)] of the union threshold lists of `scores` [H, G]."""
    tps = budgets(scores.shape[1], fractions)
    masks = core.mark(scores.astype(np.float32), kv_heads, tps)
    m = evaluate(dn, g, masks, tps, [record_bytes] * len(tps))
    return m["recall"], m["skip"]


def greedy_skip(dn: Dense, scores: npt.NDArray[np.float32], g: int, record_bytes: float,
                target: float) -> float:
    """The skip of the greedy list (module doc) for one pair: scores [H, G] give each head's
    order; the true group masses decide which head's next group joins and when to stop."""
    mass = group_sum(dn.mass, g)  # [H, G]
    h, groups = mass.shape
    tokens = group_tokens(dn.tokens, g)
    order = np.argsort(-scores, axis=1, kind="stable")
    taken = np.zeros(groups, dtype=bool)
    taken[:FIRST] = True
    taken[groups - LAST:] = True
    recall = float(mass[:, taken].sum(axis=1).mean())
    at = np.zeros(h, dtype=np.int64)
    while recall < target and not taken.all():
        best, pick = -1.0, -1
        for i in range(h):
            while taken[order[i, at[i]]]:
                at[i] += 1
            gain = float(mass[:, order[i, at[i]]].mean())
            if gain > best:
                best, pick = gain, int(order[i, at[i]])
        taken[pick] = True
        recall += best
    kv_tok_bytes = 4 * dn.head_dim  # fp16 K and V, as metrics.evaluate
    read = float(tokens[taken].sum()) * kv_tok_bytes
    return 1.0 - (read + record_bytes * groups) / (dn.tokens * kv_tok_bytes)


def needed_percentile(needed: F64, q: float) -> float:
    """np.percentile's linear q-th percentile of the shares the pairs need, inf for a pair
    no swept share serves (needed = inf): inf when the percentile reads such a pair (it is
    above the largest swept share, by an unknown amount), never that largest share."""
    v = np.sort(needed)
    h = (len(v) - 1) * q / 100.0
    lo, hi = int(np.floor(h)), int(np.ceil(h))
    if np.isinf(v[hi]) and (hi != lo or np.isinf(v[lo])):
        return math.inf
    return float(v[lo] + (h - lo) * (v[hi] - v[lo])) if hi != lo else float(v[lo])


def summarize(recall: F64, skip: F64, greedy: F64, target: float,
              fractions: tuple[float, ...] = FRACTIONS) -> dict[str, float]:
    """recall, skip [pairs, budgets] (budgets increasing) and greedy [pairs] -> the skips of
    the fixed budget (mean recall at the target, interpolated; and safe on ≥ 95 % of the
    pairs), of each pair's own budget, and of the greedy lists; the needed shares. A skip
    whose budget no swept fraction reaches is NaN (the table prints "—"), never the
    largest budget's as if it had reached it; per_pair counts the pairs that reach it. A
    pair no swept share serves needs more than the largest: a needed-share percentile
    that reads it is inf (the table prints "> " that share), not the largest share."""
    mean_r, mean_s = recall.mean(axis=0), skip.mean(axis=0)
    reach = recall >= target
    fixed = math.nan
    if (mean_r >= target).any():
        j = int(np.argmax(mean_r >= target))
        if 0 < j and mean_r[j] >= target > mean_r[j - 1]:
            a = (target - mean_r[j - 1]) / (mean_r[j] - mean_r[j - 1])
            fixed = float((1 - a) * mean_s[j - 1] + a * mean_s[j])
        else:
            fixed = float(mean_s[j])
    share = reach.mean(axis=0)
    fixed_safe = float(mean_s[int(np.argmax(share >= 0.95))]) if (share >= 0.95).any() else math.nan
    reached = reach.any(axis=1)
    need = np.argmax(reach, axis=1)
    own = skip[np.arange(len(skip)), need]
    needed = np.where(reached, np.asarray(fractions)[need], math.inf)
    return {"pairs": float(len(recall)), "fixed": fixed, "fixed_safe": fixed_safe,
            "per_pair": float(own[reached].mean()) if reached.any() else math.nan,
            "per_pair_reached": float(reached.mean()),
            "greedy": float(greedy.mean()), "needed_p10": needed_percentile(needed, 10),
            "needed_p50": needed_percentile(needed, 50),
            "needed_p90": needed_percentile(needed, 90)}


def table(results: dict[tuple[int, str, int], dict[str, float]], target: float,
          fractions: tuple[float, ...] = FRACTIONS) -> str:
    header = (f"| context | ranking | g | pairs | fixed, mean recall {target} | fixed, {target} on "
              "95 % of pairs | per-pair budget (pairs reaching it) | greedy ceiling | "
              "greedy − fixed | needed share p10 / p50 / p90 |")
    lines = [header, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def cell(x: float, sign: str = "") -> str:
        return "—" if math.isnan(x) else f"{x:{sign}.3f}"

    def share(x: float) -> str:
        return f"> {max(fractions):.3f}" if math.isinf(x) else f"{x:.3f}"

    for (ctx, ranking, g), r in sorted(results.items()):
        lines.append(
            f"| {ctx} | {ranking} | {g} | {r['pairs']:.0f} | {cell(r['fixed'])} | "
            f"{cell(r['fixed_safe'])} | {cell(r['per_pair'])} ({r['per_pair_reached']:.0%}) | "
            f"{r['greedy']:.3f} | {cell(r['greedy'] - r['fixed'], '+')} | "
            f"{share(r['needed_p10'])} / {share(r['needed_p50'])} / {share(r['needed_p90'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=output_dir)
    ap.add_argument("--model", choices=("gemma", "smollm2"), default="gemma")
    # Without a context or a g there is nothing to measure: refused, not an empty report.
    ap.add_argument("--context", type=positive_int_list, default=[16384, 32768])
    ap.add_argument("--steps", type=positive_int, default=12)
    ap.add_argument("--g", type=positive_int_list, default=[1, 2, 8])
    ap.add_argument("--target", type=unit_interval, default=0.95)
    ap.add_argument("--cache", type=Path, default=None)
    a = ap.parse_args(argv)
    # Source.context reads the query one before the last steps
    check_contexts(ap, "--context", a.context, a.steps, 1)
    (a.out / "units").mkdir(parents=True, exist_ok=True)
    src = Source(a.model, a.cache or Path(os.environ.get("EPS_EVAL_CACHE",
                                                            a.out.parent / ".eval-cache")))
    results: dict[tuple[int, str, int], dict[str, float]] = {}
    for ctx in a.context:
        t0 = time.time()
        tr, qpos = src.context(ctx, a.steps)
        log(f"prefill of {ctx} tokens in {time.time() - t0:.0f} s")
        curves: dict[tuple[str, int], tuple[list[F64], list[F64], list[float]]] = {}
        units: list[dict[str, object]] = []
        for L in src.layers:
            k, v = tr.k[L], tr.v[L]
            d = k.shape[2]
            for si, p in enumerate(qpos[1:]):
                c = p + 1
                dn = dense(src.query(tr, L, p), k[:, :c], v[:, :c])
                q_lag = src.query(tr, L, p - 1)
                for g in a.g:
                    exact = mass_scores(group_sum(dn.mass, g), d).astype(np.float32)
                    ranked = {"questclt1": (QuestTables(k, c, g).estimate("questclt1", q_lag),
                                            2.0 * d + 4.0),
                              "oracle": (exact, 0.0)}
                    for name, (scores, rb) in ranked.items():
                        rec, skip = sweep(dn, scores, g, rb, k.shape[0])
                        gs = greedy_skip(dn, scores, g, rb, a.target)
                        got = curves.setdefault((name, g), ([], [], []))
                        got[0].append(rec)
                        got[1].append(skip)
                        got[2].append(gs)
                        units.append({"context": ctx, "layer": L, "step": si, "ranking": name,
                                      "g": g, "greedy_skip": gs,
                                      **{f"recall_{f:g}": r for f, r in zip(FRACTIONS, rec)},
                                      **{f"skip_{f:g}": s for f, s in zip(FRACTIONS, skip)}})
            log(f"context {ctx} layer {L} done")
        del tr
        for (name, g), (recs, skips, greedy) in curves.items():
            results[(ctx, name, g)] = summarize(np.array(recs), np.array(skips),
                                                np.array(greedy), a.target)
        with (a.out / "units" / f"ceiling_{a.model}_{ctx}.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(units[0]))
            w.writeheader()
            w.writerows(units)
    text = table(results, a.target)
    (a.out / f"ceiling_{a.model}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
