"""Visit lists as the inputs of the engines' paged attention kernels (docs/api.md §3.6,
docs/integration/outputs.md).

- FlashAttention / a paged decode kernel: per (layer, batch position[, KV head]) a
  block-table row and ``seqused_k`` (``flash_attention_views``).
- FlashInfer's paged-KV arrays ``indptr``, ``indices``, ``last_page_len`` with epsd's fixed
  budget (``fixed_budget_indptr`` on the host before the step, ``flashinfer_fixed_budget``
  on the device after it): FlashInfer plans on the host from ``indptr``, which the fixed
  budget makes known from the contexts alone.

A list with count < 0 ("attend densely") becomes the engine's own block-table row; in a
fixed-budget plan only its newest n blocks fit, and the list is counted in ``mismatched``.
The torch functions run on the device without host copies: through libeps_engine's kernel
when it loads (``eps_client.engine``), else with torch operations. The ``*_reference``
functions are numpy, for tests. Shapes: visit_blocks [layers, max_batch, (lists,)
max_blocks], visit_count [layers, max_batch(, lists)], engine_table [batch, >= blocks],
context_tokens [batch].
"""

from __future__ import annotations

from typing import Any

import numpy as np


def fixed_budget_blocks(context_tokens: int, budget_groups: int, group_blocks: int,
                        block_size: int) -> int:
    """Blocks of a BUDGET_FIXED list: k groups of g blocks, the newest (partial) among them."""
    blocks = -(-context_tokens // block_size)
    groups = -(-blocks // group_blocks)
    if groups <= budget_groups:
        return blocks
    return (budget_groups - 1) * group_blocks + blocks - (groups - 1) * group_blocks


def fixed_budget_indptr(context_tokens: Any, lists: int, budget_groups: int, group_blocks: int,
                        block_size: int) -> np.ndarray:
    """indptr [batch * lists + 1] int32 of the fixed-budget plan (the same for every layer)."""
    n = [fixed_budget_blocks(int(c), budget_groups, group_blocks, block_size)
         for c in np.asarray(context_tokens).reshape(-1) for _ in range(lists)]
    return np.concatenate([[0], np.cumsum(n)]).astype(np.int32)


def _as_lists(visit_blocks: Any, visit_count: Any) -> tuple[Any, Any]:
    """Adds the lists dimension to union-shaped buffers."""
    if visit_count.ndim == 2:
        return visit_blocks[:, :, None, :], visit_count[:, :, None]
    return visit_blocks, visit_count


def flash_attention_views_reference(visit_blocks: np.ndarray, visit_count: np.ndarray,
                                    engine_table: np.ndarray, context_tokens: np.ndarray,
                                    block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """block_table [layers, batch, lists, max_blocks] (-1 past each row's blocks) and
    seqused_k [layers, batch, lists], for the first ``len(context_tokens)`` positions."""
    vb, vc = _as_lists(visit_blocks, visit_count)
    L, _, lists, max_blocks = vb.shape
    B = len(context_tokens)
    table = np.full((L, B, lists, max_blocks), -1, dtype=np.int32)
    used = np.zeros((L, B, lists), dtype=np.int32)
    for layer in range(L):
        for b in range(B):
            ctx = int(context_tokens[b])
            blocks = -(-ctx // block_size)
            last = ctx - (blocks - 1) * block_size
            for h in range(lists):
                n = int(vc[layer, b, h])
                if 0 <= n <= min(blocks, max_blocks):
                    table[layer, b, h, :n] = vb[layer, b, h, :n]
                    used[layer, b, h] = 0 if n == 0 else (n - 1) * block_size + last
                else:
                    table[layer, b, h, :blocks] = engine_table[b, :blocks]
                    used[layer, b, h] = ctx
    return table, used


def flashinfer_fixed_budget_reference(visit_blocks: np.ndarray, visit_count: np.ndarray,
                                      engine_table: np.ndarray, context_tokens: np.ndarray,
                                      block_size: int, indptr: np.ndarray
                                      ) -> tuple[np.ndarray, np.ndarray, int]:
    """indices [layers, nnz], last_page_len [batch * lists] and the mismatched lists."""
    vb, vc = _as_lists(visit_blocks, visit_count)
    L, _, lists, max_blocks = vb.shape
    B = len(context_tokens)
    nnz = int(indptr[-1])
    indices = np.zeros((L, nnz), dtype=np.int32)
    last = np.zeros(B * lists, dtype=np.int32)
    mismatched = 0
    for layer in range(L):
        for b in range(B):
            ctx = int(context_tokens[b])
            blocks = -(-ctx // block_size)
            for h in range(lists):
                q = b * lists + h
                lo, hi = int(indptr[q]), int(indptr[q + 1])
                n = hi - lo
                count = int(vc[layer, b, h])
                if count == n and count <= min(blocks, max_blocks):
                    indices[layer, lo:hi] = vb[layer, b, h, :n]
                else:
                    indices[layer, lo:hi] = engine_table[b, blocks - n : blocks]
                    mismatched += 1
                last[q] = ctx - (blocks - 1) * block_size
    return indices, last, mismatched


def _engine_lib() -> Any:
    try:
        from eps_client.engine import library

        return library()
    except Exception:  # noqa: BLE001 - no library or no device: the torch path
        return None


def flash_attention_views(visit_blocks: Any, visit_count: Any, engine_table: Any,
                          context_tokens: Any, block_size: int, *,
                          out: tuple[Any, Any] | None = None,
                          use_kernel: bool | None = None) -> tuple[Any, Any]:
    """Device tensors (torch, int32): block_table [layers, batch, lists, max_blocks] and
    seqused_k [layers, batch, lists] for batch = len(context_tokens). Entries past a row's
    blocks are unspecified. ``out`` reuses preallocated tensors (e.g. in a CUDA graph)."""
    import torch

    vb, vc = _as_lists(visit_blocks, visit_count)
    L, max_batch, lists, max_blocks = vb.shape
    B = context_tokens.shape[0]
    if out is None:
        out = (torch.empty(L, B, lists, max_blocks, dtype=torch.int32, device=vb.device),
               torch.empty(L, B, lists, dtype=torch.int32, device=vb.device))
    table, used = out
    lib = _engine_lib() if use_kernel is not False and vb.is_cuda else None
    if use_kernel and lib is None:
        raise RuntimeError("use_kernel=True but libeps_engine could not be loaded")
    if lib is not None:
        from eps_client.engine import check

        stream = torch.cuda.current_stream(vb.device).cuda_stream
        check("flash_attention_views", lib.eps_engine_flash_attention_views(
            vb.data_ptr(), vc.data_ptr(), L, max_batch, lists, max_blocks,
            engine_table.data_ptr(), engine_table.stride(0), context_tokens.data_ptr(), B,
            block_size, table.data_ptr(), used.data_ptr(), stream))
        return table, used
    ctx = context_tokens.to(torch.int64)
    blocks = (ctx + block_size - 1) // block_size  # [B]
    last = ctx - (blocks - 1) * block_size
    count = vc[:, :B].to(torch.int64)  # [L, B, lists]
    dense = (count < 0) | (count > blocks[None, :, None]) | (count > max_blocks)
    width = min(engine_table.shape[1], max_blocks)
    engine_rows = torch.zeros(B, max_blocks, dtype=torch.int32, device=vb.device)
    engine_rows[:, :width] = engine_table[:, :width]
    table.copy_(torch.where(dense[..., None], engine_rows[None, :, None, :], vb[:, :B]))
    seq = torch.where(count == 0, torch.zeros_like(count),
                      (count - 1) * block_size + last[None, :, None])
    used.copy_(torch.where(dense, ctx[None, :, None], seq).to(torch.int32))
    return table, used


def flashinfer_fixed_budget(visit_blocks: Any, visit_count: Any, engine_table: Any,
                            context_tokens: Any, block_size: int, indptr: Any, *,
                            use_kernel: bool | None = None) -> tuple[Any, Any, Any]:
    """Device tensors: indices [layers, nnz], last_page_len [batch * lists] and mismatched
    [1] (int32) for the plan ``indptr`` (a device int32 tensor from fixed_budget_indptr)."""
    import torch

    vb, vc = _as_lists(visit_blocks, visit_count)
    L, max_batch, lists, max_blocks = vb.shape
    B = context_tokens.shape[0]
    nnz = int(indptr[-1].item()) if indptr.numel() else 0
    dev = vb.device
    indices = torch.empty(L, max(nnz, 1), dtype=torch.int32, device=dev)
    last = torch.empty(B * lists, dtype=torch.int32, device=dev)
    mismatched = torch.zeros(1, dtype=torch.int32, device=dev)
    lib = _engine_lib() if use_kernel is not False and vb.is_cuda else None
    if use_kernel and lib is None:
        raise RuntimeError("use_kernel=True but libeps_engine could not be loaded")
    if lib is not None:
        from eps_client.engine import check

        stream = torch.cuda.current_stream(dev).cuda_stream
        check("flashinfer_fixed", lib.eps_engine_flashinfer_fixed(
            vb.data_ptr(), vc.data_ptr(), L, max_batch, lists, max_blocks,
            engine_table.data_ptr(), engine_table.stride(0), context_tokens.data_ptr(), B,
            block_size, indptr.data_ptr(), nnz, indices.data_ptr(), last.data_ptr(),
            mismatched.data_ptr(), stream))
        return indices[:, :nnz], last, mismatched
    ctx = context_tokens.to(torch.int64)
    blocks = (ctx + block_size - 1) // block_size
    ip = indptr.to(torch.int64)
    n = ip[1:] - ip[:-1]  # [B * lists]
    q = torch.repeat_interleave(torch.arange(B * lists, device=dev), n)  # request of each entry
    j = torch.arange(nnz, device=dev) - ip[:-1][q]  # position within its list
    b, h = q // lists, q % lists
    count = vc[:, :B].to(torch.int64).reshape(L, B * lists)  # [L, B*lists]
    fits = (count == n[None]) & (count <= torch.clamp(blocks, max=max_blocks).repeat_interleave(
        lists)[None])
    from_list = vb[:, b, h, j]  # [L, nnz]
    from_table = engine_table[b, blocks[b] - n[q] + j].to(torch.int32)[None].expand(L, -1)
    indices[:, :nnz] = torch.where(fits[:, q], from_list, from_table)
    last.copy_((ctx - (blocks - 1) * block_size).repeat_interleave(lists).to(torch.int32))
    mismatched[0] = (~fits).sum().to(torch.int32)
    return indices[:, :nnz], last, mismatched
