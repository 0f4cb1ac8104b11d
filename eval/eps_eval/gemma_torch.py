"""Gemma 3 270M in PyTorch on a chosen device: the forward pass of eps_eval.gemma.Gemma.

Same GGUF weights (dequantised by the `gguf` package, through gemma.Gemma's loader),
same tokenizer, same math (RMSNorm, NeoX RoPE with angles in float64, tanh GELU,
local layers' 512-token window), same GemmaTrace of numpy arrays and the same `gate`
semantics: at a gated position a global layer's attention reads only the tokens the
gate marks. What differs is where it runs: a 32k prefill takes seconds on a GPU
where numpy takes hours on a small CPU.

Attention is computed per chunk of query rows (`chunk`) with an explicit boolean mask
through scaled_dot_product_attention, so the global layers at 32k never hold a
[T, T] score matrix. `dtype` is the linear layers' weight type (float32 or bfloat16);
norms, RoPE, attention and the residual stream stay in float32.

torch is imported here only: the numpy path and CI never load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from eps_eval.gemma import Config, Gate, Gemma, GemmaTrace

F32 = npt.NDArray[np.float32]


def _rope_cos_sin(positions: npt.NDArray[np.int64], d: int, base: float) -> tuple[F32, F32]:
    """cos, sin [T, d/2] in float32 from float64 angles, as gemma.rope_neox computes them."""
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class TorchGemma:
    """Gemma (eps_eval.gemma) on a torch device. Not thread-safe (one forward at a time)."""

    def __init__(self, host: Gemma, device: str = "cuda", dtype: str = "float32",
                 chunk: int = 1024) -> None:
        """Uploads the weights of a loaded numpy Gemma (its GGUF reader, config and
        tokenizer are gemma.py's); `host` stays usable, e.g. for comparisons."""
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.chunk = chunk
        self.cfg: Config = host.cfg
        self.tokenizer = host.tokenizer
        # Norm weights stay float32 (they scale the float32 stream); matrices take `dtype`.
        self.w: dict[str, Any] = {}
        for name, arr in host.w.items():
            dt = torch.float32 if arr.ndim == 1 else self.dtype
            # (np.require copies the read-only memory maps the reader returns for F32 tensors.)
            self.w[name] = torch.from_numpy(np.require(arr, requirements="W")).to(self.device, dt)
        self.embed = self.w["token_embd.weight"]  # [vocab, hidden]

    @classmethod
    def load(cls, path: Path, device: str = "cuda", dtype: str = "float32") -> TorchGemma:
        return cls(Gemma(path), device, dtype)

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % 6 == 0

    # ---- building blocks (float32 in, float32 out) -------------------------------------------
    def _norm(self, x: Any, name: str) -> Any:
        t = self.torch
        return x / t.sqrt(t.mean(x * x, dim=-1, keepdim=True) + self.cfg.eps) * self.w[name]

    def _lin(self, x: Any, name: str) -> Any:
        return (x.to(self.dtype) @ self.w[name].T).float()

    def _rope_tables(self, positions: npt.NDArray[np.int64]) -> dict[float, tuple[Any, Any]]:
        """cos, sin [T, 1, d/2] on the device for both RoPE bases (local 1e4, global 1e6)."""
        out = {}
        for base in (1e4, 1e6):
            c, s = _rope_cos_sin(positions, self.cfg.head_dim, base)
            out[base] = (self.torch.from_numpy(c).to(self.device)[:, None, :],
                         self.torch.from_numpy(s).to(self.device)[:, None, :])
        return out

    def _rope(self, x: Any, cs: tuple[Any, Any]) -> Any:
        """x [T, heads, d] rotated by the tables cs of its positions."""
        c, s = cs
        d = x.shape[-1]
        a, b = x[..., : d // 2], x[..., d // 2:]
        return self.torch.cat([a * c - b * s, a * s + b * c], dim=-1)

    def _mlp_residual(self, x: Any, p: str) -> Any:
        t = self.torch
        h = self._norm(x, p + "ffn_norm.weight")
        gte = self._lin(h, p + "ffn_gate.weight")
        gelu = 0.5 * gte * (1 + t.tanh(0.7978845608 * (gte + 0.044715 * gte * gte * gte)))
        mlp = self._lin(gelu * self._lin(h, p + "ffn_up.weight"), p + "ffn_down.weight")
        return x + self._norm(mlp, p + "post_ffw_norm.weight")

    def _qkv(self, x: Any, p: str, cs: tuple[Any, Any]) -> tuple[Any, Any, Any]:
        c = self.cfg
        T = x.shape[0]
        h = self._norm(x, p + "attn_norm.weight")
        q = self._lin(h, p + "attn_q.weight").reshape(T, c.heads, c.head_dim)
        k = self._lin(h, p + "attn_k.weight").reshape(T, c.kv_heads, c.head_dim)
        v = self._lin(h, p + "attn_v.weight").reshape(T, c.kv_heads, c.head_dim)
        q = self._rope(self._norm(q, p + "attn_q_norm.weight"), cs)
        k = self._rope(self._norm(k, p + "attn_k_norm.weight"), cs)
        return q, k, v

    def _attend(self, q: Any, k: Any, v: Any, mask: Any) -> Any:
        """q [n, heads, d], k/v [kv, L, d], mask [n, L] bool (True = attend) -> [n, heads, d]."""
        import torch.nn.functional as F

        c = self.cfg
        r = c.heads // c.kv_heads
        qh = q.permute(1, 0, 2)[None]  # [1, heads, n, d]
        kh = k.repeat_interleave(r, dim=0)[None]  # [1, heads, L, d]
        vh = v.repeat_interleave(r, dim=0)[None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[None, None],
                                           scale=1.0 / float(np.sqrt(c.head_dim)))
        return o[0].permute(1, 0, 2)

    # ---- the passes ---------------------------------------------------------------------------
    def prefill(self, tokens: list[int], q_positions: list[int], logit_positions: list[int],
                gate: Gate | None = None, gated_positions: list[int] | None = None,
                ) -> GemmaTrace:
        """As Gemma.prefill: K/V of every layer, q of the global layers at q_positions and
        logits at logit_positions, as numpy float32."""
        t = self.torch
        with t.inference_mode():
            return self._prefill(tokens, q_positions, logit_positions, gate, gated_positions)

    def _prefill(self, tokens: list[int], q_positions: list[int], logit_positions: list[int],
                 gate: Gate | None, gated_positions: list[int] | None) -> GemmaTrace:
        t = self.torch
        c = self.cfg
        T = len(tokens)
        pos = np.arange(T, dtype=np.int64)
        dev = self.device
        ids = t.as_tensor(tokens, device=dev, dtype=t.long)
        x = self.embed[ids].float() * np.float32(np.sqrt(c.hidden))
        tr = GemmaTrace(k={}, v={}, q={}, logits={})
        gated = sorted(gated_positions or [])
        rows_all = t.arange(T, device=dev)
        rope = self._rope_tables(pos)
        for layer in range(c.layers):
            p = f"blk.{layer}."
            glob = self.is_global(layer)
            q, k, v = self._qkv(x, p, rope[1e6 if glob else 1e4])
            kt = k.permute(1, 0, 2).contiguous()  # [kv, T, d]
            vt = v.permute(1, 0, 2).contiguous()
            tr.k[layer] = kt.cpu().numpy()
            tr.v[layer] = vt.cpu().numpy()
            if glob and q_positions:
                qsel = q[t.as_tensor(q_positions, device=dev)].cpu().numpy()
                tr.q[layer] = {qp: np.ascontiguousarray(qsel[i]) for i, qp in enumerate(q_positions)}
            att = t.empty_like(q)
            for s0 in range(0, T, self.chunk):
                s1 = min(T, s0 + self.chunk)
                lo = 0 if glob else max(0, s0 - c.window + 1)
                rows = rows_all[s0:s1, None]
                cols = rows_all[None, lo:s1]
                mask = cols <= rows
                if not glob:
                    mask &= cols > rows - c.window
                if glob and gate is not None:
                    for gp in gated:
                        if s0 <= gp < s1:
                            qg = q[gp].cpu().numpy()
                            m = gate(layer, gp, qg, tr.k[layer][:, : gp + 1])
                            if m is not None:
                                mask[gp - s0, : gp + 1] &= t.as_tensor(np.asarray(m, bool),
                                                                       device=dev)
                att[s0:s1] = self._attend(q[s0:s1], kt[:, lo:s1], vt[:, lo:s1], mask)
            o = self._lin(att.reshape(T, -1), p + "attn_output.weight")
            x = x + self._norm(o, p + "post_attention_norm.weight")
            x = self._mlp_residual(x, p)
        if logit_positions:
            hs = self._norm(x[t.as_tensor(logit_positions, device=dev)], "output_norm.weight")
            lg = self._lin(hs, "token_embd.weight").cpu().numpy()
            tr.logits = {lp: lg[i] for i, lp in enumerate(logit_positions)}
        return tr

    def decoder(self, trace: GemmaTrace, filled: int, capacity: int) -> TorchDecoder:
        """Decoding state over the trace's K/V of positions [0, filled), room for `capacity`."""
        return TorchDecoder(self, trace, filled, capacity)


class TorchDecoder:
    """K/V caches of every layer on the device for one prompt, plus a host copy of the
    global layers' keys (what a gate reads, without a device-to-host copy per step).

    decode(token, position, gate) writes `position` and reads [lo, position]: positions
    after it are never read, so one decoder serves several decodes of the same prompt
    (each variant overwrites the positions it reaches, in order)."""

    def __init__(self, m: TorchGemma, trace: GemmaTrace, filled: int, capacity: int) -> None:
        t = m.torch
        self.m = m
        c = m.cfg
        self.k: dict[int, Any] = {}
        self.v: dict[int, Any] = {}
        self.k_host: dict[int, F32] = {}
        for layer in range(c.layers):
            # Local layers read only the last `window` positions: copy those alone.
            lo = 0 if m.is_global(layer) else max(0, filled - c.window)
            kc = t.zeros((c.kv_heads, capacity, c.head_dim), device=m.device)
            vc = t.zeros_like(kc)
            kc[:, lo:filled] = t.from_numpy(trace.k[layer][:, lo:filled]).to(m.device)
            vc[:, lo:filled] = t.from_numpy(trace.v[layer][:, lo:filled]).to(m.device)
            self.k[layer], self.v[layer] = kc, vc
            if m.is_global(layer):
                kh = np.zeros((c.kv_heads, capacity, c.head_dim), np.float32)
                kh[:, :filled] = trace.k[layer][:, :filled]
                self.k_host[layer] = kh

    def decode(self, token: int, position: int, gate: Gate | None = None
               ) -> tuple[F32, dict[int, F32]]:
        """As Gemma.decode: logits at `position` and this position's q of each global layer."""
        with self.m.torch.inference_mode():
            return self._decode(token, position, gate)

    def _decode(self, token: int, position: int, gate: Gate | None) -> tuple[F32, dict[int, F32]]:
        m, t = self.m, self.m.torch
        c = m.cfg
        pos = np.asarray([position], dtype=np.int64)
        x = m.embed[token][None, :].float() * np.float32(np.sqrt(c.hidden))
        qs: dict[int, F32] = {}
        rope = m._rope_tables(pos)
        for layer in range(c.layers):
            p = f"blk.{layer}."
            glob = m.is_global(layer)
            q, k, v = m._qkv(x, p, rope[1e6 if glob else 1e4])
            self.k[layer][:, position] = k[0]
            self.v[layer][:, position] = v[0]
            lo = 0 if glob else max(0, position - c.window + 1)
            mask = t.ones((1, position + 1 - lo), dtype=t.bool, device=m.device)
            if glob:
                qn = q[0].cpu().numpy()
                qs[layer] = qn
                self.k_host[layer][:, position] = k[0].cpu().numpy()
                if gate is not None:
                    g = gate(layer, position, qn, self.k_host[layer][:, : position + 1])
                    if g is not None:
                        mask = t.as_tensor(np.asarray(g, bool), device=m.device)[None]
            att = m._attend(q, self.k[layer][:, lo:position + 1], self.v[layer][:, lo:position + 1],
                            mask)
            o = m._lin(att.reshape(1, -1), p + "attn_output.weight")
            x = x + m._norm(o, p + "post_attention_norm.weight")
            x = m._mlp_residual(x, p)
        logits = m._lin(m._norm(x, "output_norm.weight"), "token_embd.weight")[0]
        return logits.cpu().numpy(), qs


def _test_gate(seed: int) -> Gate:
    """A gate that keeps a random ~half of the tokens (always the first and the newest),
    the same for the same (layer, position): both implementations see the same masks."""

    def gate(layer: int, position: int, q: F32, keys: F32) -> npt.NDArray[np.bool_]:
        rng = np.random.default_rng([seed, layer, position])
        m = np.asarray(rng.random(keys.shape[1]) < 0.5, dtype=bool)
        m[0] = m[-1] = True
        return m

    return gate


def compare(host: Gemma, m: TorchGemma, tokens: list[int], decode_steps: int = 3,
            seed: int = 7) -> dict[str, float]:
    """The torch forward against the numpy one on `tokens`: max |Δ| of the logits (dense
    prefill, gated prefill, gated decode) and max |Δ| / max |x| of K, V and q."""
    T = len(tokens)
    lp = sorted({0, T // 3, T // 2, T - 2, T - 1})
    qp = sorted({T // 2, T - 1})
    out: dict[str, float] = {"tokens": float(T)}
    a = host.prefill(tokens, qp, lp)
    b = m.prefill(tokens, qp, lp)
    out["logits_max_abs"] = max(float(np.abs(a.logits[p] - b.logits[p]).max()) for p in lp)
    out["logits_max_abs_ref"] = max(float(np.abs(a.logits[p]).max()) for p in lp)
    out["argmax_agree"] = float(np.mean([np.argmax(a.logits[p]) == np.argmax(b.logits[p])
                                         for p in lp]))
    for name, xa, xb in (("k", a.k, b.k), ("v", a.v, b.v)):
        out[f"{name}_max_rel"] = max(float(np.abs(xa[layer] - xb[layer]).max()
                                           / np.abs(xa[layer]).max()) for layer in xa)
    out["q_max_rel"] = max(float(np.abs(a.q[layer][p] - b.q[layer][p]).max()
                                 / np.abs(a.q[layer][p]).max()) for layer in a.q for p in qp)
    gp = [T // 2, T - 1]
    ga = host.prefill(tokens, [], gp, gate=_test_gate(seed), gated_positions=gp)
    gb = m.prefill(tokens, [], gp, gate=_test_gate(seed), gated_positions=gp)
    out["gated_logits_max_abs"] = max(float(np.abs(ga.logits[p] - gb.logits[p]).max()) for p in gp)
    # The gate changes the output at gated positions (else the check above proves nothing).
    out["gated_vs_dense_max_abs"] = max(float(np.abs(ga.logits[p] - a.logits[p]).max())
                                        for p in gp)
    # Decode the last `decode_steps` tokens over the prefill of the ones before, gated.
    n0 = T - decode_steps
    pa = host.prefill(tokens[:n0], [], [])
    pb = m.prefill(tokens[:n0], [], [])
    kc = {layer: np.zeros((host.cfg.kv_heads, T, host.cfg.head_dim), np.float32) for layer in pa.k}
    vc = {layer: np.zeros_like(kc[layer]) for layer in pa.k}
    for layer in pa.k:
        kc[layer][:, :n0], vc[layer][:, :n0] = pa.k[layer], pa.v[layer]
    dec = m.decoder(pb, n0, T)
    worst, qworst = 0.0, 0.0
    for j in range(n0, T):
        la, qa = host.decode(tokens[j], j, kc, vc, _test_gate(seed + 1))
        lb, qb = dec.decode(tokens[j], j, _test_gate(seed + 1))
        worst = max(worst, float(np.abs(la - lb).max()))
        qworst = max(qworst, max(float(np.abs(qa[i] - qb[i]).max() / np.abs(qa[i]).max())
                                 for i in qa))
    out["decode_logits_max_abs"] = worst
    out["decode_q_max_rel"] = qworst
    return out
