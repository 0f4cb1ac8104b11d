"""eps_client.attention: library loading, shape checks and the float64 reference on the
CPU (CI, no torch needed); the GPU path against the reference where torch sees a device."""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

import numpy as np
import pytest

from eps_client import attention, attention_reference


def random_case(rng: np.random.Generator, batch: int = 3, q_heads: int = 8, kv_heads: int = 2,
                d: int = 64, keep: float = 0.5, per_head: bool = False):
    """A cache with blocks at random places, NaN wherever a correct reader never looks."""
    contexts = rng.integers(1, 600, size=batch)
    blocks = (contexts + 15) // 16
    width = int(blocks.max())
    num_blocks = int(blocks.sum()) + 3
    kv = np.full((2, num_blocks, 16, kv_heads, d), np.nan, dtype=np.float32)
    physical = rng.permutation(num_blocks)
    table = np.full((batch, width), -1, dtype=np.int32)
    heads = kv_heads if per_head else 1
    lists = np.full((batch, heads, width), -1, dtype=np.int32)
    lengths = np.zeros((batch, heads), dtype=np.int32)
    nxt = 0
    for b in range(batch):
        for j in range(blocks[b]):
            table[b, j] = physical[nxt]
            nxt += 1
            filled = min(16, contexts[b] - 16 * j)
            kv[:, table[b, j], :filled] = rng.uniform(-1, 1, (2, filled, kv_heads, d))
        last = contexts[b] - 16 * (blocks[b] - 1)
        for h in range(heads):
            chosen = [j for j in range(blocks[b] - 1) if rng.random() < keep] + [blocks[b] - 1]
            lists[b, h, : len(chosen)] = table[b, chosen]
            lengths[b, h] = 16 * (len(chosen) - 1) + last
    q = rng.uniform(-2, 2, (batch, q_heads, d)).astype(np.float32)
    if not per_head:
        lists, lengths = lists[:, 0], lengths[:, 0]
    return q, kv, lists, lengths, table, contexts.astype(np.int32)


def brute_force(q, kv, lists, lengths, scale, softcap=0.0):
    """One (row, query head) at a time, token by token: the definition, slowly."""
    batch, q_heads, d = q.shape
    kv_heads = kv.shape[3]
    out = np.zeros(q.shape)
    for b in range(batch):
        for qh in range(q_heads):
            h = qh // (q_heads // kv_heads)
            row = lists[b, h] if lists.ndim == 3 else lists[b]
            n = int(lengths[b, h] if lengths.ndim == 2 else lengths[b])
            scores, values = [], []
            for t in range(n):
                block, slot = int(row[t // 16]), t % 16
                s = float(np.dot(q[b, qh].astype(np.float64), kv[0, block, slot, h])) * scale
                if softcap > 0:
                    s = softcap * math.tanh(s / softcap)
                scores.append(s)
                values.append(kv[1, block, slot, h].astype(np.float64))
            w = np.exp(np.array(scores) - max(scores))
            out[b, qh] = (w[:, None] * np.array(values)).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("per_head", [False, True])
def test_reference_matches_the_definition_and_reads_only_listed_tokens(rng, per_head):
    q, kv, lists, lengths, _, _ = random_case(rng, per_head=per_head)
    out, lse = attention_reference.reference_numpy(q, kv, lists, lengths, softcap=3.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, brute_force(q, kv, lists, lengths, 1 / 8, 3.0), atol=1e-10)


def test_reference_visit_counts_and_dense_marker(rng):
    q, kv, lists, lengths, table, contexts = random_case(rng)
    counts = (lengths + 15) // 16
    counts[1] = -1  # epsd's "attend densely"
    gated, _ = attention_reference.reference_numpy(
        q, kv, lists, counts, length_kind=1, dense_table=table, context_lens=contexts)
    lists[1], lengths[1] = table[1], contexts[1]
    plain, _ = attention_reference.reference_numpy(q, kv, lists, lengths)
    np.testing.assert_array_equal(gated, plain)


def test_reference_refuses_an_empty_row(rng):
    q, kv, lists, lengths, _, _ = random_case(rng)
    lengths[2] = 0
    with pytest.raises(attention.AttentionListError, match="row 2 KV head 0: an empty list"):
        attention_reference.reference_numpy(q, kv, lists, lengths)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((2, 8, 64), (2, 10, 16, 2, 64), (2, 5), (2, 1)), r"seqused_k must be \[2\]"),
        (((2, 8, 64), (2, 10, 32, 2, 64), (2, 5), (2,)), r"kv_cache.shape\[2\]=32"),
        (((2, 8, 96), (2, 10, 16, 2, 96), (2, 5), (2,)), r"q.shape\[2\]=96"),
        (((2, 7, 64), (2, 10, 16, 2, 64), (2, 5), (2,)), r"q.shape\[1\]=7"),
        (((2, 8, 64), (2, 10, 16, 2, 128), (2, 5), (2,)), r"kv_cache.shape\[4\]=128"),
        (((2, 8, 64), (2, 10, 16, 2, 64), (3, 5), (2,)), r"block_table must be"),
        (((2, 8, 64), (2, 10, 16, 2, 64), (2, 4, 5), (2,)), r"block_table.shape\[1\]=4"),
        (((2, 8, 64), (1, 10, 16, 2, 64), (2, 5), (2,)), r"kv_cache must be"),
    ],
)
def test_shape_checks_name_the_tensor_and_dimension(shapes, message):
    with pytest.raises(ValueError, match=message):
        attention.check_shapes(*shapes)


def test_shape_checks_accept_union_and_per_head_lists():
    attention.check_shapes((2, 8, 128), (2, 10, 16, 2, 128), (2, 5), (2,))
    attention.check_shapes((2, 8, 128), (2, 10, 16, 2, 128), (2, 2, 5), (2, 2))


def test_library_path_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EPS_ATTENTION_LIB", str(tmp_path / "missing.so"))
    assert attention.library_candidates() == [tmp_path / "missing.so"]
    monkeypatch.setattr(attention, "_library", None)
    with pytest.raises(OSError, match="missing.so"):
        attention.load_library()


def test_library_search_looks_next_to_the_package_and_in_build_folders(monkeypatch):
    monkeypatch.delenv("EPS_ATTENTION_LIB", raising=False)
    found = attention.library_candidates()
    assert found[0] == Path(attention.__file__).resolve().parent / attention.LIBRARY_NAME
    assert all(p.name == attention.LIBRARY_NAME for p in found)


def _library_or_skip():
    try:
        return attention.load_library()
    except OSError as e:
        pytest.skip(f"libeps_attention.so not built here: {e}")


def test_loaded_library_agrees_on_the_params_layout():
    lib = _library_or_skip()
    assert lib.eps_attn_params_size() == ctypes.sizeof(attention._Params)
    assert lib.eps_attn_abi_version() == attention.ABI_VERSION


def _torch_cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _library_or_skip()
    return torch


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    ("d", "gqa", "per_head"), [(64, 1, False), (128, 4, True), (256, 8, False)]
)
def test_gpu_matches_the_reference(rng, dtype_name, d, gqa, per_head):
    torch = _torch_cuda_or_skip()
    dtype = getattr(torch, dtype_name)
    q, kv, lists, lengths, _, _ = random_case(
        rng, q_heads=2 * gqa, d=d, per_head=per_head)
    tq = torch.from_numpy(q).to("cuda", dtype)
    tkv = torch.from_numpy(kv).to("cuda", dtype)
    tl, tn = torch.from_numpy(lists).cuda(), torch.from_numpy(lengths).cuda()
    out, lse = attention.paged_decode_attention(tq, tkv, tl, tn, softcap=4.0, return_lse=True)
    ref, ref_lse = attention_reference.paged_decode_attention_reference(
        tq, tkv, tl, tn, softcap=4.0, return_lse=True)
    attention.check_attention_errors()
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_gpu_gated_takes_epsd_outputs_and_reports_empty_rows(rng):
    torch = _torch_cuda_or_skip()
    q, kv, lists, lengths, table, contexts = random_case(rng)
    counts = (lengths + 15) // 16
    counts[0] = -1
    t = {k: torch.from_numpy(v).cuda() for k, v in
         dict(lists=lists, counts=counts, table=table, contexts=contexts).items()}
    tq = torch.from_numpy(q).to("cuda", torch.bfloat16)
    tkv = torch.from_numpy(kv).to("cuda", torch.bfloat16)
    out = attention.paged_decode_attention_gated(
        tq, tkv, t["lists"], t["counts"], t["table"], t["contexts"])
    lists[0], lengths[0] = table[0], contexts[0]
    ref, _ = attention_reference.reference_numpy(q, kv, lists, lengths)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=2e-2, rtol=2e-2)
    attention.check_attention_errors()
    t["counts"][1] = 0
    out = attention.paged_decode_attention_gated(
        tq, tkv, t["lists"], t["counts"], t["table"], t["contexts"])
    # Both KV heads of row 1 read the empty union list; the first CTA to record is named.
    with pytest.raises(attention.AttentionListError, match="row 1 KV head [01]: .*empty list"):
        attention.check_attention_errors()
    assert torch.isfinite(out.float()).all() and (out[1] == 0).all()
    attention.check_attention_errors()  # cleared by the read


@pytest.mark.parametrize("group_blocks", [1, 3])
def test_gpu_feedback_is_each_groups_log_sum_exp(rng, group_blocks):
    """Selection feedback through FeedbackTarget: each visited group's log-sum-exp per
    query head at its table row, computed here from the data; other entries stay NaN."""
    torch = _torch_cuda_or_skip()
    q, kv, lists, lengths, table, contexts = random_case(rng, batch=3, q_heads=4, kv_heads=2)
    tq = torch.from_numpy(q).to("cuda", torch.float16)
    tkv = torch.from_numpy(kv).to("cuda", torch.float16)
    t = {k: torch.from_numpy(v).cuda() for k, v in
         dict(lists=lists, lengths=lengths, table=table, contexts=contexts).items()}
    num_blocks = kv.shape[1]
    positions = attention.block_positions(t["table"], t["contexts"], num_blocks)
    groups = -(-table.shape[1] // group_blocks)
    buffer = torch.full((5, 4, groups), float("nan"), device="cuda")
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    target = attention.FeedbackTarget(buffer, positions, group_blocks, rows)
    attention.paged_decode_attention(tq, tkv, t["lists"], t["lengths"], feedback=target)
    attention.check_attention_errors()
    got = buffer.cpu().numpy()
    qf, kf = tq.float().cpu().numpy(), tkv.float().cpu().numpy()
    expected = np.full(got.shape, np.nan)
    logical = {int(table[b, j]): j for b in range(3) for j in range(table.shape[1])
               if table[b, j] >= 0}
    for b, row in enumerate([4, 0, 2]):
        n = int(lengths[b])
        for t_ in range(n):
            block = int(lists[b, t_ // 16])
            group = logical[block] // group_blocks
            for qh in range(4):
                s = float(np.dot(qf[b, qh], kf[0, block, t_ % 16, qh // 2])) / math.sqrt(64)
                e = expected[row, qh, group]
                expected[row, qh, group] = s if np.isnan(e) else np.logaddexp(e, s)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(got, expected, atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="feedback.buffer must be"):
        attention.paged_decode_attention(
            tq, tkv, t["lists"], t["lengths"],
            feedback=attention.FeedbackTarget(buffer[:, :2], positions, group_blocks))


def test_gpu_refuses_mismatched_dtypes():
    torch = _torch_cuda_or_skip()
    q = torch.zeros(1, 8, 64, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(2, 4, 16, 2, 64, dtype=torch.float16, device="cuda")
    bt = torch.zeros(1, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="kv_cache.dtype"):
        attention.paged_decode_attention(q, kv, bt, bt[:, 0])


def test_module_imports_without_torch():
    # torch is imported only inside the functions that need it.
    source = Path(attention.__file__).read_text()
    assert "\nimport torch" not in source and os.path.basename(attention.__file__)
