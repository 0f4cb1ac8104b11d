"""Gemma 3 270M in the evaluation: `python -m eps_eval.run_gemma --out=DIR [--context=4096]
[--passkeys=5 --passkey-context=2048] [--device=cpu|cuda --workers=N --compare-tokens=N]
[--plan=full|estimators --skip-checks]`.

Contexts may be lists (`--context=16384,32768`). Without --device the numpy model
runs (eps_eval.gemma); with it, the same forward in PyTorch (eps_eval.gemma_torch),
and --compare-tokens checks it against numpy first. --workers computes the selection
rows of each global layer in that many processes while the passkeys run.

1. Forward-pass checks: greedy answers to known-answer prompts and the dense
   perplexity of positions 512-1022 of GPL-3's first 1,024 tokens.
2. Selection rows (eps_eval.quality.step_rows) for the global layers 5, 11, 17
   over a passage of licence texts, the last `steps` positions.
3. Passkeys: a key at depth 10-90 % of licence filler; the prompt is prefilled
   densely except its last token; that token and the key's tokens are then
   decoded teacher-forced, with the global layers' attention restricted to the
   selected groups (local layers dense; lag-1 queries; the newest key joins the
   summaries before selection). A passkey counts as retrieved when every key
   token is the argmax, which is what greedy decoding would produce.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from eps_eval import core
from eps_eval.args import (
    check_context,
    int_list,
    non_negative_int,
    output_dir,
    passkey_contexts,
    positive_int,
    same_settings,
)
from eps_eval.gemma import GLOBAL_LAYERS, Gate, Gemma, GemmaTrace, fetch_gguf, rope_neox
from eps_eval.metrics import BLOCK
from eps_eval.plans import PLANS, QualityPlan, query_history
from eps_eval.quality import QUEST8_SCALES, GrowingQuestTables, LayerState, step_rows
from eps_eval.realmodel import passkey_prompt
from eps_eval.run import log, unit_done, write_unit

LICENCES = Path(os.environ.get("EPS_EVAL_LICENCES", "/usr/share/common-licenses"))
# PASSAGE holds ~32.1k tokens: PASSAGE_MORE (distinct texts, no near-duplicate versions)
# follows it so 32k contexts fit; shorter contexts read the same prefix as before.
PASSAGE = ("GPL-3", "GFDL-1.3", "LGPL-2.1", "GPL-2", "Apache-2.0", "MPL-2.0", "Artistic")
PASSAGE_MORE = ("MPL-1.1", "GPL-1", "LGPL-3", "CC0-1.0", "BSD")
# FILLER holds ~22.8k tokens; longer prompts draw from FILLER + FILLER_MORE (~45.8k), shorter
# ones from FILLER alone (the prompts of earlier runs stay as they were).
FILLER = ("Apache-2.0", "MPL-2.0", "Artistic", "CC0-1.0", "MPL-1.1", "GFDL-1.3")
FILLER_MORE = ("GPL-3", "GPL-2", "LGPL-2.1", "GPL-1", "LGPL-3")
# (method, g): gated variants of the passkey runs, each reading `READ` of the groups.
VARIANTS = (("quest", 1), ("quest8", 1), ("quest", 8), ("questclt", 1), ("questclt", 2),
            ("jl8", 8), ("oracle_mass", 1))
VARIANT_METHODS = frozenset(("quest", "quest8", "questclt", "jl8", "oracle_mass"))  # make_gate's
READ = 0.25


def text(files: tuple[str, ...]) -> str:
    return "\n\n".join((LICENCES / f).read_text(errors="replace") for f in files)


def nll(logits: np.ndarray, target: int) -> float:
    lg = logits.astype(np.float64)
    top = lg.max()
    return float(np.log(np.exp(lg - top).sum()) + top - lg[target])


def checks(m: Gemma) -> dict[str, object]:
    tok = m.tokenizer
    out: dict[str, object] = {}
    for prompt in ("The capital of France is", "Paris is the capital of",
                   "Question: What is 2 + 3?\nAnswer:"):
        ids = tok.encode(prompt)
        for _ in range(6):
            tr = m.prefill(ids, [], [len(ids) - 1])
            ids.append(int(np.argmax(tr.logits[len(ids) - 1])))
        out[prompt] = tok.decode(ids[1:])
    ids = tok.encode(text(("GPL-3",)))[:1024]
    lp = list(range(512, 1023))
    tr = m.prefill(ids, [], lp)
    out["ppl_gpl3_512_1022"] = round(float(np.exp(np.mean([nll(tr.logits[p], ids[p + 1])
                                                          for p in lp]))), 3)
    return out


def keep_groups(scores: np.ndarray, groups: int, forced: np.ndarray) -> np.ndarray:
    """A fixed share READ of the groups per list: forced, then by best rank over the heads."""
    budget = max(0, round(READ * groups) - int(forced.sum()))
    rank = np.argsort(np.argsort(-scores, axis=1, kind="stable"), axis=1).min(axis=0).astype(float)
    rank[forced] = np.inf
    keep = forced.copy()
    if budget > 0:
        keep[np.argsort(rank, kind="stable")[:budget]] = True
    return keep


def make_gate(method: str, g: int, prompt_k: dict[int, np.ndarray], prev_q: dict[int, np.ndarray],
              visited: list[float], quest8: dict[int, GrowingQuestTables]) -> Gate:
    """The gate of one passkey variant: the global layers read READ of the groups, chosen
    by `method` from the previous position's query. `quest8`: per layer, tables of the
    prompt's complete groups (copied, so variants share the prompt's part)."""
    seqs: dict[int, core.Sequence] = {}
    tables = {layer: t.copy() for layer, t in quest8.items()}
    if method in ("quest", "questclt", "jl8"):
        # Only the record the method reads (the other features cost time, not scores).
        feats = 0 if method == "jl8" else core.QUEST
        for layer in GLOBAL_LAYERS:
            seqs[layer] = core.Sequence(q_heads=4, kv_heads=1, head_dim=256, group_blocks=g,
                                        sketch_dim=8, features=feats,
                                        max_tokens=prompt_k[layer].shape[1] + 64)

    def gate(layer: int, position: int, q: np.ndarray, keys: np.ndarray) -> np.ndarray:
        gt = g * BLOCK
        G = -(-(position + 1) // gt)
        qs = prev_q[layer]
        if method == "oracle_mass":
            sc = (q @ keys[0].T).astype(np.float64) / 16.0
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            p = np.pad(p, ((0, 0), (0, G * gt - p.shape[1]))).reshape(4, G, gt).sum(2)
            scores = np.log(np.maximum(p, 1e-300))
        elif method == "quest8":
            scores = tables[layer].scores(keys, position + 1, qs)
        else:
            s = seqs[layer]
            if s.tokens < position + 1:
                s.append(np.ascontiguousarray(keys[:, s.tokens:position + 1]))
            scores = s.scores("jl" if method == "jl8" else method, qs)
        forced = np.zeros(G, dtype=bool)
        forced[0] = True
        forced[max(0, G - 2):] = True
        keep = keep_groups(scores, G, forced)
        prev_q[layer] = q
        mask = np.repeat(keep, gt)[: position + 1]
        visited.append(float(mask.mean()))
        return mask

    return gate


Decode = Callable[[int, int, "Gate | None"], np.ndarray]


def decoder(m: Any, tr: GemmaTrace, filled: int, capacity: int) -> Decode:
    """(token, position, gate) -> logits over caches holding the trace's [0, filled).
    A decode at p writes p and reads at most [0, p], so one decoder serves every variant
    of a prompt: each overwrites, in order, the positions it then reads."""
    if hasattr(m, "decoder"):  # TorchGemma: caches on its device
        dec = m.decoder(tr, filled, capacity)
        return lambda t, p, gate: dec.decode(t, p, gate)[0]
    kc = {layer: np.zeros((1, capacity, 256), np.float32) for layer in tr.k}
    vc = {layer: np.zeros((1, capacity, 256), np.float32) for layer in tr.v}
    for layer in tr.k:
        kc[layer][:, :filled] = tr.k[layer][:, :filled]
        vc[layer][:, :filled] = tr.v[layer][:, :filled]
    return lambda t, p, gate: m.decode(t, p, kc, vc, gate)[0]


def filler_ids(tok: Any, ctx: int) -> list[int]:
    ids = tok.encode(text(FILLER), bos=False)
    return ids if len(ids) >= ctx else tok.encode(text(FILLER + FILLER_MORE), bos=False)


def passkey_rows(m: Any, i: int, key: str, depth: float, prompt: str,
                 variants: tuple[tuple[str, int], ...] = VARIANTS) -> list[dict[str, object]]:
    """One prompt: dense, then each gated variant, teacher-forced over the key's tokens."""
    tok = m.tokenizer
    ids = tok.encode(prompt)
    answer = tok.encode(" " + key, bos=False)
    P = len(ids)
    tr = m.prefill(ids[:-1], [P - 2], [])
    dec = decoder(m, tr, P - 1, P + len(answer))
    # quest8's tables of the prompt's complete g = 1 groups, built once for every variant.
    q8 = {layer: GrowingQuestTables(1) for layer in GLOBAL_LAYERS}
    for layer in GLOBAL_LAYERS:
        q8[layer].grow(tr.k[layer], P - 1)
    rows: list[dict[str, object]] = []
    for method, g in (("dense", 0),) + variants:
        visited: list[float] = []
        gate = None
        if method != "dense":
            prev = {layer: tr.q[layer][P - 2] for layer in GLOBAL_LAYERS}
            gate = make_gate(method, g, tr.k, prev, visited,
                             q8 if method == "quest8" and g == 1 else
                             {layer: GrowingQuestTables(g) for layer in GLOBAL_LAYERS})
        feed = [ids[-1]] + answer[:-1]
        ok = True
        for j, t in enumerate(feed):
            lg = dec(t, P - 1 + j, gate)
            ok = ok and int(np.argmax(lg)) == answer[j]
        rows.append({"prompt": i, "context": P, "key": key, "depth": round(depth, 3),
                     "method": method, "g": g, "read": READ if method != "dense" else 1.0,
                     "correct": int(ok),
                     "visited": float(np.mean(visited)) if visited else 1.0})
    return rows


def passkeys(m: Any, n: int, ctx: int, seed: int, units: Path,
             variants: tuple[tuple[str, int], ...] = VARIANTS) -> None:
    """n prompts of ~ctx tokens, one unit each (q19gemma_passkey_{ctx}_pNN). Every prompt is
    drawn, done or not, so prompt i is the same in every run."""
    rng = np.random.default_rng(seed)
    tok = m.tokenizer
    filler = filler_ids(tok, ctx)
    for i in range(n):
        key, depth, prompt = passkey_prompt(tok, filler, ctx, rng)
        name = f"q19gemma_passkey_{ctx}_p{i:02d}"
        if unit_done(units, name):
            continue
        t0 = time.time()
        rows = passkey_rows(m, i, key, depth, prompt, variants)
        write_unit(units, name, rows, {"context": ctx, "read": READ, "prompt": i,
                                       "seconds": time.time() - t0})
        log(f"passkey {ctx} #{i} ({rows[0]['context']} tokens, depth {depth:.2f}): "
            + ", ".join(f"{r['method']}@{r['g']}={r['correct']}" for r in rows)
            + f" in {time.time() - t0:.1f} s")


def passage_ids(tok: Any, ctx: int) -> list[int]:
    ids = tok.encode(text(PASSAGE + PASSAGE_MORE))[:ctx]
    if len(ids) < ctx:
        raise ValueError(f"passage has {len(ids)} tokens < {ctx}")
    return ids


def rotate_one_position(q: np.ndarray) -> np.ndarray:
    """A global layer's query [H, d] after RoPE, moved on one position (base 1e6)."""
    return rope_neox(q[None], np.ones(1, dtype=np.int64), 1e6)[0]


def layer_unit(units: Path, name: str, layer: int, ctx: int, steps: int, k: np.ndarray,
               v: np.ndarray, q: dict[int, np.ndarray], plan: QualityPlan | None = None) -> str:
    """The selection rows of one global layer at its last `steps` positions (a unit)."""
    t0 = time.time()
    state = LayerState(plan or QualityPlan(), 4, 1, 256, ctx, rotate_lag=rotate_one_position)
    rows: list[dict[str, object]] = []
    for si, p in enumerate(range(ctx - steps, ctx)):
        rows += step_rows(state, k, v, q, p, {"workload": "gemma", "kind": "gemma3-270m",
                                              "context": ctx, "layer": layer, "step": si})
    write_unit(units, f"{name}_L{layer}", rows, {"layer": layer, "context": ctx,
                                                 "seconds": time.time() - t0})
    return f"{name}_L{layer}: {len(rows)} rows in {time.time() - t0:.0f} s"


def contexts(arg: str) -> list[int]:
    """`16384,32768`; 0 means none (eps_eval.args.int_list)."""
    return int_list(arg)


def variant_list(arg: str) -> tuple[tuple[str, int], ...]:
    """`questclt:8,quest:1` -> (("questclt", 8), ("quest", 1)); empty: VARIANTS."""
    if not arg:
        return VARIANTS
    out = []
    for item in arg.split(","):
        method, sep, g = item.partition(":")
        if not sep or not g.isdigit() or int(g) < 1:
            raise argparse.ArgumentTypeError(f"variant {item!r}: want METHOD:G, G >= 1")
        if method not in VARIANT_METHODS:
            raise argparse.ArgumentTypeError(
                f"variant {item!r}: method {method!r} is not one of {sorted(VARIANT_METHODS)}")
        out.append((method, int(g)))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=output_dir)
    ap.add_argument("--context", type=contexts, default=[4096], help="e.g. 16384,32768; 0: none")
    ap.add_argument("--steps", type=positive_int, default=3)
    ap.add_argument("--passkeys", type=non_negative_int, default=5, help="0: none")
    ap.add_argument("--passkey-context", type=contexts, default=[2048])
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="run the forward in PyTorch there (default: numpy)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--workers", type=non_negative_int, default=0,
                    help="processes for the selection rows (0: in this process, in order)")
    ap.add_argument("--compare-tokens", type=non_negative_int, default=0,
                    help="with --device: first check it against numpy on this many tokens")
    ap.add_argument("--quest8-scale", choices=QUEST8_SCALES, default="fp32",
                    help="quest8's scale per group in the recall units (quality.QuestTables); "
                         "the passkey runs keep fp32")
    ap.add_argument("--plan", choices=tuple(PLANS), default="full",
                    help="estimators: plans.ESTIMATOR_PLAN (lag 1, quest, quest8, estimators); "
                         "mass: plans.MASS_PLAN (the mass budget, quest and questclt); "
                         "massunion: plans.MASS_UNION_PLAN (mass plus the list-level mass "
                         "budget and the exact lag-1 mass); reuse: plans.REUSE_PLAN "
                         "(questclt and quest8 at lags 1-4, report_quality's reuse table); "
                         "the others: eps_eval.plans")
    ap.add_argument("--variants", type=variant_list, default=VARIANTS,
                    help="gated passkey variants METHOD:G,... (default: run_gemma.VARIANTS)")
    ap.add_argument("--skip-checks", action="store_true",
                    help="leave out the forward-pass checks (known answers, perplexity)")
    a = ap.parse_args(argv)
    for ctx in a.context:  # the first query is at ctx - steps - the plan's history
        check_context(ap, "--context", ctx, a.steps, query_history(PLANS[a.plan]))
    if a.passkeys:
        passkey_contexts(ap, "--passkey-context", a.passkey_context)
    units = a.out / "units"
    cache = a.cache or Path(os.environ.get("EPS_EVAL_CACHE", a.out.parent / ".eval-cache"))
    t0 = time.time()
    # Before the model loads: a resumed directory must hold units of the same settings.
    settings = {k: v for k, v in vars(a).items()
                if k not in ("out", "cache", "workers", "compare_tokens", "skip_checks")}
    same_settings(ap, a.out, {"args": settings},
                  {"started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t0))})
    host = Gemma(fetch_gguf(cache))
    m: Any = host
    if a.device:
        from eps_eval.gemma_torch import TorchGemma

        m = TorchGemma(host, a.device, a.dtype)
    log(f"Gemma 3 270M loaded in {time.time() - t0:.0f} s ({a.device or 'numpy'})")
    info_path = a.out / "gemma_checks.json"
    if not info_path.exists() and not a.skip_checks:
        info = checks(m)
        if a.device and a.compare_tokens:
            from eps_eval.gemma_torch import compare

            m.chunk, chunk = 256, m.chunk  # several chunks and the window's edge in the check
            ids = host.tokenizer.encode(text(("GPL-3",)))[: a.compare_tokens]
            info["torch_vs_numpy"] = compare(host, m, ids)
            m.chunk = chunk
        info["device"] = a.device or "numpy"
        tmp = info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=1))
        tmp.rename(info_path)
        log(f"checks: {info}")
    del host
    pool = multiprocessing.get_context("spawn").Pool(a.workers) if a.workers else None
    pending = []
    plan = dataclasses.replace(PLANS[a.plan], quest8_scale=a.quest8_scale)
    for ctx in a.context:
        name = f"q19_gemma_{ctx}"
        todo = [layer for layer in GLOBAL_LAYERS if not unit_done(units, f"{name}_L{layer}")]
        if not todo:
            continue
        ids = passage_ids(m.tokenizer, ctx)
        qpos = list(range(ctx - a.steps - query_history(plan), ctx))
        t1 = time.time()
        tr = m.prefill(ids, qpos, [])
        log(f"prefill of {ctx} tokens in {time.time() - t1:.1f} s")
        for layer in todo:
            args = (units, name, layer, ctx, a.steps, tr.k[layer], tr.v[layer], tr.q[layer],
                    plan)
            if pool is None:
                log(layer_unit(*args))
            else:
                pending.append(pool.apply_async(layer_unit, args))
        del tr
    for ctx in a.passkey_context if a.passkeys else []:
        passkeys(m, a.passkeys, ctx, 20261123, units, a.variants)
    for r in pending:
        log(r.get())
    if pool is not None:
        pool.close()
        pool.join()
    log(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
