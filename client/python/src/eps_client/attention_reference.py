"""The float64 reference of the sparse paged decode attention (numpy), for tests and CPU
runs: the semantics gpu/attention/paged_attention.h states, computed the plain way.
``paged_decode_attention_reference`` takes and returns torch tensors as
``eps_client.attention.paged_decode_attention`` does (without selection feedback);
``reference_numpy`` works on numpy arrays and needs no torch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .attention import _SEQUSED_TOKENS, AttentionListError, check_shapes


def _row_list(
    lists: np.ndarray, lengths: np.ndarray, b: int, h: int, kind: int,
    dense: np.ndarray | None, context: np.ndarray | None, block_size: int,
) -> tuple[np.ndarray, int]:
    """The blocks and token count one (row, KV head) reads; ValueError when empty."""
    row = lists[b, h] if lists.ndim == 3 else lists[b]
    n = int(lengths[b, h] if lengths.ndim == 2 else lengths[b])
    if kind == _SEQUSED_TOKENS:
        tokens = n
        count = -(-tokens // block_size)
    else:
        assert dense is not None and context is not None
        ctx = int(context[b])
        if ctx <= 0:
            raise AttentionListError(f"context_lens[{b}]={ctx}: an empty row")
        if n < 0:
            row, tokens, count = dense[b], ctx, -(-ctx // block_size)
        else:
            if n > -(-ctx // block_size):
                raise AttentionListError(
                    f"row {b} KV head {h}: visit_count {n} exceeds the blocks of its sequence "
                    f"(ceil({ctx} / {block_size}))"
                )
            last = ctx - (ctx - 1) // block_size * block_size
            count = n
            tokens = (n - 1) * block_size + last if n > 0 else 0
    if tokens <= 0:
        raise AttentionListError(f"row {b} KV head {h}: an empty list (length {n})")
    if count > row.shape[0]:
        raise AttentionListError(
            f"row {b} KV head {h}: {count} blocks exceed the list width {row.shape[0]}"
        )
    return row[:count], tokens


def reference_numpy(
    q: np.ndarray,
    kv_cache: np.ndarray,
    lists: np.ndarray,
    lengths: np.ndarray,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    length_kind: int = _SEQUSED_TOKENS,
    dense_table: np.ndarray | None = None,
    context_lens: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention over numpy arrays; returns (out, lse) as float64."""
    check_shapes(q.shape, kv_cache.shape, lists.shape, lengths.shape)
    batch, num_q_heads, d = q.shape
    num_blocks, block_size, num_kv_heads = kv_cache.shape[1:4]
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    q64 = q.astype(np.float64)
    out = np.zeros((batch, num_q_heads, d))
    lse = np.zeros((batch, num_q_heads))
    for b in range(batch):
        for h in range(num_kv_heads):
            blocks, tokens = _row_list(
                lists, lengths, b, h, length_kind, dense_table, context_lens, block_size
            )
            bad = (blocks < 0) | (blocks >= num_blocks)
            if bad.any():
                raise AttentionListError(
                    f"row {b} KV head {h}: block id {int(blocks[bad][0])} not in "
                    f"[0, {num_blocks})"
                )
            k = kv_cache[0, blocks, :, h].reshape(-1, d)[:tokens].astype(np.float64)
            v = kv_cache[1, blocks, :, h].reshape(-1, d)[:tokens].astype(np.float64)
            qh = q64[b, h * group : (h + 1) * group]  # [group, d]
            s = qh @ k.T * scale  # [group, tokens]
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            m = s.max(axis=1, keepdims=True)
            # A head whose every score is -inf attends to nothing: zeros and lse -inf, as
            # the kernels write (not the NaN of exp(-inf - -inf)).
            dead = np.isneginf(m)
            m_use = np.where(dead, 0.0, m)
            p = np.exp(s - m_use)  # all 0 in a dead head
            total = np.where(dead, 1.0, p.sum(axis=1, keepdims=True))
            out[b, h * group : (h + 1) * group] = p @ v / total
            lse_h = np.where(dead, -np.inf, m_use + np.log(total))
            lse[b, h * group : (h + 1) * group] = lse_h[:, 0]
    return out, lse


def paged_decode_attention_reference(
    q: Any,
    kv_cache: Any,
    block_table: Any,
    seqused_k: Any,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    out: Any = None,
    return_lse: bool = False,
) -> Any:
    """paged_decode_attention in float64 on the CPU, for tests; any device in and out
    (without selection feedback, which it does not compute).

    Returns out in q's dtype and device (written into ``out`` when given), and lse
    float32 when return_lse.
    """
    import torch

    def host(t: Any) -> np.ndarray:
        t = t.detach().to("cpu")
        if t.is_floating_point():
            t = t.to(torch.float64)
        return np.asarray(t.numpy())

    o64, lse64 = reference_numpy(
        host(q), host(kv_cache), host(block_table), host(seqused_k),
        softmax_scale=softmax_scale, softcap=softcap,
    )
    result = torch.from_numpy(o64).to(device=q.device, dtype=q.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    if return_lse:
        return result, torch.from_numpy(lse64).to(device=q.device, dtype=torch.float32)
    return result
