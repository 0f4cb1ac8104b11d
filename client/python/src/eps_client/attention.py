"""Sparse paged decode attention: torch tensors in, the C ABI of libeps_attention.so out.

``paged_decode_attention`` runs one query token per sequence over a paged KV cache in
vLLM's FlashAttention layout, reading only the blocks its lists name (the lists stay on
the device). ``paged_decode_attention_gated`` takes epsd's ``visit_blocks`` /
``visit_count`` directly, with the engine's block table as the dense fallback of rows
whose count is -1. ``eps_client.attention_reference`` has the float64 reference for
tests and CPU runs. gpu/attention/paged_attention.h states the semantics.

The library is found through ``EPS_ATTENTION_LIB`` (a file path), else next to this
package, else in a build directory of the repository (``build/gpu/attention/``). torch
is imported only when a function is called, so ``import eps_client.attention`` works
without it.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LIBRARY_NAME = "libeps_attention.so"
ABI_VERSION = 2
BLOCK_SIZE = 16
HEAD_DIMS = (64, 128, 256)

_OK, _EINVAL, _ECUDA, _ELIST = 0, 1, 2, 3
_BF16, _FP16 = 1, 2
_SEQUSED_TOKENS, _VISIT_COUNT = 0, 1
_ERROR_WORDS = 4


class AttentionListError(ValueError):
    """A list read on the device was invalid (empty row, block id out of range, too long)."""


class _Params(ctypes.Structure):
    """Mirror of EpsAttnParams (gpu/attention/paged_attention.h), field for field."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("q", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("lists", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("dense_table", ctypes.c_void_p),
        ("context_lens", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("error_word", ctypes.c_void_p),
        ("q_stride_row", ctypes.c_int64),
        ("q_stride_head", ctypes.c_int64),
        ("kv_stride_block", ctypes.c_int64),
        ("kv_stride_token", ctypes.c_int64),
        ("kv_stride_head", ctypes.c_int64),
        ("lists_stride_row", ctypes.c_int64),
        ("lists_stride_head", ctypes.c_int64),
        ("lengths_stride_row", ctypes.c_int64),
        ("lengths_stride_head", ctypes.c_int64),
        ("dense_stride_row", ctypes.c_int64),
        ("out_stride_row", ctypes.c_int64),
        ("out_stride_head", ctypes.c_int64),
        ("lse_stride_row", ctypes.c_int64),
        ("lse_stride_head", ctypes.c_int64),
        ("workspace_bytes", ctypes.c_uint64),
        ("dtype", ctypes.c_int32),
        ("batch", ctypes.c_int32),
        ("num_q_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("num_blocks", ctypes.c_int32),
        ("max_list_blocks", ctypes.c_int32),
        ("dense_max_blocks", ctypes.c_int32),
        ("length_kind", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("reserved", ctypes.c_int32),
        ("feedback", ctypes.c_void_p),
        ("block_positions", ctypes.c_void_p),
        ("feedback_rows", ctypes.c_void_p),
        ("feedback_stride_row", ctypes.c_int64),
        ("feedback_stride_head", ctypes.c_int64),
        ("feedback_seqs", ctypes.c_int32),
        ("feedback_groups", ctypes.c_int32),
        ("feedback_group_blocks", ctypes.c_int32),
        ("reserved2", ctypes.c_int32),
    ]


@dataclass(frozen=True)
class FeedbackTarget:
    """Where an attention call writes selection feedback (docs/api-memory.md, "Selection
    feedback").

    buffer: float32 [max_seqs, num_q_heads, max_groups], one layer of epsd's feedback
    buffer (``buffers.feedback[layer]``); block_positions: int32 [num_blocks], each cache
    block's index within its sequence (``block_positions()`` derives it from a block
    table); group_blocks: epsd's group_blocks; rows: int32 [batch], each batch row's
    table row (None: row b is table row b).
    """

    buffer: Any
    block_positions: Any
    group_blocks: int
    rows: Any = None


def library_candidates() -> list[Path]:
    """Where the library is looked for, in order."""
    env = os.environ.get("EPS_ATTENTION_LIB")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    found = [here / LIBRARY_NAME]
    for parent in here.parents:
        for build in sorted(parent.glob("build*")):
            found.append(build / "gpu" / "attention" / LIBRARY_NAME)
        if (parent / ".git").exists():
            break
    return found


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
    """Loads libeps_attention.so once; raises OSError naming every place tried."""
    global _library
    with _lock:
        if _library is not None:
            return _library
        tried = library_candidates()
        path = next((p for p in tried if p.is_file()), None)
        if path is None:
            raise OSError(
                f"{LIBRARY_NAME} not found; set EPS_ATTENTION_LIB or build it "
                f"(scripts/build.sh with nvcc). Tried: {', '.join(map(str, tried))}"
            )
        lib = ctypes.CDLL(str(path))
        lib.eps_attn_params_size.restype = ctypes.c_uint64
        lib.eps_attn_abi_version.restype = ctypes.c_int32
        lib.eps_attn_last_error.restype = ctypes.c_char_p
        params_p = ctypes.POINTER(_Params)
        lib.eps_attn_workspace_bytes.argtypes = [params_p, ctypes.POINTER(ctypes.c_uint64)]
        lib.eps_attn_workspace_bytes.restype = ctypes.c_int32
        lib.eps_attn_paged_decode.argtypes = [params_p, ctypes.c_void_p]
        lib.eps_attn_paged_decode.restype = ctypes.c_int32
        lib.eps_attn_read_error.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
        lib.eps_attn_read_error.restype = ctypes.c_int32
        lib.eps_attn_block_positions.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
            ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
        lib.eps_attn_block_positions.restype = ctypes.c_int32
        if lib.eps_attn_abi_version() != ABI_VERSION:
            raise OSError(
                f"{path}: ABI version {lib.eps_attn_abi_version()}, expected {ABI_VERSION}"
            )
        if lib.eps_attn_params_size() != ctypes.sizeof(_Params):
            raise OSError(
                f"{path}: sizeof(EpsAttnParams)={lib.eps_attn_params_size()} but the "
                f"Python mirror has {ctypes.sizeof(_Params)}"
            )
        _library = lib
        return lib


def _raise_for(lib: ctypes.CDLL, code: int) -> None:
    if code == _OK:
        return
    message = lib.eps_attn_last_error().decode(errors="replace")
    if code == _EINVAL:
        raise ValueError(message)
    if code == _ELIST:
        raise AttentionListError(message)
    raise RuntimeError(message)


def check_shapes(
    q: Sequence[int],
    kv_cache: Sequence[int],
    lists: Sequence[int],
    lengths: Sequence[int],
    lists_name: str = "block_table",
    lengths_name: str = "seqused_k",
) -> None:
    """Raises ValueError naming the tensor and dimension when the shapes disagree."""
    if len(q) != 3:
        raise ValueError(f"q must be [batch, num_q_heads, d], got shape {tuple(q)}")
    batch, num_q_heads, d = q
    if len(kv_cache) != 5 or kv_cache[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, d], got shape "
            f"{tuple(kv_cache)}"
        )
    _, num_blocks, block_size, num_kv_heads, kv_d = kv_cache
    if block_size != BLOCK_SIZE:
        raise ValueError(f"kv_cache.shape[2]={block_size} (block_size) must be {BLOCK_SIZE}")
    if kv_d != d:
        raise ValueError(f"kv_cache.shape[4]={kv_d} does not match q.shape[2]={d}")
    if d not in HEAD_DIMS:
        raise ValueError(f"q.shape[2]={d} (head_dim) not in {HEAD_DIMS}")
    if num_blocks < 1 or num_kv_heads < 1 or batch < 1:
        raise ValueError(f"empty tensors: q {tuple(q)}, kv_cache {tuple(kv_cache)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"q.shape[1]={num_q_heads} (num_q_heads) is not a multiple of "
            f"kv_cache.shape[3]={num_kv_heads} (num_kv_heads)"
        )
    if len(lists) not in (2, 3) or lists[0] != batch or lists[-1] < 1:
        raise ValueError(
            f"{lists_name} must be [{batch}, max_blocks] or [{batch}, {num_kv_heads}, "
            f"max_blocks], got shape {tuple(lists)}"
        )
    if len(lists) == 3 and lists[1] != num_kv_heads:
        raise ValueError(
            f"{lists_name}.shape[1]={lists[1]} does not match num_kv_heads={num_kv_heads}"
        )
    if tuple(lengths) not in ((batch,), (batch, num_kv_heads)):
        raise ValueError(
            f"{lengths_name} must be [{batch}] or [{batch}, {num_kv_heads}], got shape "
            f"{tuple(lengths)}"
        )


# ---------------------------------------------------------------------------------------
# The GPU path.

_error_words: dict[int, Any] = {}


def _error_word(device: Any) -> Any:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        word = _error_words.get(index)
        if word is None:
            word = torch.zeros(_ERROR_WORDS, dtype=torch.int32, device=f"cuda:{index}")
            _error_words[index] = word
    return word


def check_attention_errors(device: Any = None, clear: bool = True) -> None:
    """Waits for the current stream and raises AttentionListError if any call on
    ``device`` since the last check met an invalid list (the first one is named)."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    dev = torch.device(dev)
    lib = load_library()
    word = _error_word(dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    _raise_for(lib, lib.eps_attn_read_error(word.data_ptr(), stream, int(clear)))


def _dtype_code(dtype: Any) -> int:
    import torch

    if dtype == torch.bfloat16:
        return _BF16
    if dtype == torch.float16:
        return _FP16
    raise ValueError(f"dtype {dtype} is not supported (bfloat16 or float16)")


def _check_tensor(name: str, t: Any, device: Any, dtype: Any = None) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}.dtype={t.dtype}, expected {dtype}")
    if t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride {t.stride(-1)})")


def _run(
    q: Any, kv_cache: Any, lists: Any, lengths: Any, *, kind: int, dense: Any,
    context: Any, softmax_scale: float | None, softcap: float, out: Any, return_lse: bool,
    names: tuple[str, str], num_splits: int = 0, feedback: FeedbackTarget | None = None,
) -> Any:
    import torch

    if not isinstance(q, torch.Tensor) or not q.is_cuda:
        raise ValueError("q must be a CUDA tensor (use paged_decode_attention_reference on CPU)")
    device = q.device
    _check_tensor("q", q, device)
    _check_tensor("kv_cache", kv_cache, device, q.dtype)
    _check_tensor(names[0], lists, device, torch.int32)
    _check_tensor(names[1], lengths, device, torch.int32)
    check_shapes(q.shape, kv_cache.shape, lists.shape, lengths.shape, *names)
    batch, num_q_heads, d = q.shape
    num_kv_heads = kv_cache.shape[3]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _check_tensor("out", out, device, q.dtype)
        if out.shape != q.shape:
            raise ValueError(f"out.shape={tuple(out.shape)} does not match q {tuple(q.shape)}")
    lse = None
    if return_lse:
        lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=device)

    p = _Params()
    p.struct_size = ctypes.sizeof(_Params)
    p.dtype = _dtype_code(q.dtype)
    p.batch, p.num_q_heads, p.head_dim = batch, num_q_heads, d
    p.num_kv_heads, p.block_size, p.num_blocks = num_kv_heads, kv_cache.shape[2], kv_cache.shape[1]
    p.q, p.q_stride_row, p.q_stride_head = q.data_ptr(), q.stride(0), q.stride(1)
    p.k_cache, p.v_cache = kv_cache[0].data_ptr(), kv_cache[1].data_ptr()
    p.kv_stride_block, p.kv_stride_token, p.kv_stride_head = kv_cache.stride()[1:4]
    p.lists, p.max_list_blocks = lists.data_ptr(), lists.shape[-1]
    p.lists_stride_row = lists.stride(0)
    p.lists_stride_head = lists.stride(1) if lists.dim() == 3 else 0
    p.lengths, p.length_kind = lengths.data_ptr(), kind
    p.lengths_stride_row = lengths.stride(0)
    p.lengths_stride_head = lengths.stride(1) if lengths.dim() == 2 else 0
    if dense is not None:
        p.dense_table, p.dense_stride_row = dense.data_ptr(), dense.stride(0)
        p.dense_max_blocks, p.context_lens = dense.shape[1], context.data_ptr()
    p.out, p.out_stride_row, p.out_stride_head = out.data_ptr(), out.stride(0), out.stride(1)
    if lse is not None:
        p.lse, p.lse_stride_row, p.lse_stride_head = lse.data_ptr(), lse.stride(0), lse.stride(1)
    p.softmax_scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    p.softcap = float(softcap)
    p.num_splits = num_splits  # 0: the library's choice; benchmarks sweep it
    p.error_word = _error_word(device).data_ptr()
    if feedback is not None:
        _set_feedback(p, feedback, batch, num_q_heads, device)

    lib = load_library()
    size = ctypes.c_uint64(0)
    with torch.cuda.device(device):  # the plan reads the current device's occupancy
        _raise_for(lib, lib.eps_attn_workspace_bytes(ctypes.byref(p), ctypes.byref(size)))
        workspace = None
        if size.value:
            workspace = torch.empty(size.value, dtype=torch.uint8, device=device)
            p.workspace, p.workspace_bytes = workspace.data_ptr(), size.value
        stream = torch.cuda.current_stream(device).cuda_stream
        _raise_for(lib, lib.eps_attn_paged_decode(ctypes.byref(p), stream))
    if os.environ.get("EPS_ATTENTION_CHECK") == "1":
        check_attention_errors(device)
    return (out, lse) if return_lse else out


def _set_feedback(p: _Params, f: FeedbackTarget, batch: int, num_q_heads: int,
                  device: Any) -> None:
    import torch

    _check_tensor("feedback.buffer", f.buffer, device, torch.float32)
    _check_tensor("feedback.block_positions", f.block_positions, device, torch.int32)
    if f.buffer.dim() != 3 or f.buffer.shape[1] != num_q_heads:
        raise ValueError(f"feedback.buffer must be [max_seqs, {num_q_heads}, max_groups], "
                         f"got {tuple(f.buffer.shape)}")
    if f.block_positions.dim() != 1 or f.block_positions.shape[0] < p.num_blocks:
        raise ValueError(f"feedback.block_positions must be [{p.num_blocks}] (one per cache "
                         f"block), got {tuple(f.block_positions.shape)}")
    p.feedback = f.buffer.data_ptr()
    p.feedback_stride_row, p.feedback_stride_head = f.buffer.stride(0), f.buffer.stride(1)
    p.feedback_seqs, p.feedback_groups = f.buffer.shape[0], f.buffer.shape[2]
    p.feedback_group_blocks = int(f.group_blocks)
    p.block_positions = f.block_positions.data_ptr()
    if f.rows is not None:
        _check_tensor("feedback.rows", f.rows, device, torch.int32)
        if tuple(f.rows.shape) != (batch,):
            raise ValueError(f"feedback.rows must be [{batch}], got {tuple(f.rows.shape)}")
        p.feedback_rows = f.rows.data_ptr()


def block_positions(block_table: Any, lengths: Any, num_blocks: int, out: Any = None) -> Any:
    """int32 [num_blocks]: positions[block_table[b, j]] = j over each row's
    ceil(lengths[b] / 16) blocks (lengths in tokens), on block_table's device and the
    current stream; entries of other blocks are -1 (or left as they were in ``out``)."""
    import torch

    device = block_table.device
    _check_tensor("block_table", block_table, device, torch.int32)
    _check_tensor("lengths", lengths, device, torch.int32)
    if block_table.dim() != 2 or tuple(lengths.shape) != (block_table.shape[0],):
        raise ValueError(f"block_table [batch, blocks] and lengths [batch] expected, got "
                         f"{tuple(block_table.shape)} and {tuple(lengths.shape)}")
    if out is None:
        out = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
    else:
        _check_tensor("out", out, device, torch.int32)
        if tuple(out.shape) != (num_blocks,):
            raise ValueError(f"out must be [{num_blocks}], got {tuple(out.shape)}")
    lib = load_library()
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        _raise_for(lib, lib.eps_attn_block_positions(
            block_table.data_ptr(), block_table.stride(0), block_table.shape[1],
            lengths.data_ptr(), block_table.shape[0], BLOCK_SIZE, num_blocks, out.data_ptr(),
            stream))
    return out


def paged_decode_attention(
    q: Any,
    kv_cache: Any,
    block_table: Any,
    seqused_k: Any,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    out: Any = None,
    return_lse: bool = False,
    feedback: FeedbackTarget | None = None,
) -> Any:
    """Decode attention of q [batch, num_q_heads, d] over the blocks each row lists.

    kv_cache [2, num_blocks, 16, num_kv_heads, d] (same dtype as q, bf16 or fp16);
    block_table int32 [batch, max_blocks] or [batch, num_kv_heads, max_blocks];
    seqused_k int32 [batch] or [batch, num_kv_heads]: the first seqused_k tokens of the
    listed blocks in list order are read (the last listed block may be partial).
    softmax_scale defaults to 1/sqrt(d); softcap > 0 applies softcap * tanh(s / softcap).
    Returns out [batch, num_q_heads, d] (q's dtype), and lse float32 [batch,
    num_q_heads] (natural log) when return_lse. Runs on the current stream. Invalid
    lists are raised by check_attention_errors() (or after every call with
    EPS_ATTENTION_CHECK=1): a row that cannot be read (seqused_k 0, a list longer than
    its row) is written as zeros; a block id out of range is skipped (never read), so
    its row attends over its other blocks.
    With ``feedback``, each visited group's log-sum-exp per query head is combined into
    feedback.buffer (FeedbackTarget; paged_attention.h, "Selection feedback").
    """
    return _run(
        q, kv_cache, block_table, seqused_k, kind=_SEQUSED_TOKENS, dense=None, context=None,
        softmax_scale=softmax_scale, softcap=softcap, out=out, return_lse=return_lse,
        names=("block_table", "seqused_k"), feedback=feedback,
    )


def paged_decode_attention_gated(
    q: Any,
    kv_cache: Any,
    visit_blocks: Any,
    visit_count: Any,
    block_table: Any,
    context_lens: Any,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    out: Any = None,
    return_lse: bool = False,
    feedback: FeedbackTarget | None = None,
) -> Any:
    """paged_decode_attention over one layer of epsd's outputs, read on the device.

    visit_blocks int32 [batch, max_blocks] or [batch, num_kv_heads, max_blocks] and
    visit_count int32 [batch] or [batch, num_kv_heads] (one layer's slice); a count of
    -1 attends densely over block_table int32 [batch, table_blocks] and context_lens
    int32 [batch] (tokens), which also give the partial last block's length.
    """
    import torch

    if not isinstance(q, torch.Tensor) or not q.is_cuda:
        raise ValueError("q must be a CUDA tensor")
    _check_tensor("block_table", block_table, q.device, torch.int32)
    _check_tensor("context_lens", context_lens, q.device, torch.int32)
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise ValueError(
            f"block_table must be [{q.shape[0]}, blocks], got {tuple(block_table.shape)}"
        )
    if tuple(context_lens.shape) != (q.shape[0],):
        raise ValueError(f"context_lens must be [{q.shape[0]}], got {tuple(context_lens.shape)}")
    return _run(
        q, kv_cache, visit_blocks, visit_count, kind=_VISIT_COUNT, dense=block_table,
        context=context_lens, softmax_scale=softmax_scale, softcap=softcap, out=out,
        return_lse=return_lse, names=("visit_blocks", "visit_count"), feedback=feedback,
    )
