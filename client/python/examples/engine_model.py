"""The two model sources of the reference engine, one Llama-architecture forward pass.

- ``random``: the Llama-3-8B shape (32 layers, hidden 4096, 32 query / 8 KV heads,
  d = 128, FFN 14336, vocabulary 128256, RoPE θ = 500000) with **random bf16 weights**,
  for timing only: real GEMMs, real RoPE, a paged cache in vLLM's layout; its outputs
  mean nothing. ``random-small`` is the same code at a small shape (CPU checks).
- ``gguf``: a real pretrained model from a GGUF file (SmolLM2-135M: examples/gguf_llama.py),
  for quality.

Decode runs per layer: RMSNorm, one fused QKV GEMM, RoPE (the query's RoPE writes its
float32 result straight into epsd's shared query buffer: the query copy is folded into
the engine's own q write), the K/V write into the paged cache, attention (a callable:
the sparse paged decode kernel in both dense and gated runs), the output projection and
a fused gate/up SwiGLU FFN.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from gguf_llama import LlamaConfig


@dataclass(frozen=True)
class ModelConfig(LlamaConfig):
    """A LlamaConfig with what the engine adds: a label, the RoPE pairing, the weights' kind."""

    name: str = ""
    rope_interleaved: bool = False  # GGUF's (2i, 2i+1) pairs; False: Hugging Face's half split
    random_weights: bool = False


LLAMA3_8B_SHAPE = ModelConfig(num_layers=32, hidden=4096, num_q_heads=32, num_kv_heads=8,
                              head_dim=128, ffn=14336, vocab=128256, rope_theta=500000.0,
                              rms_eps=1e-5, context_length=131072,
                              name="llama-3-8b-shape, RANDOM bf16 weights", random_weights=True)
SMALL_SHAPE = ModelConfig(num_layers=2, hidden=256, num_q_heads=4, num_kv_heads=2, head_dim=64,
                          ffn=512, vocab=1000, rope_theta=10000.0, rms_eps=1e-5,
                          context_length=65536, name="small llama shape, RANDOM weights",
                          random_weights=True)


class Model:
    """Weights on the device and the per-layer math. Not thread-safe."""

    def __init__(self, config: ModelConfig, layers: list[dict[str, torch.Tensor]],
                 embed: torch.Tensor, lm_head: torch.Tensor, out_norm: torch.Tensor,
                 device: torch.device) -> None:
        self.c, self.layers, self.embed = config, layers, embed
        self.lm_head, self.out_norm, self.device = lm_head, out_norm, device
        d = config.head_dim
        self.inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        self.q_width = config.num_q_heads * d
        self.kv_width = config.num_kv_heads * d

    @staticmethod
    def random(config: ModelConfig, device: torch.device, dtype: torch.dtype,
               seed: int = 0) -> Model:
        """Random weights scaled 1/sqrt(fan_in), so activations stay finite in bf16."""
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        c = config

        def w(rows: int, cols: int) -> torch.Tensor:
            t = torch.empty(rows, cols, device=device, dtype=dtype)
            return t.normal_(0.0, cols ** -0.5, generator=g)

        qkv_rows = (c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim
        layers = []
        for _ in range(c.num_layers):
            layers.append({
                "attn_norm": torch.ones(c.hidden, device=device, dtype=dtype),
                "ffn_norm": torch.ones(c.hidden, device=device, dtype=dtype),
                "wqkv": w(qkv_rows, c.hidden), "wo": w(c.hidden, c.num_q_heads * c.head_dim),
                "wgu": w(2 * c.ffn, c.hidden), "wd": w(c.hidden, c.ffn),
            })
        embed = w(c.vocab, c.hidden) * (c.hidden ** 0.5)  # unit-scale embeddings
        return Model(c, layers, embed, w(c.vocab, c.hidden),
                     torch.ones(c.hidden, device=device, dtype=dtype), device)

    @staticmethod
    def from_gguf(path: str, device: torch.device, dtype: torch.dtype) -> tuple[Model, Any]:
        """A real model; returns it and the GGUF reader (for the tokenizer)."""
        from gguf_llama import load_gguf

        cfg, weights, reader = load_gguf(path)
        config = ModelConfig(**asdict(cfg), name=f"{path.rsplit('/', 1)[-1]} (pretrained)",
                             rope_interleaved=True)

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(weights[name].copy()).to(device=device, dtype=dtype)

        layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            layers.append({
                "attn_norm": t(p + "attn_norm.weight"), "ffn_norm": t(p + "ffn_norm.weight"),
                "wqkv": torch.cat([t(p + "attn_q.weight"), t(p + "attn_k.weight"),
                                   t(p + "attn_v.weight")]),
                "wo": t(p + "attn_output.weight"),
                "wgu": torch.cat([t(p + "ffn_gate.weight"), t(p + "ffn_up.weight")]),
                "wd": t(p + "ffn_down.weight"),
            })
        embed = t("token_embd.weight")
        lm_head = t("output.weight") if "output.weight" in weights else embed
        return Model(config, layers, embed, lm_head, t("output_norm.weight"), device), reader

    # -- pieces ------------------------------------------------------------------------------

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rms_norm = getattr(torch.nn.functional, "rms_norm", None)
        if rms_norm is not None:
            return rms_norm(x, (x.shape[-1],), weight, self.c.rms_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c.rms_eps)
        return xf.to(x.dtype) * weight

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., 1, d] float32 for positions [...] (one per token, shared by heads)."""
        angles = positions.float()[..., None] * self.inv_freq  # [..., d/2]
        if self.c.rope_interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat([angles, angles], dim=-1)
        return angles.cos()[..., None, :], angles.sin()[..., None, :]

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        if self.c.rope_interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., heads, d] rotated in float32; written into ``out`` (float32) if given."""
        xf = x.float()
        return torch.addcmul(xf * cos, self._rotated(xf), sin, out=out)

    def qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            query_out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> q [..., q_heads, d] (x's dtype), k, v [..., kv_heads, d]. The
        float32 q lands in ``query_out`` (epsd's query buffer rows) when given."""
        c, p = self.c, self.layers[layer]
        qkv = self.norm(x, p["attn_norm"]) @ p["wqkv"].T
        q, k, v = qkv.split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = q.unflatten(-1, (c.num_q_heads, c.head_dim))
        k = k.unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = v.unflatten(-1, (c.num_kv_heads, c.head_dim))
        qf = self.rope(q, cos, sin, out=query_out)
        return qf.to(x.dtype), self.rope(k, cos, sin).to(x.dtype), v

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x + o(attn), then x + FFN. attn [..., q_heads, d]."""
        p = self.layers[layer]
        x = x + attn.flatten(-2) @ p["wo"].T
        gate, up = (self.norm(x, p["ffn_norm"]) @ p["wgu"].T).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ p["wd"].T

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self.norm(x, self.out_norm) @ self.lm_head.T).float()
