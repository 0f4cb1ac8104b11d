"""The per-token low-rank summaries (eps_eval.lowrank) against questclt and the exact lag-1
mass: `python -m eps_eval.run_lowrank --out=DIR [--model=gemma|smollm2]
[--context=16384,32768 --steps=12 --cache=DIR]`.

Each context reads a licence passage (Gemma 3's global layers 5, 11, 17 over run_gemma's
passage; every layer of SmolLM2 over run_quality's), the last `steps` positions with
lag-1 queries, g = 1, the threshold budget swept as quality.top_pages_for over union
lists, and for every (layer, position) pair the recall at 75 % of KV bytes skipped
(summary bytes counted, and again with the low-rank records free) of:

  oracle_mass     the current query's exact block masses (the reference of the gap);
  lag1            the previous query's exact block masses (zero bytes: the lag's ceiling);
  questclt1       questclt on the quest8 record (2·d + 4 bytes a block);
  tok-{basis}{r}  every token's r coefficients, 8-bit, scored as the block's log mass
                  (lowrank.block_scores); `-free` the same with its bytes not counted;
  box-{basis}{r}-k{κ}  the rotated box of rank r (lowrank.box_scores, 2·r + 4 bytes).

Bases, one per layer and KV head (ranks above d are left out): `pca` key PCA of the
context's keys before its last 512 tokens; `qa` query-aware, those keys and the queries
of a calibration text; `qapre` the same from the context's first 2,048 keys only;
`qacal` keys and queries of the calibration text (a basis per model, not per sequence).
The calibration text is Python's standard library source (another domain than the
licences), 4,096 tokens.

`--spec=J,...` adds the current query predicted one or more layers ahead (each studied
layer's own norm, W_q, QK-norm and RoPE over the residual entering the layer j before, as
an engine could form it while that layer runs; pair_rows says the rows) and questclt under
the current query (`questclt1-lag0`); `--kfirst=ρ,...` a two-stage read (`kfirst{ρ}-questclt1`:
the questclt list's keys read to score its blocks exactly under the current query, then the
values of each head's best ρ·top_pages of them; both reads counted); `--own=r,...` each block's
keys in a basis of its own (its mean, r principal directions, every token's coefficients:
lowrank.OwnBlocks), `own{r}` under the lag-1 query and `own{r}-lag0` under the current one
(with `questclt1-lag0` beside them);
`--window=W,...` forces each list's newest W blocks (core's last_n; every other row forces
2) under the lag-1 exact masses (`w{W}-lag1`) and questclt (`w{W}-questclt1`): whether a
wider recent window buys back what the lag loses, its blocks counted as read;
`--no-lowrank` leaves the bases out.

Units: DIR/units/lowrank_{model}_{context}.csv (one row per pair and configuration); the
table of paired gaps is printed and written to DIR/lowrank_{model}.md.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

from eps_eval import core, lowrank
from eps_eval.args import check_contexts, output_dir, positive_int
from eps_eval.gemma import GLOBAL_LAYERS, Gemma, fetch_gguf
from eps_eval.metrics import BLOCK, dense, evaluate
from eps_eval.plans import FRACTIONS
from eps_eval.quality import QuestTables, top_pages_for
from eps_eval.run import log
from eps_eval.run_gemma import contexts, passage_ids

TOKEN_RANKS = (8, 16, 31, 64)
BOX_RANKS = (16, 32, 64, 96)
KAPPAS = (1.0, 1.5)
# More budgets near 75 % skipped than the quality sweep, for the interpolation.
SWEEP = tuple(sorted(set(FRACTIONS) | {0.12, 0.18, 0.25}))


def calibration_ids(tok: object, n: int = 4096) -> list[int]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("[a-c]*.py"))[:40]
    ids = tok.encode("\n".join(f.read_text(errors="replace") for f in files))  # type: ignore[attr-defined]
    if len(ids) < n:
        raise ValueError(f"calibration text has {len(ids)} tokens < {n}")
    return ids[:n]


def recall_at(rec: np.ndarray, skip: np.ndarray, target: float = 0.75) -> float:
    """Recall at `target` skipped, linear between the sweep's points; NaN outside their range
    (the report prints "—"), never the nearest end's recall as if it were the target's."""
    if len(skip) < 2 or not skip.min() <= target <= skip.max():
        return math.nan
    order = np.argsort(skip)
    return float(np.interp(target, skip[order], rec[order]))


def shares(scores: np.ndarray, d: int) -> np.ndarray:
    """Each head's scores [H, G] as softmax shares exp(s/√d) over its groups."""
    z = scores.astype(np.float64) / np.sqrt(d)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def mass_scores(mass: np.ndarray, d: int) -> np.ndarray:
    """Block masses [H, nb] as scores in q·k units, √d · log mass (the exact rows' ranking)."""
    return np.log(np.maximum(mass, 1e-300)) * np.sqrt(d)


def pair_rows(k: np.ndarray, v: np.ndarray, q: np.ndarray, q_lag: np.ndarray, c: int,
              bases: dict[str, lowrank.Basis],
              q_spec: dict[int, np.ndarray] | None = None,
              kfirst: tuple[float, ...] = (), own: tuple[int, ...] = (),
              windows: tuple[int, ...] = ()) -> dict[str, float]:
    """Recall at 75 % skipped for every configuration at one (layer, position);
    q_spec (with `--spec`; it also adds `questclt1-lag0`, questclt under the current
    query): the current position's query predicted from the input of the layer j before
    (j -> [heads, d]), scored exactly (`spec{j}`), by questclt (`questclt1-spec{j}`) and
    mixed with the lag-1 masses (`lag1+spec{j}`: the mean of the two block masses; for
    questclt `questclt1-lag1+spec{j}`, the mean of the two estimates' softmax shares)."""
    d = k.shape[2]
    dn, lag = dense(q, k[:, :c], v[:, :c]), dense(q_lag, k[:, :c], v[:, :c])
    nb = -(-c // BLOCK)
    tps = top_pages_for(nb, SWEEP)
    out: dict[str, float] = {}

    def run(name: str, scores: np.ndarray, last_n: int = 2) -> None:
        masks = core.mark(scores.astype(np.float32), k.shape[0], tps, last_n=last_n)
        m = evaluate(dn, 1, masks, tps, [record_of(name, d)] * len(tps))
        out[name] = recall_at(m["recall"], m["skip"])

    exact = mass_scores(dn.mass, d)
    run("oracle_mass", exact)
    run("lag1", mass_scores(lag.mass, d))
    tables = QuestTables(k, c, 1)
    est_lag = tables.estimate("questclt1", q_lag)
    run("questclt1", est_lag)
    for w in windows:  # a wider forced recent window under the lag-1 query
        run(f"w{w}-lag1", mass_scores(lag.mass, d), last_n=w)
        run(f"w{w}-questclt1", est_lag, last_n=w)
    if q_spec is not None or own:  # the estimator's own loss: questclt with the current query
        run("questclt1-lag0", tables.estimate("questclt1", q))
    for j, qs in (q_spec or {}).items():
        sp = dense(qs, k[:, :c], v[:, :c])
        run(f"spec{j}", mass_scores(sp.mass, d))
        run(f"lag1+spec{j}", mass_scores(0.5 * (sp.mass + lag.mass), d))
        est = tables.estimate("questclt1", qs)
        run(f"questclt1-spec{j}", est)
        run(f"questclt1-lag1+spec{j}", mass_scores(0.5 * (shares(est, d) + shares(est_lag, d)), d))
    if kfirst:
        # K first: the candidates' keys read (half their KV bytes) to score them exactly
        # under the current query, then the values of each head's best ρ·t of them.
        cand = core.mark(est_lag.astype(np.float32), k.shape[0], tps)  # [P, 1, nb]
        cand_read = evaluate(dn, 1, cand, tps, [0.0] * len(tps))["visited"]
    for rho in kfirst:
        rec, skip = [], []
        for i, t in enumerate(tps):
            inside = np.where(cand[i, 0][None, :] > 0, exact, -1e30).astype(np.float32)
            fin = core.mark(inside, k.shape[0], [max(1, round(rho * t))])
            mf = evaluate(dn, 1, fin, [t], [record_of("questclt1", d)])
            skip.append(1.0 - 0.5 * cand_read[i] - 0.5 * mf["visited"][0] - mf["summary_frac"][0])
            rec.append(mf["recall"][0])
        out[f"kfirst{rho:g}-questclt1"] = recall_at(np.asarray(rec), np.asarray(skip))
    for r in own:  # each block in a basis of its own, under the lag-1 and the current query
        blocks = lowrank.own_blocks(k, c, r)
        run(f"own{r}", lowrank.own_scores(q_lag, blocks))
        run(f"own{r}-lag0", lowrank.own_scores(q, blocks))
    for name, basis in bases.items():
        if name.startswith("tok-"):
            scores = lowrank.block_scores(q_lag, lowrank.block_coefficients(k, c, basis, 8), basis)
            run(name, scores)
            if name.startswith("tok-qa") and not name.startswith("tok-qacal"):
                run(f"{name}-free", scores)
        else:
            lo, hi = lowrank.block_boxes(k, c, basis)
            for kappa in KAPPAS:
                run(f"{name}-k{kappa:g}", lowrank.box_scores(q_lag, lo, hi, basis, kappa))
    return out


def make_bases(keys: np.ndarray, cal_k: np.ndarray, cal_q: np.ndarray) -> dict[str, lowrank.Basis]:
    """Every basis of the study for one layer (one per KV head): keys [kv, T, d] of the
    context, cal_k [kv, Tc, d] and cal_q [Tc, H, d] of the calibration text."""
    own, first = keys[:, : keys.shape[1] - 512], keys[:, :2048]
    d = keys.shape[2]
    out = {}
    for r in (r for r in TOKEN_RANKS if r <= d):
        out[f"tok-pca{r}"] = lowrank.key_pca(own, r)
        out[f"tok-qa{r}"] = lowrank.query_aware(own, cal_q, r)
        out[f"tok-qacal{r}"] = lowrank.query_aware(cal_k, cal_q, r)
    for r in (r for r in BOX_RANKS if r <= d):
        out[f"box-pca{r}"] = lowrank.key_pca(own, r)
        out[f"box-qa{r}"] = lowrank.query_aware(own, cal_q, r)
        out[f"box-qapre{r}"] = lowrank.query_aware(first, cal_q, r)
        out[f"box-qacal{r}"] = lowrank.query_aware(cal_k, cal_q, r)
    return out


def record_of(name: str, d: int = 256) -> float:
    """Summary bytes a block read by configuration `name` (0: exact or free)."""
    name = re.sub(r"^w\d+-", "", name)  # a wider forced window reads the same records
    if name in ("oracle_mass", "lag1") or name.endswith("-free") or name.startswith(("spec", "lag1+")):
        return 0.0
    if name.startswith(("questclt1", "kfirst")):
        return 2.0 * d + 4.0
    if name.startswith("own"):
        return lowrank.own_bytes(int(re.sub(r"\D", "", name.split("-")[0])), d)
    rank = int(re.sub(r"\D", "", name.split("-")[1]))
    return lowrank.record_bytes(rank, 8) if name.startswith("tok-") else lowrank.box_bytes(rank)


def report(rows: list[dict[str, object]], d: int) -> str:
    lines = ["| configuration | bytes a block (of quest fp16's at g = 1) | "
             + " | ".join(f"{c} recall / gap" for c in sorted({int(r['context']) for r in rows}))
             + " |", "| --- | ---: |" + " --- |" * len({r["context"] for r in rows})]
    names = [n for n in rows[0] if n not in ("context", "layer", "step")]
    for n in names:
        cells = []
        for ctx in sorted({int(r["context"]) for r in rows}):
            sel = [r for r in rows if int(r["context"]) == ctx]
            x = np.array([float(r[n]) for r in sel])  # type: ignore[arg-type]
            gap = np.array([float(r["oracle_mass"]) for r in sel]) - x  # type: ignore[arg-type]
            ok = ~np.isnan(gap)
            if ok.sum() < 2:  # 75 % skipped out of the sweep's range (short contexts)
                cells.append(f"— ({len(gap) - ok.sum()} of {len(gap)} out of range)")
                continue
            half = 1.96 * gap[ok].std(ddof=1) / np.sqrt(ok.sum())
            note = f" ({len(gap) - ok.sum()} of {len(gap)} out of range)" if not ok.all() else ""
            cells.append(f"{x[ok].mean():.3f} / {gap[ok].mean():.3f} ± {half:.3f}{note}")
        rb = record_of(n, d)
        lines.append(f"| {n} | {rb:.0f} ({rb / (4 * d):.2f}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


class Source:
    """A model's keys and queries for the study: the calibration text's, then each context's."""

    def __init__(self, model: str, cache: Path) -> None:
        self.model = model
        if model == "gemma":
            self.m: Any = Gemma(fetch_gguf(cache))
            self.layers = list(GLOBAL_LAYERS)
            self.d = 256
        else:
            from eps_eval import realmodel

            self.rm = realmodel.RealModel(cache)
            self.m = self.rm.model
            self.layers = list(range(self.rm.cfg.layers))
            self.d = self.rm.cfg.head_dim

    def calibration(self) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Keys [kv, Tc, d] and queries [Tc, H, d] of the calibration text, per layer."""
        ids = calibration_ids(self.m.tokenizer)
        tr = self.m.prefill(ids, list(range(len(ids))), [])
        if self.model == "gemma":
            return ({L: tr.k[L] for L in self.layers},
                    {L: np.stack([tr.q[L][p] for p in range(len(ids))]) for L in self.layers})
        return ({L: tr.k[L] for L in self.layers},
                {L: np.stack([tr.q[p][L] for p in range(len(ids))]) for L in self.layers})

    def context(self, ctx: int, steps: int, spec: tuple[int, ...] = ()) -> tuple[Any, list[int]]:
        """The passage's trace and the positions with queries (the last `steps`, one before);
        with `spec`, the residual inputs of the layers j before each studied layer too."""
        resid = {max(0, L - j) for L in self.layers for j in spec}
        if self.model == "gemma":
            qpos = list(range(ctx - steps - 1, ctx))
            return self.m.prefill(passage_ids(self.m.tokenizer, ctx), qpos, [],
                                  resid_layers=resid), qpos
        tr, _ = self.rm.passage_trace(ctx, steps, 1, 1, resid)
        return tr, list(range(ctx - steps - 1, ctx))

    def query(self, tr: Any, layer: int, position: int) -> np.ndarray:
        return tr.q[layer][position] if self.model == "gemma" else tr.q[position][layer]

    def spec_query(self, tr: Any, qpos: list[int], layer: int, j: int, position: int) -> np.ndarray:
        """`layer`'s query at `position` from the residual entering layer − j (the first
        layers from the step's embeddings, layer 0's input, which give their true query)."""
        row = tr.x[max(0, layer - j)][qpos.index(position)][None, :]
        return self.m.query_from(layer, row, [position])[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=output_dir)
    ap.add_argument("--model", choices=("gemma", "smollm2"), default="gemma",
                    help="gemma: Gemma 3 270M's global layers; smollm2: every layer of SmolLM2")
    ap.add_argument("--context", type=contexts, default=[16384, 32768])
    ap.add_argument("--steps", type=positive_int, default=12)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--spec", type=contexts, default=[],
                    help="j,...: also the current query predicted from the input of the layer "
                         "j before (of layer 0 for the first j layers)")
    ap.add_argument("--no-lowrank", action="store_true", help="skip the low-rank bases")
    ap.add_argument("--kfirst", type=lambda x: tuple(float(v) for v in x.split(",") if v),
                    default=(), help="ρ,...: also the two-stage reads (kfirst{ρ}-questclt1)")
    ap.add_argument("--own", type=contexts, default=[],
                    help="r,...: also each block's keys in a basis of its own (own{r}, "
                         "lowrank.OwnBlocks), under the lag-1 and the current query")
    ap.add_argument("--window", type=contexts, default=[],
                    help="W,...: also each list's newest W blocks forced (w{W}-lag1, "
                         "w{W}-questclt1; the other rows force 2)")
    a = ap.parse_args(argv)
    # Source.context reads the query one before the last steps
    check_contexts(ap, "--context", a.context, a.steps, 1)
    spec = tuple(a.spec)
    (a.out / "units").mkdir(parents=True, exist_ok=True)
    src = Source(a.model, a.cache or Path(os.environ.get("EPS_EVAL_CACHE",
                                                            a.out.parent / ".eval-cache")))
    t0 = time.time()
    if not a.no_lowrank:
        cal_k, cal_q = src.calibration()
        log(f"calibration prefill in {time.time() - t0:.0f} s")
    rows: list[dict[str, object]] = []
    for ctx in a.context:
        t0 = time.time()
        tr, qpos = src.context(ctx, a.steps, spec)
        log(f"prefill of {ctx} tokens in {time.time() - t0:.0f} s")
        for L in src.layers:
            k, v = tr.k[L], tr.v[L]
            bases = {} if a.no_lowrank else make_bases(k, cal_k[L], cal_q[L])
            for si, p in enumerate(qpos[1:]):
                q_spec = {j: src.spec_query(tr, qpos, L, j, p) for j in spec} if spec else None
                got = pair_rows(k, v, src.query(tr, L, p), src.query(tr, L, p - 1), p + 1, bases,
                                q_spec, a.kfirst, tuple(a.own), tuple(a.window))
                rows.append({"context": ctx, "layer": L, "step": si, **got})
            log(f"context {ctx} layer {L} done")
        del tr
        with (a.out / "units" / f"lowrank_{a.model}_{ctx}.csv").open("w", newline="") as f:
            sel = [r for r in rows if r["context"] == ctx]
            w = csv.DictWriter(f, fieldnames=list(sel[0]))
            w.writeheader()
            w.writerows(sel)
    table = report(rows, src.d)
    (a.out / f"lowrank_{a.model}.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
