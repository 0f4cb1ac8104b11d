"""Gemma 3 270M in the evaluation: `python -m eps_eval.run_gemma --out=DIR [--context=4096]
[--passkeys=5 --passkey-context=2048]`.

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
import json
import os
import time
from pathlib import Path

import numpy as np

from eps_eval import core
from eps_eval.gemma import GLOBAL_LAYERS, Gemma, fetch_gguf
from eps_eval.metrics import BLOCK
from eps_eval.quality import LayerState, QualityPlan, QuestTables, step_rows
from eps_eval.realmodel import passkey_prompt
from eps_eval.run import log, unit_done, write_unit

LICENCES = Path(os.environ.get("EPS_EVAL_LICENCES", "/usr/share/common-licenses"))
PASSAGE = ("GPL-3", "GFDL-1.3", "LGPL-2.1", "GPL-2", "Apache-2.0", "MPL-2.0", "Artistic")
FILLER = ("Apache-2.0", "MPL-2.0", "Artistic", "CC0-1.0", "MPL-1.1", "GFDL-1.3")
# (method, g): gated variants of the passkey runs, each reading `READ` of the groups.
VARIANTS = (("quest", 1), ("quest8", 1), ("quest", 8), ("jl8", 8), ("oracle_mass", 1))
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
              visited: list[float]):  # type: ignore[no-untyped-def]
    seqs: dict[int, core.Sequence] = {}
    for layer in GLOBAL_LAYERS:
        s = core.Sequence(q_heads=4, kv_heads=1, head_dim=256, group_blocks=g, sketch_dim=8,
                          features=core.ALL_FEATURES, max_tokens=prompt_k[layer].shape[1] + 64)
        seqs[layer] = s

    def gate(layer: int, position: int, q: np.ndarray, keys: np.ndarray) -> np.ndarray:
        s = seqs[layer]
        if s.tokens < position + 1:
            s.append(np.ascontiguousarray(keys[:, s.tokens:position + 1]))
        qs = prev_q[layer]
        G = s.groups
        if method == "oracle_mass":
            sc = (q @ keys[0].T).astype(np.float64) / 16.0
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            gt = g * BLOCK
            p = np.pad(p, ((0, 0), (0, G * gt - p.shape[1]))).reshape(4, G, gt).sum(2)
            scores = np.log(np.maximum(p, 1e-300))
        elif method == "quest8":
            scores = QuestTables(keys, position + 1, g).scores(qs)
        else:
            scores = s.scores("jl" if method == "jl8" else method, qs)
        forced = np.zeros(G, dtype=bool)
        forced[0] = True
        forced[max(0, G - 2):] = True
        keep = keep_groups(scores, G, forced)
        prev_q[layer] = q
        mask = np.repeat(keep, g * BLOCK)[: position + 1]
        visited.append(float(mask.mean()))
        return mask

    return gate


def passkeys(m: Gemma, n: int, ctx: int, seed: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    tok = m.tokenizer
    filler_ids = tok.encode(text(FILLER), bos=False)
    rows: list[dict[str, object]] = []
    for i in range(n):
        t0 = time.time()
        key, depth, prompt = passkey_prompt(tok, filler_ids, ctx, rng)
        ids = tok.encode(prompt)
        answer = tok.encode(" " + key, bos=False)
        P = len(ids)
        tr = m.prefill(ids[:-1], [P - 2], [])
        cap = P + len(answer)
        for method, g in (("dense", 0),) + VARIANTS:
            kc = {layer: np.zeros((1, cap, 256), np.float32) for layer in tr.k}
            vc = {layer: np.zeros((1, cap, 256), np.float32) for layer in tr.v}
            for layer in tr.k:
                kc[layer][:, : P - 1] = tr.k[layer]
                vc[layer][:, : P - 1] = tr.v[layer]
            visited: list[float] = []
            gate = None
            if method != "dense":
                prev = {layer: tr.q[layer][P - 2] for layer in GLOBAL_LAYERS}
                gate = make_gate(method, g, tr.k, prev, visited)
            feed = [ids[-1]] + answer[:-1]
            ok = True
            for j, t in enumerate(feed):
                lg, _ = m.decode(t, P - 1 + j, kc, vc, gate)
                ok = ok and int(np.argmax(lg)) == answer[j]
            rows.append({"prompt": i, "context": P, "key": key, "depth": round(depth, 3),
                         "method": method, "g": g, "read": READ if method != "dense" else 1.0,
                         "correct": int(ok),
                         "visited": float(np.mean(visited)) if visited else 1.0})
        log(f"passkey {i} ({P} tokens, depth {depth:.2f}): "
            + ", ".join(f"{r['method']}@{r['g']}={r['correct']}" for r in rows[-6:])
            + f" in {time.time() - t0:.0f} s")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--passkeys", type=int, default=5)
    ap.add_argument("--passkey-context", type=int, default=2048)
    ap.add_argument("--cache", type=Path, default=None)
    a = ap.parse_args(argv)
    units = a.out / "units"
    cache = a.cache or Path(os.environ.get("EPS_EVAL_CACHE", a.out.parent / ".eval-cache"))
    t0 = time.time()
    m = Gemma(fetch_gguf(cache))
    log(f"Gemma 3 270M loaded in {time.time() - t0:.0f} s")
    info_path = a.out / "gemma_checks.json"
    if not info_path.exists():
        a.out.mkdir(parents=True, exist_ok=True)
        info = checks(m)
        info_path.write_text(json.dumps(info, indent=1))
        log(f"checks: {info}")
    name = f"q19_gemma_{a.context}"
    if a.context and not all(unit_done(units, f"{name}_L{layer}") for layer in GLOBAL_LAYERS):
        ids = m.tokenizer.encode(text(PASSAGE))[: a.context]
        if len(ids) < a.context:
            raise ValueError(f"passage has {len(ids)} tokens < {a.context}")
        plan = QualityPlan()
        qpos = list(range(a.context - a.steps - max(plan.lags), a.context))
        t1 = time.time()
        tr = m.prefill(ids, qpos, [])
        log(f"prefill of {a.context} tokens in {time.time() - t1:.0f} s")
        for layer in GLOBAL_LAYERS:
            state = LayerState(plan, 4, 1, 256, a.context)
            rows: list[dict[str, object]] = []
            for si, p in enumerate(range(a.context - a.steps, a.context)):
                rows += step_rows(state, tr.k[layer], tr.v[layer], tr.q[layer], p,
                                  {"workload": "gemma", "kind": "gemma3-270m",
                                   "context": a.context, "layer": layer, "step": si})
            write_unit(units, f"{name}_L{layer}", rows, {"layer": layer, "context": a.context})
            log(f"{name}_L{layer}: {len(rows)} rows")
    pk = f"q19gemma_passkey_{a.passkey_context}"
    if a.passkeys and not unit_done(units, pk):
        rows = passkeys(m, a.passkeys, a.passkey_context, 20261123)
        write_unit(units, pk, rows, {"context": a.passkey_context, "read": READ})
    log(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
