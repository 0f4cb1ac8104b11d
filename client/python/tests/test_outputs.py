"""Engine-ready outputs (eps_client.outputs) from visit lists that the real epsd wrote:
the FlashAttention views reproduce each list and its seqused_k, the fixed-budget FlashInfer
plan has exactly the room epsd's BUDGET_FIXED lists need, fallback lists become the
engine's rows; the torch/device versions equal the numpy reference (where torch runs)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from engine_state import MODEL, make_state

from eps_client import ClientOptions, SelectOptions, blocks_for, visited_tokens
from eps_client.outputs import (
    fixed_budget_blocks,
    fixed_budget_groups,
    fixed_budget_indptr,
    flash_attention_views,
    flash_attention_views_reference,
    flashinfer_fixed_budget,
    flashinfer_fixed_budget_reference,
)

BS, G = MODEL.block_size, MODEL.group_blocks


def engine_table(state) -> tuple[np.ndarray, np.ndarray]:
    """The engine's own rows by batch position, and the contexts."""
    rows = [r for r, _, _ in state.rows]
    return state.buffers.block_table[rows], np.array(state.contexts, dtype=np.int32)


def selected(epsd, rng, contexts, options=None):
    """A random engine state whose lists the real epsd selected (step 1, ``options``), its
    engine table (a copy) and contexts."""
    state = make_state(rng, contexts=contexts)
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
        client.attach()
        result = client.select_pages(1, state.rows, options)
        assert result.ok, result.message
    table, ctx = engine_table(state)
    return state, table.copy(), ctx


def test_flash_attention_views_reproduce_epsd_lists_and_dense_fallbacks(epsd, rng):
    state, table, ctx = selected(epsd, rng, [900, 517, 1000])
    buf = state.buffers
    count = buf.visit_count.copy()
    count[1, 2] = -1  # a list released densely
    block_table, seqused = flash_attention_views_reference(buf.visit_blocks, count, table, ctx,
                                                           BS)
    for layer in range(MODEL.num_layers):
        for b, c in enumerate(state.contexts):
            if count[layer, b] < 0:
                n = blocks_for(c, BS)
                np.testing.assert_array_equal(block_table[layer, b, 0, :n], table[b, :n])
                assert seqused[layer, b, 0] == c
                continue
            visits = buf.visits(layer, b)
            n = len(visits)
            assert n < blocks_for(c, BS)  # something was skipped
            np.testing.assert_array_equal(block_table[layer, b, 0, :n], visits)
            assert seqused[layer, b, 0] == visited_tokens(n, c, BS)
            # the kernel reads ceil(seqused / block_size) entries: exactly the list
            assert -(-int(seqused[layer, b, 0]) // BS) == n
    state.buffers.close()


def test_epsd_lists_reused_at_a_longer_context_gain_the_blocks_written_since(epsd, rng):
    """An engine that reuses a selection for later steps (docs/api.md, "Reusing a
    selection"): each list, selected when the rows were shorter, is followed by the blocks
    the row gained since, and seqused_k counts the grown context."""
    state, table, ctx = selected(epsd, rng, [900, 517, 1000])
    buf = state.buffers
    grown = ctx + np.array([3, 30, 20], dtype=np.int32)  # no new block, 2 new, 1 new
    for b in range(3):  # the engine's new blocks: ids no row holds yet
        old, new = blocks_for(int(ctx[b]), BS), blocks_for(int(grown[b]), BS)
        table[b, old:new] = NUM_NEW + 10 * b + np.arange(new - old)
    block_table, seqused = flash_attention_views_reference(buf.visit_blocks, buf.visit_count,
                                                           table, grown, BS)
    for layer in range(MODEL.num_layers):
        for b in range(3):
            old, new = blocks_for(int(ctx[b]), BS), blocks_for(int(grown[b]), BS)
            want = list(buf.visits(layer, b)) + list(table[b, old:new])
            np.testing.assert_array_equal(block_table[layer, b, 0, :len(want)], want)
            assert seqused[layer, b, 0] == visited_tokens(len(want), int(grown[b]), BS)
    state.buffers.close()


NUM_NEW = 1000  # block ids past the test state's cache: no row holds them


def test_a_reused_list_gains_only_what_its_row_can_say_it_lost():
    """By hand: the list's last block found among the row's newest 64 blocks extends it;
    found further back, not in the row, or with no room in the row, the list cannot be this
    sequence's (another position's, or too old): refused, the engine's row instead."""
    row = np.arange(100, 200, dtype=np.int32)[None]  # 100 blocks
    ctx = np.array([99 * BS + 5], dtype=np.int32)  # the row's 100th block holds 5 tokens

    refused = np.zeros(1, dtype=np.int64)

    def views(ids, count=None):
        vb = np.zeros((1, 1, 1, 100), dtype=np.int32)
        vb[0, 0, 0, :len(ids)] = ids
        vc = np.array([[[len(ids) if count is None else count]]], dtype=np.int32)
        bt, used = flash_attention_views_reference(vb, vc, row, ctx, BS, refused=refused)
        return list(bt[0, 0, 0, :used[0, 0, 0] // BS + 1]), int(used[0, 0, 0])

    dense = (list(range(100, 200)), 99 * BS + 5)

    got, used = views([100, 150, 195])  # selected when block 195 was the newest
    assert got == [100, 150, 195, 196, 197, 198, 199] and used == 6 * BS + 5
    got, used = views([100, 136])  # 63 blocks back: inside the window
    assert got == [100] + list(range(136, 200)) and used == 64 * BS + 5
    assert refused[0] == 0
    assert views([100, 135]) == dense  # 64 blocks back: outside the window
    assert views([100, 7]) == dense  # a last block the row does not hold
    # No room: a list of 99 blocks ending 2 blocks back would need 101 of the row's 100.
    assert views(list(range(100, 197)) + [150, 197]) == dense
    assert refused[0] == 3
    assert views([], count=-1) == dense and refused[0] == 3  # released densely: not refused


def test_an_empty_list_of_a_row_with_blocks_is_refused():
    """epsd writes no empty list for a row with tokens (a context < 1 is refused), so a count
    of 0 there is a list nobody wrote: a position that joined the batch after the selection
    whose lists the step reuses (zeroed buffers read count 0). It was taken as a list of no
    blocks: seqused_k 0, the row's every token (the newest too) unread, nothing refused; the
    fixed arrays counted it only because no plan has 0 entries for such a row."""
    table = np.array([[10, 11, 12], [20, 21, 22]], dtype=np.int32)
    ctx = np.array([2 * BS + 3, 0], dtype=np.int32)  # 3 blocks, and an empty row
    vb = np.zeros((1, 2, 1, 3), dtype=np.int32)
    vc = np.zeros((1, 2, 1), dtype=np.int32)  # both lists empty: as never written
    refused = np.zeros(1, dtype=np.int64)
    bt, used = flash_attention_views_reference(vb, vc, table, ctx, BS, refused=refused)
    np.testing.assert_array_equal(bt[0, 0, 0], table[0])  # the engine's row instead
    assert used[0, 0, 0] == 2 * BS + 3
    assert used[0, 1, 0] == 0  # the empty row's empty list is its list
    assert refused[0] == 1
    # A plan of no entries for the row (made at other contexts) is not filled by it either.
    _, _, mismatched = flashinfer_fixed_budget_reference(vb, vc, table, ctx, BS,
                                                         np.array([0, 0, 0], dtype=np.int32))
    assert mismatched == 1


@pytest.mark.parametrize("last_n", [1, 0])
def test_fixed_budget_plan_has_exactly_the_room_of_epsd_fixed_lists(epsd, rng, last_n):
    budget = SelectOptions(budget="fixed", first_n=1, last_n=last_n, top_pages=2)
    # last_n = 0 still keeps the newest group: k is 4 either way (first_n + last_n +
    # top_pages, the formula the docs once gave, planned one group too few).
    k = fixed_budget_groups(1, last_n, 2)
    assert k == 4
    state, table, ctx = selected(epsd, rng, [900, 517, 1000, 40], budget)
    buf = state.buffers
    indptr = fixed_budget_indptr(ctx, 1, k, G, BS)
    for layer in range(MODEL.num_layers):
        for b, c in enumerate(state.contexts):
            assert buf.visit_count[layer, b] == fixed_budget_blocks(c, k, G, BS), (layer, b, c)
    indices, last, mismatched = flashinfer_fixed_budget_reference(
        buf.visit_blocks, buf.visit_count, table, ctx, BS, indptr)
    assert mismatched == 0
    for layer in range(MODEL.num_layers):
        for b in range(len(state.contexts)):
            np.testing.assert_array_equal(indices[layer, indptr[b] : indptr[b + 1]],
                                          buf.visits(layer, b))
    np.testing.assert_array_equal(last, [c - (blocks_for(c, BS) - 1) * BS for c in ctx])
    # a dense release does not fit the plan: the newest blocks, counted
    count = buf.visit_count.copy()
    count[0, 0] = -1
    indices, _, mismatched = flashinfer_fixed_budget_reference(buf.visit_blocks, count, table,
                                                               ctx, BS, indptr)
    n = indptr[1] - indptr[0]
    blocks = blocks_for(state.contexts[0], BS)
    np.testing.assert_array_equal(indices[0, : indptr[1]], table[0, blocks - n : blocks])
    assert mismatched == 1
    state.buffers.close()


def test_epsd_fixed_lists_reused_fill_a_plan_made_with_the_selections_contexts(epsd, rng):
    """A fixed-budget step reused at longer contexts: planned with the selection's contexts,
    every list fills its plan with its blocks and the blocks written since; planned with the
    longer contexts alone, a list whose newest group was full no longer fits."""
    state, table, ctx = selected(epsd, rng, [900, 517, 1000, 40],
                                 SelectOptions(budget="fixed", first_n=1, last_n=1, top_pages=2))
    k = fixed_budget_groups(1, 1, 2)
    buf = state.buffers
    grown = ctx + np.array([20, 40, 20, 10], dtype=np.int32)  # 1, 2, 1 and 1 new blocks
    for b in range(len(ctx)):
        old, new = blocks_for(int(ctx[b]), BS), blocks_for(int(grown[b]), BS)
        table[b, old:new] = NUM_NEW + 10 * b + np.arange(new - old)
    indptr = fixed_budget_indptr(grown, 1, k, G, BS, selected_tokens=ctx)
    indices, _, mismatched = flashinfer_fixed_budget_reference(
        buf.visit_blocks, buf.visit_count, table, grown, BS, indptr)
    assert mismatched == 0
    for layer in range(MODEL.num_layers):
        for b in range(len(ctx)):
            old, new = blocks_for(int(ctx[b]), BS), blocks_for(int(grown[b]), BS)
            want = list(buf.visits(layer, b)) + list(table[b, old:new])
            np.testing.assert_array_equal(indices[layer, indptr[b] : indptr[b + 1]], want)
    # Planned at the longer contexts alone: 517 -> 557 tokens (33 -> 35 blocks, g = 2) starts
    # a new group, whose plan holds 7 entries where the list and its new blocks are 9; the
    # other rows stay in their newest group and fit either plan.
    alone = fixed_budget_indptr(grown, 1, k, G, BS)
    assert alone[2] - alone[1] == 7 and indptr[2] - indptr[1] == 9
    _, _, mismatched = flashinfer_fixed_budget_reference(
        buf.visit_blocks, buf.visit_count, table, grown, BS, alone)
    assert mismatched == MODEL.num_layers
    # Where torch and a device are, the kernel and the torch path give the same arrays.
    torch = _torch_on_a_device()
    for use_kernel in (False, True) if torch is not None else ():
        d = [torch.from_numpy(np.ascontiguousarray(a)).cuda()
             for a in (buf.visit_blocks, buf.visit_count, table, grown, indptr)]
        got_i, _, got_m = flashinfer_fixed_budget(*d[:4], BS, d[4], nnz=int(indptr[-1]),
                                                  use_kernel=use_kernel)
        np.testing.assert_array_equal(got_i.cpu().numpy(), indices)
        assert int(got_m.item()) == 0
    state.buffers.close()


def _torch_on_a_device():
    """torch, when it is installed and sees a CUDA device; else None (the numpy checks run)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def test_a_plan_for_reused_lists_counts_the_blocks_written_since():
    # By hand, as client/cpp's test: k = 2 groups of g = 2 blocks of 16 tokens; selected at
    # 60 tokens (4 blocks), now 100 (7): 4 + 3 entries, where 100 alone plans 2 + 1.
    np.testing.assert_array_equal(fixed_budget_indptr([100, 40], 1, 2, 2, 16, [60, 40]),
                                  [0, 7, 10])
    np.testing.assert_array_equal(fixed_budget_indptr([100, 40], 1, 2, 2, 16), [0, 3, 6])
    with pytest.raises(ValueError, match=r"selected_tokens\[0\]=101 exceeds "
                                         r"context_tokens\[0\]=100"):
        fixed_budget_indptr([100], 1, 2, 2, 16, [101])
    with pytest.raises(ValueError, match="selected_tokens has 1 entries, context_tokens 2"):
        fixed_budget_indptr([100, 40], 1, 2, 2, 16, [60])


def test_fixed_budget_groups_counts_the_newest_group_and_refuses_bad_counts():
    assert fixed_budget_groups(1, 2, 8) == 11
    assert fixed_budget_groups(0, 0, 8) == 9  # the newest group is always kept
    for args in ((-1, 2, 8), (1, -2, 8), (1, 2, 0), (1.5, 2, 8)):
        with pytest.raises((ValueError, TypeError)):
            fixed_budget_groups(*args)


def test_fixed_budget_blocks_by_hand():
    # 16-token blocks, g = 4: 1000 tokens = 63 blocks = 16 groups, the newest 3 blocks long
    assert fixed_budget_blocks(1000, 3, 4, 16) == 2 * 4 + 3
    assert fixed_budget_blocks(1000, 16, 4, 16) == 63
    assert fixed_budget_blocks(1, 3, 4, 16) == 1
    np.testing.assert_array_equal(fixed_budget_indptr([1000, 1], 2, 3, 4, 16), [0, 11, 22, 23, 24])


def test_references_stay_inside_the_engine_rows_whatever_the_data():
    # Two positions: a context longer than the table's 4-block rows, and an empty one.
    table = np.array([[10, 11, 12, 13], [20, 21, 22, 23]], dtype=np.int32)
    ctx = np.array([5 * BS + 3, 0], dtype=np.int32)
    vb = np.array([[[10, 12, 13, 0]], [[0, 0, 0, 0]]], dtype=np.int32)[None]  # [1, 2, 1, 4]
    vc = np.array([[[3], [1]]], dtype=np.int32)  # the empty row cannot hold one block
    refused = np.zeros(1, dtype=np.int64)
    bt, used = flash_attention_views_reference(vb, vc, table, ctx, BS, refused=refused)
    np.testing.assert_array_equal(bt[0, 0, 0, :3], [10, 12, 13])
    assert used[0, 0, 0] == 3 * BS  # the row is cut to its 4 full blocks
    assert used[0, 1, 0] == 0 and refused[0] == 1  # the empty row: nothing to read
    # With the cache's size given, a list naming a block outside it is refused.
    vb[0, 0, 0, 1] = 500
    bt, used = flash_attention_views_reference(vb, vc, table, ctx, BS, cache_blocks=100,
                                               refused=refused)
    np.testing.assert_array_equal(bt[0, 0, 0], table[0])
    assert used[0, 0, 0] == 4 * BS and refused[0] == 3
    # An engine table wider than the lists' rows is refused, as the kernel refuses it (the
    # reference crashed on a broadcast; the torch path kept each row's oldest blocks).
    wide = np.concatenate([table, table[:, :1]], axis=1)  # 5 columns, max_blocks 4
    with pytest.raises(ValueError, match="engine table width 5 exceeds the visit lists' "
                                         "max_blocks=4"):
        flash_attention_views_reference(vb, vc, wide, ctx, BS)
    # A plan with more room than a row holds repeats the row's oldest block; an entry past
    # nnz is skipped; both are counted.
    assert fixed_budget_blocks(0, 3, G, BS) == 0 and fixed_budget_blocks(-5, 3, G, BS) == 0
    indptr = np.array([0, 6, 6], dtype=np.int32)
    ind, last, mismatched = flashinfer_fixed_budget_reference(vb, vc, table, ctx, BS, indptr)
    np.testing.assert_array_equal(ind[0], [10, 10, 10, 11, 12, 13])
    np.testing.assert_array_equal(last, [BS, 0])
    assert mismatched == 2  # count 3 in a plan of 6; a block listed for an empty row
    vc[0, 1, 0] = 0
    ind, _, mismatched = flashinfer_fixed_budget_reference(vb, vc, table, ctx, BS,
                                                           np.array([0, 7, 6], dtype=np.int32))
    assert mismatched == 2  # an entry past nnz = 6, one that ends before it begins


def random_lists(rng, L=3, max_batch=5, B=4, lists=1, max_blocks=40):
    """Random lists, some dense, malformed or naming blocks outside a 10**5-block cache, over
    contexts some empty, negative or longer than the table's rows."""
    ctx = rng.integers(1, max_blocks * BS + 1, size=B).astype(np.int32)
    ctx[rng.random(B) < 0.1] = -1
    ctx[rng.random(B) < 0.1] = 0
    ctx[rng.random(B) < 0.1] = max_blocks * BS + 77
    table = rng.integers(0, 10**5, size=(B, max_blocks)).astype(np.int32)
    vb = rng.integers(0, 10**5, size=(L, max_batch, lists, max_blocks)).astype(np.int32)
    vb[rng.random(vb.shape) < 0.01] = 10**5 + 3
    vc = np.zeros((L, max_batch, lists), dtype=np.int32)
    for layer in range(L):
        for b in range(B):
            blocks = min(blocks_for(max(int(ctx[b]), 0), BS), max_blocks)
            for h in range(lists):
                vc[layer, b, h] = rng.choice([-1, blocks + 1, rng.integers(0, blocks + 1)])
                if blocks and rng.random() < 0.4:  # epsd's shape, maybe selected earlier
                    end = blocks - 1 - int(rng.integers(0, min(blocks, 80)))
                    ids = table[b, :end][rng.random(end) < 0.3].tolist() + [table[b, end]]
                    vb[layer, b, h, :len(ids)] = ids
                    vc[layer, b, h] = len(ids)
    return vb, vc, table, ctx


@pytest.mark.parametrize("lists", [1, 2])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_torch_views_and_arrays_equal_the_reference(rng, lists, use_kernel):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if use_kernel:
        from eps_client.engine import library

        library()  # the kernel path needs libeps_engine; fail loudly if it is missing
    from eps_client.outputs import flash_attention_views, flashinfer_fixed_budget

    for trial in range(10):  # rows of 40 blocks, or 100: reused lists past the window
        vb, vc, table, ctx = random_lists(rng, lists=lists, max_blocks=100 if trial > 5 else 40)
        cache = 10**5 if trial % 2 else 0  # checked, then trusted
        d = {k: torch.from_numpy(v).cuda() for k, v in
             dict(vb=vb, vc=vc, table=table, ctx=ctx).items()}
        refused = torch.full((1,), 5, dtype=torch.int32, device="cuda")
        got_t, got_u = flash_attention_views(d["vb"], d["vc"], d["table"], d["ctx"], BS,
                                             cache_blocks=cache, refused=refused,
                                             use_kernel=use_kernel)
        want_refused = np.full(1, 5)
        want_t, want_u = flash_attention_views_reference(vb, vc, table, ctx, BS, cache,
                                                         refused=want_refused)
        np.testing.assert_array_equal(got_u.cpu().numpy(), want_u)
        assert int(refused.item()) == want_refused[0]
        valid = want_t >= 0
        np.testing.assert_array_equal(got_t.cpu().numpy()[valid], want_t[valid])
        indptr = fixed_budget_indptr(ctx, lists, 3, G, BS)
        got_i, got_l, got_m = flashinfer_fixed_budget(
            d["vb"], d["vc"], d["table"], d["ctx"], BS, torch.from_numpy(indptr).cuda(),
            cache_blocks=cache, use_kernel=use_kernel)
        want_i, want_l, want_m = flashinfer_fixed_budget_reference(vb, vc, table, ctx, BS,
                                                                   indptr, cache)
        np.testing.assert_array_equal(got_i.cpu().numpy(), want_i)
        np.testing.assert_array_equal(got_l.cpu().numpy(), want_l)
        assert int(got_m.item()) == want_m


def _cuda_torch(use_kernel):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if use_kernel:
        from eps_client.engine import library

        library()
    return torch


@pytest.mark.parametrize("use_kernel", [False, True])
def test_slices_int64_contexts_and_column_views_read_as_the_reference(rng, use_kernel):
    """The kernel path read raw pointers: a slice of the lists' batch, int64 contexts or a
    column view of a wider engine table were read with the wrong strides."""
    torch = _cuda_torch(use_kernel)
    from eps_client.outputs import flash_attention_views, flashinfer_fixed_budget

    vb, vc, table, ctx = random_lists(rng, max_batch=6, B=3, lists=2)
    wide = np.concatenate([table, rng.integers(0, 10**5, size=(3, 7)).astype(np.int32)], 1)
    want_t, want_u = flash_attention_views_reference(vb[:, :3], vc[:, :3], table, ctx, BS)
    d_vb = torch.from_numpy(vb).cuda()[:, :3]
    d_vc = torch.from_numpy(vc).cuda()[:, :3]
    d_table = torch.from_numpy(wide).cuda()[:, :table.shape[1]]
    d_ctx = torch.from_numpy(ctx.astype(np.int64)).cuda()
    got_t, got_u = flash_attention_views(d_vb, d_vc, d_table, d_ctx, BS, use_kernel=use_kernel)
    np.testing.assert_array_equal(got_u.cpu().numpy(), want_u)
    valid = want_t >= 0
    np.testing.assert_array_equal(got_t.cpu().numpy()[valid], want_t[valid])
    indptr = fixed_budget_indptr(ctx, 2, 3, G, BS)
    want_i, want_l, want_m = flashinfer_fixed_budget_reference(vb[:, :3], vc[:, :3], table,
                                                               ctx, BS, indptr)
    got_i, got_l, got_m = flashinfer_fixed_budget(d_vb, d_vc, d_table, d_ctx, BS,
                                                  torch.from_numpy(indptr).cuda(),
                                                  nnz=int(indptr[-1]), use_kernel=use_kernel)
    np.testing.assert_array_equal(got_i.cpu().numpy(), want_i)
    np.testing.assert_array_equal(got_l.cpu().numpy(), want_l)
    assert int(got_m.item()) == want_m


@pytest.mark.parametrize("use_kernel", [False, True])
def test_an_engine_table_of_more_rows_than_positions_reads_as_the_reference(rng, use_kernel):
    """An engine's table sized for its largest batch: the torch views failed on its extra
    rows (a copy into a [batch, max_blocks] tensor); the kernel always took it."""
    torch = _cuda_torch(use_kernel)
    from eps_client.outputs import flash_attention_views, flashinfer_fixed_budget

    vb, vc, table, ctx = random_lists(rng, max_batch=5, B=3, lists=2)
    tall = np.concatenate([table, rng.integers(0, 10**5, size=(2, table.shape[1]))
                           .astype(np.int32)])
    want_t, want_u = flash_attention_views_reference(vb, vc, tall, ctx, BS)
    d = [torch.from_numpy(a).cuda() for a in (vb, vc, tall, ctx)]
    got_t, got_u = flash_attention_views(*d, BS, use_kernel=use_kernel)
    np.testing.assert_array_equal(got_u.cpu().numpy(), want_u)
    valid = want_t >= 0
    np.testing.assert_array_equal(got_t.cpu().numpy()[valid], want_t[valid])
    indptr = fixed_budget_indptr(ctx, 2, 3, G, BS)
    want_i, _, want_m = flashinfer_fixed_budget_reference(vb, vc, tall, ctx, BS, indptr)
    got_i, _, got_m = flashinfer_fixed_budget(*d, BS, torch.from_numpy(indptr).cuda(),
                                              nnz=int(indptr[-1]), use_kernel=use_kernel)
    np.testing.assert_array_equal(got_i.cpu().numpy(), want_i)
    assert int(got_m.item()) == want_m


@pytest.mark.parametrize("use_kernel", [False, True])
def test_outputs_the_kernels_cannot_write_are_refused(rng, use_kernel):
    """An out= view of a larger buffer (a CUDA graph's, sized for the largest batch) was
    written as if compact: the rows of every layer after the first landed elsewhere."""
    torch = _cuda_torch(use_kernel)
    from eps_client.outputs import flash_attention_views

    vb, vc, table, ctx = (torch.from_numpy(a).cuda() for a in random_lists(rng, B=3))
    big_t = torch.zeros(3, 5, 1, 40, dtype=torch.int32, device="cuda")
    big_u = torch.zeros(3, 5, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="out\\[0\\].*contiguous int32 tensor of shape"):
        flash_attention_views(vb, vc, table, ctx, BS, out=(big_t[:, :3], big_u[:, :3]),
                              use_kernel=use_kernel)
    with pytest.raises(ValueError, match="out\\[1\\]"):
        flash_attention_views(vb, vc, table, ctx, BS, out=(big_t[:, :3].contiguous(),
                                                           big_u[:, :3].long()),
                              use_kernel=use_kernel)
    assert not big_t.any() and not big_u.any()


@pytest.mark.parametrize("use_kernel", [False, True])
def test_a_fixed_budget_call_with_its_nnz_is_captured_in_a_cuda_graph(rng, use_kernel):
    """With the plan's nnz from the host the call never synchronises (it read indptr[-1]
    with .item(), which a graph capture refuses and which waited for the engine's stream)."""
    torch = _cuda_torch(use_kernel)
    from eps_client.outputs import flashinfer_fixed_budget

    if not use_kernel:
        pytest.skip("the torch path checks the plan on the host")
    vb, vc, table, ctx = random_lists(rng, lists=2)
    indptr = fixed_budget_indptr(ctx, 2, 3, G, BS)
    d = [torch.from_numpy(a).cuda() for a in (vb, vc, table, ctx, indptr)]
    args = (d[0], d[1], d[2], d[3], BS, d[4])
    flashinfer_fixed_budget(*args, nnz=int(indptr[-1]), use_kernel=True)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_i, got_l, got_m = flashinfer_fixed_budget(*args, nnz=int(indptr[-1]),
                                                      use_kernel=True)
    graph.replay()
    torch.cuda.synchronize()
    want_i, want_l, want_m = flashinfer_fixed_budget_reference(vb, vc, table, ctx, BS, indptr)
    np.testing.assert_array_equal(got_i.cpu().numpy(), want_i)
    assert int(got_m.item()) == want_m


def test_the_torch_path_stays_inside_the_lists_for_a_plan_longer_than_them(rng):
    """A plan entry longer than max_blocks (a budget planned for a longer context) gathered
    past the lists before discarding: a device-side assert that ends the CUDA context."""
    torch = _cuda_torch(False)
    from eps_client.outputs import flashinfer_fixed_budget

    vb, vc, table, ctx = random_lists(rng, max_blocks=8)
    ctx[:] = 8 * BS
    indptr = np.array([0, 12, 24, 36, 48], dtype=np.int32)  # 12 blocks a list, 8 at most
    want_i, _, want_m = flashinfer_fixed_budget_reference(vb, vc, table, ctx, BS, indptr)
    d = [torch.from_numpy(a).cuda() for a in (vb, vc, table, ctx, indptr)]
    got_i, _, got_m = flashinfer_fixed_budget(*d[:4], BS, d[4], use_kernel=False)
    np.testing.assert_array_equal(got_i.cpu().numpy(), want_i)
    assert int(got_m.item()) == want_m == 4 * 3


@pytest.mark.parametrize(("budget_groups", "group_blocks", "block_size", "name"), [
    (0, 2, 16, "budget_groups=0"), (-1, 2, 16, "budget_groups=-1"),
    (4, 0, 16, "group_blocks=0"), (4, 2, 0, "block_size=0"), (4, 2, -16, "block_size=-16"),
])
def test_a_fixed_budget_plan_needs_positive_sizes(budget_groups, group_blocks, block_size,
                                                  name):
    with pytest.raises(ValueError, match=f"{name} must be >= 1"):
        fixed_budget_blocks(100, budget_groups, group_blocks, block_size)
    with pytest.raises(ValueError, match=f"{name} must be >= 1"):
        fixed_budget_indptr([100, 40], 1, budget_groups, group_blocks, block_size)


def test_block_counts_and_seqused_follow_core_on_empty_and_negative_contexts():
    # core/layout.h BlocksFor and core/visit_list.h VisitedTokens (a division that truncates
    # toward zero); Python's floor division gave -1 blocks for -16 tokens and one block too
    # many tokens for a list over an empty context.
    assert [blocks_for(t, 16) for t in (-16, -1, 0, 1, 16, 17)] == [0, 0, 0, 1, 1, 2]
    assert visited_tokens(3, 0, 16) == 32  # (3 - 1) * 16 + an empty last block
    assert visited_tokens(3, 17, 16) == 33 and visited_tokens(3, 32, 16) == 48
    assert visited_tokens(0, 100, 16) == 0 and visited_tokens(1, 5, 16) == 5


def _refused_by_every_path(vb, vc, table, ctx, block_size, indptr, nnz, error, message,
                           **sizes):
    """The four entry points (views and fixed arrays, each with its numpy reference) all raise
    ``error`` with ``message`` before any path runs."""
    for call in (lambda: flash_attention_views(vb, vc, table, ctx, block_size, **sizes),
                 lambda: flashinfer_fixed_budget(vb, vc, table, ctx, block_size, indptr,
                                                 nnz=nnz, **sizes),
                 lambda: flash_attention_views_reference(vb, vc, table, ctx, block_size,
                                                         **sizes),
                 lambda: flashinfer_fixed_budget_reference(vb, vc, table, ctx, block_size,
                                                           indptr, **sizes)):
        with pytest.raises(error, match=re.escape(message)):
            call()


@pytest.mark.parametrize("batch", [0, 2, 3])
def test_a_batch_outside_the_lists_rows_is_refused_before_a_path_is_chosen(batch):
    # With max_batch = 1 the torch path broadcast row 0's lists to every position of a
    # larger batch, silently (the kernel refused it). Numpy inputs: the check comes before
    # torch is imported, so it runs where torch does not.
    vb = np.zeros((2, 1, 4), dtype=np.int32)  # [layers, max_batch = 1, max_blocks]
    vc = np.full((2, 1), -1, dtype=np.int32)
    table = np.zeros((max(batch, 1), 4), dtype=np.int32)
    ctx = np.full(batch, 16, dtype=np.int32)
    indptr = np.zeros(batch + 1, dtype=np.int32)
    message = f"batch={batch} is not in [1, max_batch=1]"
    _refused_by_every_path(vb, vc, table, ctx, BS, indptr, 0, ValueError, message)


@pytest.mark.parametrize("shape", [(1, 4), (4,)])
def test_an_engine_table_without_a_row_for_every_position_is_refused_before_a_path(shape):
    """The kernel reads a row per position. The torch views broadcast a one-row table to
    every position (row 0's blocks, another sequence's, became each position's dense row,
    and each reused list was looked for in it), the torch arrays failed on the device and
    the references on an index. Numpy inputs: the check runs where torch does not."""
    vb = np.zeros((1, 2, 4), dtype=np.int32)  # [layers, max_batch = 2, max_blocks]
    vc = np.full((1, 2), -1, dtype=np.int32)
    ctx = np.full(2, 16, dtype=np.int32)
    indptr = np.array([0, 1, 2], dtype=np.int32)
    table = np.zeros(shape, dtype=np.int32)
    message = f"engine_table must be [>= 2 rows, blocks]; got {shape}"
    _refused_by_every_path(vb, vc, table, ctx, BS, indptr, 2, ValueError, message)
    # More rows than positions (an engine's table for its largest batch) are fine.
    bt, used = flash_attention_views_reference(vb, vc, np.arange(12, dtype=np.int32)
                                               .reshape(3, 4), ctx, BS)
    assert bt[0, :, 0, 0].tolist() == [0, 4] and used[0, :, 0].tolist() == [16, 16]


@pytest.mark.parametrize(("block_size", "cache_blocks", "error", "message"), [
    (0, 0, ValueError, "block_size=0 is not in [1, 2147483647]"),
    ((1 << 32) + 16, 0, ValueError, "block_size=4294967312 is not in [1, 2147483647]"),
    (16.0, 0, TypeError, "block_size=16.0 is not an integer"),
    (16, 1 << 63, ValueError, "cache_blocks=9223372036854775808 is not in"),
])
def test_a_block_size_or_cache_size_the_c_abi_cannot_take_is_refused_before_a_path(
        block_size, cache_blocks, error, message):
    """libeps_engine takes an int32 block size and an int64 cache size: 2**32 + 16 wrapped to
    16 in the call, and 0 divided by zero in the torch and numpy paths."""
    vb = np.zeros((1, 1, 4), dtype=np.int32)
    vc = np.full((1, 1), -1, dtype=np.int32)
    table = np.zeros((1, 4), dtype=np.int32)
    ctx = np.full(1, 16, dtype=np.int32)
    indptr = np.array([0, 1], dtype=np.int32)
    _refused_by_every_path(vb, vc, table, ctx, block_size, indptr, 1, error, message,
                           cache_blocks=cache_blocks)


@pytest.mark.parametrize(("args", "error", "message"), [
    # lists <= 0 gave a plan of no entries for any batch
    (([100, 40], 0, 3, G, BS), ValueError, "lists=0 not in [1, 2147483647]"),
    (([100, 40], -2, 3, G, BS), ValueError, "lists=-2 not in [1, 2147483647]"),
    (([100, 40], 2**31, 3, G, BS), ValueError, "lists=2147483648 not in [1, 2147483647]"),
    (([100, 40], 1.0, 3, G, BS), TypeError, "lists=1.0 is not an integer"),
    # 100.9 tokens was planned as 100
    (([100.9, 50.2], 1, 3, G, BS), TypeError, "context_tokens must be integers, got dtype float64"),
    # past 2**31 - 1 entries the int32 plan wrapped negative
    (([2**40], 1, 2**30, 4, 16), ValueError, "the plan exceeds 2^31-1 entries at context_tokens"),
    (([100], 1, 2**31, 4, 16), ValueError, "budget_groups=2147483648 exceeds int32"),
])
def test_a_fixed_budget_plan_refuses_what_the_cpp_plan_refuses(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        fixed_budget_indptr(*args)


def test_a_fixed_budget_list_of_a_fractional_context_is_refused():
    with pytest.raises(TypeError, match="context_tokens=100.9 is not an integer"):
        fixed_budget_blocks(100.9, 3, G, BS)  # type: ignore[arg-type]
    assert fixed_budget_blocks(np.int32(100), 3, G, BS) == fixed_budget_blocks(100, 3, G, BS)
