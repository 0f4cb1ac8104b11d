"""Visit lists as the inputs of the engines' paged attention kernels (docs/api-memory.md §3.6,
docs/integration/outputs.md).

- FlashAttention / a paged decode kernel: per (layer, batch position[, KV head]) a
  block-table row and ``seqused_k`` (``flash_attention_views``).
- FlashInfer's paged-KV arrays ``indptr``, ``indices``, ``last_page_len`` with epsd's fixed
  budget (``fixed_budget_indptr`` on the host before the step, ``flashinfer_fixed_budget``
  on the device after it): FlashInfer plans on the host from ``indptr``, which the fixed
  budget makes known from the contexts (for reused lists, also the selection's).

A list with count < 0 ("attend densely") becomes the engine's own block-table row; in a
fixed-budget plan only its newest n blocks fit, and the list is counted in ``mismatched``.
So does a list that cannot be the sequence's: a count above its blocks, an empty list of a
row with blocks (never written: epsd's lists hold the row's newest block) or, with
``cache_blocks`` > 0, a block id outside [0, cache_blocks) (counted in ``refused`` for
FlashAttention). Whatever the data, nothing is read past the engine's rows: a context < 1
is an empty row, a longer one than the table's row is cut to the row, and a plan asking
for more blocks than a row holds repeats its oldest block (block 0 for an empty row).
epsd's lists end at the row's newest block. A list selected at a shorter context and reused
for later steps (docs/api.md, "Reusing a selection") ends before it: FlashAttention's views
extend it with the row's blocks after its last one, when that block is among the row's
newest ``REUSE_WINDOW_BLOCKS``. A list whose last block is none of those, or that the row
has no room to extend (count + gained > the row's blocks), cannot be the sequence's: it is
refused like the above (mismatched in a fixed-budget plan). A fixed-budget plan made with
the selection's contexts (``fixed_budget_indptr(..., selected_tokens=...)``) has room for
the reused lists so extended; a list that does not fill its plan is mismatched.
The torch functions run on the device without host copies: through libeps_engine's kernel
when it loads (``eps_client.engine``), else with torch operations. The ``*_reference``
functions are numpy, for tests. Shapes: visit_blocks [layers, max_batch, (lists,)
max_blocks], visit_count [layers, max_batch(, lists)], engine_table [>= batch, >= blocks]
(row i: position i's blocks), context_tokens [batch].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eps_client import _values
from eps_client.layout import blocks_for

# How far back the views look for a reused list's last block (libeps_engine's
# kReuseWindowBlocks): the row's newest 64 blocks, so a list gains at most 63. With 16-token
# blocks a selection serves at least the 1,008 tokens decoded after it (1,023 when its
# context began a block).
REUSE_WINDOW_BLOCKS = 64


def fixed_budget_groups(first_n: int, last_n: int, top_pages: int) -> int:
    """k, the groups of a BUDGET_FIXED list of a sequence longer than k groups: the sinks
    (first_n), the recent groups (last_n, and the newest group even when last_n is 0) and
    top_pages ranked ones; the session's effective options give the three. ValueError
    for a negative count or top_pages < 1."""
    sinks = _values.integer("first_n", first_n, 0)
    recent = _values.integer("last_n", last_n, 0)
    ranked = _values.integer("top_pages", top_pages, 1)
    return sinks + max(recent, 1) + ranked


def fixed_budget_blocks(context_tokens: int, budget_groups: int, group_blocks: int,
                        block_size: int) -> int:
    """Blocks of a BUDGET_FIXED list: k groups of g blocks, the newest (partial) among them
    (0 for a context < 1). ``budget_groups``, ``group_blocks`` and ``block_size`` int32s >= 1,
    else ValueError (a plan of 0 groups or 0-token blocks is no plan); ``context_tokens`` an
    int64 (TypeError for 100.9: a context is a count of tokens)."""
    _check_plan(budget_groups, group_blocks, block_size)
    context_tokens = _values.integer("context_tokens", context_tokens, *_values.INT64)
    if context_tokens < 1:
        return 0
    blocks = -(-context_tokens // block_size)
    groups = -(-blocks // group_blocks)
    if groups <= budget_groups:
        return blocks
    return (budget_groups - 1) * group_blocks + blocks - (groups - 1) * group_blocks


def fixed_budget_indptr(context_tokens: Any, lists: int, budget_groups: int, group_blocks: int,
                        block_size: int, selected_tokens: Any = None) -> np.ndarray:
    """indptr [batch * lists + 1] int32 of the fixed-budget plan (the same for every layer).
    ``selected_tokens`` (None: the contexts themselves): the contexts at the selection whose
    lists the step reuses; each list then holds that selection's fixed_budget_blocks and the
    blocks written since. Refuses what client/cpp's FixedBudgetIndptr refuses (ValueError,
    TypeError naming it): the sizes fixed_budget_blocks refuses, ``lists`` < 1, contexts
    that are not integers, selected contexts that are not one per context each at most it,
    and a plan past 2**31 - 1 entries (FlashInfer's indptr is int32; it used to wrap)."""
    _check_plan(budget_groups, group_blocks, block_size)
    lists = _values.integer("lists", lists)
    if not 1 <= lists <= _values.INT32[1]:
        raise ValueError(f"lists={lists} not in [1, {_values.INT32[1]}]")
    contexts = _values.integer_array("context_tokens", context_tokens).reshape(-1)
    selected = contexts if selected_tokens is None else \
        _values.integer_array("selected_tokens", selected_tokens).reshape(-1)
    if selected.shape != contexts.shape:
        raise ValueError(f"selected_tokens has {selected.size} entries, context_tokens "
                         f"{contexts.size}")
    indptr, total = [0], 0
    for i, (c, sel) in enumerate(zip(contexts.tolist(), selected.tolist(), strict=True)):
        if sel > c:
            raise ValueError(f"selected_tokens[{i}]={sel} exceeds context_tokens[{i}]={c}: a "
                             "selection is not made after the step that reuses it")
        n = fixed_budget_blocks(sel, budget_groups, group_blocks, block_size) \
            + blocks_for(c, block_size) - blocks_for(sel, block_size)
        for h in range(lists):
            total += n
            if total > _values.INT32[1]:
                raise ValueError(f"the plan exceeds 2^31-1 entries at context_tokens[{i}]={c} "
                                 f"(list {h}): FlashInfer's indptr is int32")
            indptr.append(total)
    return np.array(indptr, dtype=np.int32)


def _check_plan(budget_groups: int, group_blocks: int, block_size: int) -> None:
    """The plan's sizes: int32s >= 1, as client/cpp's CheckPlan takes them."""
    for name, value in (("budget_groups", budget_groups), ("group_blocks", group_blocks),
                        ("block_size", block_size)):
        if _values.integer(name, value) < 1:
            raise ValueError(f"{name}={value} must be >= 1")
        if value > _values.INT32[1]:
            raise ValueError(f"{name}={value} exceeds int32")


def _as_lists(visit_blocks: Any, visit_count: Any) -> tuple[Any, Any]:
    """Adds the lists dimension to union-shaped buffers."""
    if visit_count.ndim == 2:
        return visit_blocks[:, :, None, :], visit_count[:, :, None]
    return visit_blocks, visit_count


def _row(ctx: int, block_size: int, stride: int) -> tuple[int, int, int]:
    """(blocks, tokens, tokens of the last block) of a row: a context < 1 is empty, a longer
    one than the table's row (stride blocks) is cut to it."""
    tokens = max(ctx, 0)
    blocks = min(-(-tokens // block_size), stride)
    tokens = min(tokens, blocks * block_size)
    return blocks, tokens, (tokens - (blocks - 1) * block_size if blocks else 0)


def _usable(ids: np.ndarray, count: int, blocks: int, max_blocks: int,
            cache_blocks: int) -> bool:
    """Whether a list can be the row's (client/cpp's ListUsable): a count within the row and
    the output's width, not 0 for a row with blocks (epsd's lists hold the row's newest
    block: an empty one there was never written, e.g. a position that joined the batch after
    the selection a step reuses), and every id inside the cache when its size is given."""
    if not 0 <= count <= min(blocks, max_blocks) or (count == 0 and blocks > 0):
        return False
    head = ids[:count]
    return cache_blocks <= 0 or bool(np.all((head >= 0) & (head < cache_blocks)))


def _reuse_gain(ids: np.ndarray, count: int, row: np.ndarray, blocks: int) -> int:
    """Blocks a list gains from its engine row, -1 when it cannot be the row's (the module's
    docstring)."""
    if count < 1:
        return 0
    low = max(blocks - REUSE_WINDOW_BLOCKS, 0)
    at = np.flatnonzero(row[low:blocks] == ids[count - 1])
    if not at.size:
        return -1
    gain = blocks - 1 - (low + int(at[-1]))
    return gain if count + gain <= blocks else -1


def _batch(context_tokens: Any, max_batch: int) -> int:
    """B, the step's positions (``context_tokens`` [B]): 1 <= B <= max_batch, the visit
    lists' rows, as the kernels refuse otherwise. The torch path broadcast row 0 of a
    max_batch = 1 list to every position of a larger batch, silently."""
    shape = tuple(context_tokens.shape)
    if len(shape) != 1:
        raise ValueError(f"context_tokens must be [batch]; got {shape}")
    if not 1 <= shape[0] <= max_batch:
        raise ValueError(f"context_tokens has {shape[0]} positions: batch={shape[0]} is not in "
                         f"[1, max_batch={max_batch}] (the visit lists' rows)")
    return int(shape[0])


def _check_table_width(width: int, max_blocks: int) -> None:
    """A dense row must fit the output rows, which are max_blocks long: an engine table
    wider than that is refused, as the kernel refuses it (the numpy reference crashed on
    a broadcast and the torch path cut each dense row to its oldest max_blocks blocks)."""
    if width > max_blocks:
        raise ValueError(f"engine table width {width} exceeds the visit lists' "
                         f"max_blocks={max_blocks}")


def _check_engine_table(engine_table: Any, batch: int) -> None:
    """The engine's table has a row for every position (as the kernel reads it; checked
    before a path is chosen). A table of fewer rows was broadcast by the torch views (row
    0, another sequence's blocks, became every position's dense row and every list was
    looked for in it), failed on a gather in the torch arrays and on an index in numpy."""
    shape = tuple(engine_table.shape)
    if len(shape) != 2 or shape[0] < batch:
        raise ValueError(f"engine_table must be [>= {batch} rows, blocks]; got {shape}")


def _check_sizes(block_size: int, cache_blocks: int) -> None:
    """The views' and arrays' sizes as the C ABI takes them (an int32 block size >= 1, an
    int64 cache size): past int32 a block size wrapped in the call to libeps_engine, and 0
    divided by zero in the torch and numpy paths."""
    _values.integer("block_size", block_size, 1, _values.INT32[1])
    _values.integer("cache_blocks", cache_blocks, *_values.INT64)


def _check_out(name: str, t: Any, shape: tuple[int, ...], device: Any) -> None:
    """An output tensor the kernels write as a compact int32 array of ``shape``."""
    import torch

    if tuple(t.shape) != shape or t.dtype != torch.int32 or not t.is_contiguous() \
            or t.device != device:
        raise ValueError(f"{name} must be a contiguous int32 tensor of shape {shape} on "
                         f"{device}; got {tuple(t.shape)} {t.dtype} on {t.device}"
                         f"{'' if t.is_contiguous() else ', not contiguous'}")


def _device_int32(name: str, t: Any, device: Any) -> Any:
    """``t`` as a contiguous int32 tensor on ``device`` (a copy only where it is not one)."""
    import torch

    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the visit lists on {device}")
    return t.to(torch.int32).contiguous()


def _kernel_inputs(vb: Any, vc: Any, engine_table: Any, context_tokens: Any,
                   batch: int) -> tuple[Any, Any, Any, Any]:
    """The kernels' inputs as they read them: contiguous int32 arrays on the lists' device
    (a slice of the lists, int64 contexts or a column slice of the engine's table were
    read with the wrong strides), and an engine table with a row for every position."""
    if context_tokens.dim() != 1:
        raise ValueError(f"context_tokens must be [batch]; got {tuple(context_tokens.shape)}")
    _check_engine_table(engine_table, batch)
    if tuple(vc.shape) != tuple(vb.shape[:3]):
        raise ValueError(f"visit_count {tuple(vc.shape)} does not match visit_blocks "
                         f"{tuple(vb.shape)}")
    dev = vb.device
    return (_device_int32("visit_blocks", vb, dev), _device_int32("visit_count", vc, dev),
            _device_int32("engine_table", engine_table, dev),
            _device_int32("context_tokens", context_tokens, dev))


def flash_attention_views_reference(visit_blocks: np.ndarray, visit_count: np.ndarray,
                                    engine_table: np.ndarray, context_tokens: np.ndarray,
                                    block_size: int, cache_blocks: int = 0,
                                    refused: np.ndarray | None = None
                                    ) -> tuple[np.ndarray, np.ndarray]:
    """block_table [layers, batch, lists, max_blocks] (-1 past each row's blocks) and
    seqused_k [layers, batch, lists] for the first ``len(context_tokens)`` positions; the
    lists refused (count >= 0 but not usable) are added to ``refused[0]`` when given."""
    vb, vc = _as_lists(visit_blocks, visit_count)
    L, max_batch, lists, max_blocks = vb.shape
    B = _batch(np.asarray(context_tokens), max_batch)
    _check_engine_table(engine_table, B)
    _check_sizes(block_size, cache_blocks)
    _check_table_width(engine_table.shape[1], max_blocks)
    table = np.full((L, B, lists, max_blocks), -1, dtype=np.int32)
    used = np.zeros((L, B, lists), dtype=np.int32)
    n_refused = 0
    for layer in range(L):
        for b in range(B):
            blocks, tokens, last = _row(int(context_tokens[b]), block_size,
                                        engine_table.shape[1])
            for h in range(lists):
                n = int(vc[layer, b, h])
                usable = _usable(vb[layer, b, h], n, blocks, max_blocks, cache_blocks)
                gain = _reuse_gain(vb[layer, b, h], n, engine_table[b], blocks) if usable else -1
                if gain >= 0:
                    table[layer, b, h, :n] = vb[layer, b, h, :n]
                    table[layer, b, h, n:n + gain] = engine_table[b, blocks - gain:blocks]
                    n += gain
                    used[layer, b, h] = 0 if n == 0 else (n - 1) * block_size + last
                else:
                    table[layer, b, h, :blocks] = engine_table[b, :blocks]
                    used[layer, b, h] = tokens
                    n_refused += n >= 0
    if refused is not None:
        refused[0] += n_refused
    return table, used


def flashinfer_fixed_budget_reference(visit_blocks: np.ndarray, visit_count: np.ndarray,
                                      engine_table: np.ndarray, context_tokens: np.ndarray,
                                      block_size: int, indptr: np.ndarray, cache_blocks: int = 0
                                      ) -> tuple[np.ndarray, np.ndarray, int]:
    """indices [layers, nnz], last_page_len [batch * lists] and the mismatched lists."""
    vb, vc = _as_lists(visit_blocks, visit_count)
    L, max_batch, lists, max_blocks = vb.shape
    B = _batch(np.asarray(context_tokens), max_batch)
    _check_engine_table(engine_table, B)
    _check_sizes(block_size, cache_blocks)
    nnz = int(indptr[-1])
    indices = np.zeros((L, nnz), dtype=np.int32)
    last = np.zeros(B * lists, dtype=np.int32)
    mismatched = 0
    for layer in range(L):
        for b in range(B):
            blocks, _, last_b = _row(int(context_tokens[b]), block_size, engine_table.shape[1])
            for h in range(lists):
                q = b * lists + h
                last[q] = last_b
                lo, hi = int(indptr[q]), int(indptr[q + 1])
                if lo < 0 or hi < lo or hi > nnz:
                    mismatched += 1
                    continue
                n = hi - lo
                count = int(vc[layer, b, h])
                usable = _usable(vb[layer, b, h], count, blocks, max_blocks, cache_blocks)
                gain = _reuse_gain(vb[layer, b, h], count, engine_table[b], blocks) \
                    if usable else -1
                if gain >= 0 and count + gain == n:
                    indices[layer, lo:lo + count] = vb[layer, b, h, :count]
                    indices[layer, lo + count:hi] = engine_table[b, blocks - gain:blocks]
                else:
                    k = np.maximum(np.arange(blocks - n, blocks), 0)
                    indices[layer, lo:hi] = engine_table[b, k] if blocks else 0
                    mismatched += 1
    return indices, last, mismatched


def _engine_lib() -> Any:
    try:
        from eps_client.engine import library

        return library()
    except Exception:  # noqa: BLE001 - no library or no device: the torch path
        return None


def _torch_rows(context_tokens: Any, block_size: int, stride: int) -> tuple[Any, Any, Any]:
    """_row for every position: (blocks, tokens, tokens of the last block), int64 [B]."""
    import torch

    tokens = torch.clamp(context_tokens.to(torch.int64), min=0)
    blocks = torch.clamp((tokens + block_size - 1) // block_size, max=stride)
    tokens = torch.minimum(tokens, blocks * block_size)
    last = torch.where(blocks > 0, tokens - (blocks - 1) * block_size, torch.zeros_like(tokens))
    return blocks, tokens, last


def _torch_usable(vb: Any, count: Any, blocks: Any, max_blocks: int, cache_blocks: int) -> Any:
    """_usable for lists [L, B, lists] (count) with ids vb [L, B, lists, max_blocks]."""
    import torch

    ok = (count >= 0) & (count <= blocks[None, :, None]) & (count <= max_blocks) \
        & ((count > 0) | (blocks[None, :, None] == 0))
    if cache_blocks > 0:
        listed = torch.arange(max_blocks, device=vb.device) < count[..., None]
        outside = listed & ((vb < 0) | (vb >= cache_blocks))
        ok &= ~outside.any(dim=-1)
    return ok


def _torch_reuse_gain(vb: Any, count: Any, engine_rows: Any, blocks: Any) -> Any:
    """_reuse_gain for lists [L, B, lists] (count, ids vb) over engine_rows [B, max_blocks]
    whose first blocks [B] entries are the rows (any value for a count the caller
    refuses anyway)."""
    import torch

    window = min(REUSE_WINDOW_BLOCKS, engine_rows.shape[1])
    back = torch.arange(window, device=vb.device)  # 0 is the row's newest block
    at = blocks[:, None] - 1 - back[None]  # [B, window]
    seen = engine_rows.gather(1, torch.clamp(at, min=0))
    # any count (the unusable ones too, discarded later) reads inside the list
    last = vb.gather(-1, torch.clamp(count - 1, 0, vb.shape[-1] - 1)[..., None])
    match = (seen[None, :, None, :] == last) & (at >= 0)[None, :, None, :] \
        & (count > 0)[..., None]
    # the nearest match to the newest block: the first True along `back`
    gain = torch.where(match.any(-1), match.to(torch.int32).argmax(-1).to(torch.int64),
                       torch.full_like(count, -1))
    gain = torch.where(count + gain <= blocks[None, :, None], gain, torch.full_like(gain, -1))
    return torch.where(count > 0, gain, torch.zeros_like(gain))


def flash_attention_views(visit_blocks: Any, visit_count: Any, engine_table: Any,
                          context_tokens: Any, block_size: int, *,
                          out: tuple[Any, Any] | None = None, cache_blocks: int = 0,
                          refused: Any = None,
                          use_kernel: bool | None = None) -> tuple[Any, Any]:
    """Device tensors (torch, int32): block_table [layers, batch, lists, max_blocks] and
    seqused_k [layers, batch, lists] for batch = len(context_tokens). Entries past a row's
    blocks are unspecified. ``out`` reuses preallocated tensors (e.g. in a CUDA graph).
    ``cache_blocks`` > 0 refuses lists naming a block outside [0, cache_blocks); ``refused``
    (a device int32 tensor of one element) has the refused lists added to it. ValueError for
    a batch outside [1, max_batch] (checked first, whatever path runs)."""
    vb, vc = _as_lists(visit_blocks, visit_count)
    L, max_batch, lists, max_blocks = vb.shape
    B = _batch(context_tokens, max_batch)
    _check_engine_table(engine_table, B)
    _check_sizes(block_size, cache_blocks)
    _check_table_width(engine_table.shape[1], max_blocks)
    import torch

    if out is None:
        out = (torch.empty(L, B, lists, max_blocks, dtype=torch.int32, device=vb.device),
               torch.empty(L, B, lists, dtype=torch.int32, device=vb.device))
    table, used = out
    _check_out("out[0] (block_table)", table, (L, B, lists, max_blocks), vb.device)
    _check_out("out[1] (seqused_k)", used, (L, B, lists), vb.device)
    if refused is not None:
        _check_out("refused", refused, (1,), vb.device)
    lib = _engine_lib() if use_kernel is not False and vb.is_cuda else None
    if use_kernel and lib is None:
        raise RuntimeError("use_kernel=True but libeps_engine could not be loaded")
    if lib is not None:
        vb, vc, engine_table, context_tokens = _kernel_inputs(vb, vc, engine_table,
                                                              context_tokens, B)
        max_batch = vb.shape[1]
        from eps_client.engine import check

        stream = torch.cuda.current_stream(vb.device).cuda_stream
        check("flash_attention_views", lib.eps_engine_flash_attention_views(
            vb.data_ptr(), vc.data_ptr(), L, max_batch, lists, max_blocks,
            engine_table.data_ptr(), engine_table.stride(0), context_tokens.data_ptr(), B,
            block_size, cache_blocks, table.data_ptr(), used.data_ptr(),
            0 if refused is None else refused.data_ptr(), stream))
        return table, used
    width = min(engine_table.shape[1], max_blocks)
    blocks, tokens, last = _torch_rows(context_tokens, block_size, width)
    count = vc[:, :B].to(torch.int64)  # [L, B, lists]
    usable = _torch_usable(vb[:, :B], count, blocks, max_blocks, cache_blocks)
    engine_rows = torch.zeros(B, max_blocks, dtype=torch.int32, device=vb.device)
    engine_rows[:, :width] = engine_table[:B, :width]
    gain = _torch_reuse_gain(vb[:, :B], count, engine_rows, blocks)
    usable &= gain >= 0
    gain = torch.clamp(gain, min=0)
    # position p of a list: its own entry below count, then the row's blocks it gains
    p = torch.arange(max_blocks, device=vb.device)
    from_row = torch.clamp(blocks[None, :, None, None] - gain[..., None] + p - count[..., None],
                           0, max_blocks - 1)
    rows = engine_rows[None, :, None, :].expand(L, B, lists, max_blocks)
    listed = torch.where(p < count[..., None], vb[:, :B], rows.gather(-1, from_row))
    table.copy_(torch.where(usable[..., None], listed, engine_rows[None, :, None, :]))
    count = count + gain
    seq = torch.where(count == 0, torch.zeros_like(count),
                      (count - 1) * block_size + last[None, :, None])
    used.copy_(torch.where(usable, seq, tokens[None, :, None]).to(torch.int32))
    if refused is not None:
        refused += (~usable & (count >= 0)).sum().to(torch.int32)
    return table, used


def flashinfer_fixed_budget(visit_blocks: Any, visit_count: Any, engine_table: Any,
                            context_tokens: Any, block_size: int, indptr: Any, *,
                            nnz: int | None = None, cache_blocks: int = 0,
                            use_kernel: bool | None = None) -> tuple[Any, Any, Any]:
    """Device tensors: indices [layers, nnz], last_page_len [batch * lists] and mismatched
    [1] (int32) for the plan ``indptr`` (a device int32 tensor from fixed_budget_indptr).
    ``nnz`` is the plan's last entry (``int(plan[-1])`` of the host array); without it the
    call reads it from ``indptr`` on the device, a host synchronisation that a CUDA graph
    cannot capture. ``cache_blocks`` > 0 refuses (and counts) lists naming a block outside
    [0, cache_blocks). ValueError for a batch outside [1, max_batch] (checked first)."""
    vb, vc = _as_lists(visit_blocks, visit_count)
    L, max_batch, lists, max_blocks = vb.shape
    B = _batch(context_tokens, max_batch)
    _check_engine_table(engine_table, B)
    _check_sizes(block_size, cache_blocks)
    import torch

    if nnz is None:  # a host copy: pass the plan's nnz to stay on the device (CUDA graphs)
        nnz = int(indptr[-1].item()) if indptr.numel() else 0
    nnz = _values.integer("nnz", nnz, 0)
    dev = vb.device
    if indptr.numel() != B * lists + 1:
        raise ValueError(f"indptr has {indptr.numel()} entries, the plan of {B} positions "
                         f"x {lists} lists has {B * lists + 1}")
    indices = torch.empty(L, max(nnz, 1), dtype=torch.int32, device=dev)
    last = torch.empty(B * lists, dtype=torch.int32, device=dev)
    mismatched = torch.zeros(1, dtype=torch.int32, device=dev)
    lib = _engine_lib() if use_kernel is not False and vb.is_cuda else None
    if use_kernel and lib is None:
        raise RuntimeError("use_kernel=True but libeps_engine could not be loaded")
    if lib is not None:
        vb, vc, engine_table, context_tokens = _kernel_inputs(vb, vc, engine_table,
                                                              context_tokens, B)
        max_batch = vb.shape[1]
        indptr = _device_int32("indptr", indptr, dev)
        from eps_client.engine import check

        stream = torch.cuda.current_stream(dev).cuda_stream
        check("flashinfer_fixed", lib.eps_engine_flashinfer_fixed(
            vb.data_ptr(), vc.data_ptr(), L, max_batch, lists, max_blocks,
            engine_table.data_ptr(), engine_table.stride(0), context_tokens.data_ptr(), B,
            block_size, cache_blocks, indptr.data_ptr(), nnz, indices.data_ptr(),
            last.data_ptr(), mismatched.data_ptr(), stream))
        return indices[:, :nnz], last, mismatched
    ip = indptr.to(torch.int64)
    n = ip[1:] - ip[:-1]  # [B * lists]
    if ip.numel() != B * lists + 1 or int(ip[0]) != 0 or bool((n < 0).any()):
        raise ValueError("indptr must be fixed_budget_indptr's plan: batch * lists + 1 "
                         "non-decreasing entries from 0")
    blocks, _, last_b = _torch_rows(context_tokens, block_size, engine_table.shape[1])
    q = torch.repeat_interleave(torch.arange(B * lists, device=dev), n)  # request of each entry
    j = torch.arange(nnz, device=dev) - ip[:-1][q]  # position within its list
    b, h = q // lists, q % lists
    count = vc[:, :B].to(torch.int64)  # [L, B, lists]
    usable = _torch_usable(vb[:, :B], count, blocks, max_blocks, cache_blocks)
    engine_rows = engine_table[:B].to(torch.int32)  # rows of up to its width's blocks
    gain = _torch_reuse_gain(vb[:, :B], count, engine_rows, blocks)  # -1: not the row's
    fits = (usable & (gain >= 0) & (count + gain == n.reshape(B, lists)[None])) \
        .reshape(L, B * lists)
    gain = torch.clamp(gain, min=0).reshape(L, B * lists)[:, q]  # [L, nnz]
    cnt = count.reshape(L, B * lists)[:, q]
    # j past max_blocks belongs to a list that does not fit: clamped, so the gather stays
    # inside the lists (torch.where discards it; unclamped it was a device-side assert).
    from_list = vb[:, b, h, torch.clamp(j, max=max_blocks - 1)]  # [L, nnz]
    # entries past the list's own count: the blocks its row gained since
    gained = engine_rows[b, torch.clamp(blocks[b] - gain + j - cnt, 0,
                                        engine_rows.shape[1] - 1)]
    from_list = torch.where(j < cnt, from_list, gained)
    k = torch.clamp(blocks[b] - n[q] + j, min=0)
    from_table = torch.where(blocks[b] > 0, engine_table[b, torch.minimum(
        k, torch.clamp(blocks[b] - 1, min=0))].to(torch.int32), 0)[None].expand(L, -1)
    indices[:, :nnz] = torch.where(fits[:, q], from_list, from_table)
    last.copy_(last_b.repeat_interleave(lists).to(torch.int32))
    mismatched[0] = (~fits).sum().to(torch.int32)
    return indices[:, :nnz], last, mismatched
