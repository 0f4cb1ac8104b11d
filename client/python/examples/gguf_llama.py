"""A Llama-architecture model read from a GGUF file (weights dequantised with the `gguf`
package) and a byte-level BPE tokenizer built from the file's vocabulary and merges.

Only what the reference engine needs: no generation utilities, no sampling.
GGUF stores Q and K rows permuted for llama.cpp's interleaved ("normal") RoPE,
so the engine applies RoPE to adjacent pairs (2i, 2i+1); attention scores are
the same as with Hugging Face's half-split layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LlamaConfig:
    num_layers: int
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    rms_eps: float
    context_length: int


def _field(reader: Any, key: str) -> Any:
    field = reader.fields[key]
    if len(field.data) == 1:
        value = field.parts[field.data[0]]
        if value.dtype == np.uint8:  # a string
            return bytes(value).decode("utf-8")
        return value.tolist()[0]
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def load_gguf(path: str) -> tuple[LlamaConfig, dict[str, np.ndarray], Any]:
    """Returns the config, float32 weights by GGUF name, and the reader (for the tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, expected 'llama'")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # numpy order: [out, in]
        weights[t.name] = np.asarray(w, dtype=np.float32).reshape(shape)
    vocab = weights["token_embd.weight"].shape[0]
    config = LlamaConfig(
        num_layers=int(_field(reader, "llama.block_count")),
        hidden=hidden,
        num_q_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // heads,
        ffn=int(_field(reader, "llama.feed_forward_length")),
        vocab=vocab,
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, "llama.context_length")),
    )
    return config, weights, reader


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


class ByteBpeTokenizer:
    """GPT-2-style byte-level BPE from tokenizer.ggml.tokens / tokenizer.ggml.merges."""

    _PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    _FALLBACK = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d| ?[^\s\w]+|\s+(?!\S)|\s+|_+"""

    def __init__(self, reader: Any) -> None:
        tokens = _field(reader, "tokenizer.ggml.tokens")
        merges = _field(reader, "tokenizer.ggml.merges")
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.byte_map = _bytes_to_unicode()
        try:
            import regex  # what Hugging Face tokenizers use; \p classes

            self.split = regex.compile(self._PATTERN).findall
        except ImportError:
            import re

            self.split = re.compile(self._FALLBACK).findall
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, word: str) -> list[int]:
        if word in self._cache:
            return self._cache[word]
        parts = list(word)
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        ids = [self.vocab[p] for p in parts if p in self.vocab]
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self.split(text):
            out += self._bpe("".join(self.byte_map[b] for b in piece.encode("utf-8")))
        return out
