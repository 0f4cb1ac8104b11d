"""The reference engine's paged decode attention: the sparse kernel of eps_client.attention
when its library loads, else a torch gather stand-in that reads every listed block."""

from __future__ import annotations

from typing import Any

import torch


def attention_kernel() -> tuple[Any, str]:
    """The sparse paged decode kernel (eps_client.attention), else a torch gather stand-in."""
    try:
        from eps_client.attention import paged_decode_attention

        return paged_decode_attention, "eps_client.attention.paged_decode_attention"
    except Exception as e:  # noqa: BLE001 - the engine still runs, and says which ran
        return gather_attention, f"torch gather (eps_client.attention unavailable: {e})"


def gather_attention(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                     seqused_k: torch.Tensor) -> torch.Tensor:
    """Reference paged decode attention: q [B, qh, d], block_table [B, n], seqused_k [B]."""
    B, n = block_table.shape
    qh, d = q.shape[1], q.shape[2]
    bs, kvh = kv.shape[2], kv.shape[3]
    ids = block_table.long().clamp(0, kv.shape[1] - 1)
    k = kv[0][ids].reshape(B, n * bs, kvh, d).float()
    v = kv[1][ids].reshape(B, n * bs, kvh, d).float()
    valid = torch.arange(n * bs, device=q.device)[None] < seqused_k[:, None]
    qg = q.view(B, kvh, qh // kvh, d).float()
    s = torch.einsum("bhgd,bnhd->bhgn", qg, k) / d ** 0.5
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.einsum("bhgn,bnhd->bhgd", torch.softmax(s, -1), v).reshape(B, qh, d).to(q.dtype)
