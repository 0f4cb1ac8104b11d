"""The reference engine's attention timed alone, outside its decode loop: the breakdown's
attention column (epsd's kernel, every layer, with the current lists or dense) and PyTorch
SDPA's dense attention as its sanity check (docs/benchmarks/reference-engine.md)."""

from __future__ import annotations

from typing import Any

import torch
from engine_loop import PagedEngine

from eps_client import blocks_for
from eps_client.outputs import flash_attention_views


@torch.inference_mode()
def attention_ms(engine: PagedEngine, gated: bool, context: int, repeats: int = 10) -> float:
    """GPU time of one step's attention alone (every layer), with the current lists.

    The layers' launches are replayed as one CUDA graph, as the step runs them: 32 eager
    launches from Python time the host's launch rate instead of the kernels once a layer
    takes less than a launch (below about 80 us a layer; until 2026-11-28 this read
    higher at 12 % of the blocks than at 25 %). Eager where graphs are off or capture
    fails."""
    engine.ctx.fill_(context)
    if gated:
        flash_attention_views(engine.buffers.visit_blocks, engine.buffers.visit_count,
                              engine.table, engine.ctx, engine.bs,
                              out=(engine.view_table, engine.view_used))
    q = torch.randn(engine.B, engine.model.c.num_q_heads, engine.model.c.head_dim,
                    device=engine.device, dtype=engine.dtype)
    # With feedback, every repeat starts from NaN entries as a step does after epsd
    # consumed them (finite ones would send every write down the combining path);
    # the fill is timed alone and subtracted.
    fill = gated and engine.feedback_targets is not None

    def layers() -> None:
        if fill:
            engine.buffers.feedback.fill_(float("nan"))
        for layer in range(engine.model.c.num_layers):
            if gated:
                table, used = engine.view_table[layer, :, 0], engine.view_used[layer, :, 0]
            else:
                table, used = engine.table, engine.ctx
            engine.attend_layer(layer, q, table, used, gated)

    def fill_only() -> None:
        engine.buffers.feedback.fill_(float("nan"))

    ms = _gpu_ms(engine, layers, repeats)
    if fill:
        ms -= _gpu_ms(engine, fill_only, repeats)
    return ms


def _gpu_ms(engine: PagedEngine, work: Any, repeats: int) -> float:
    """GPU time of ``work`` (CUDA launches), mean of ``repeats`` after one warm-up:
    a captured graph's replays, or eager launches where graphs are off or fail."""
    run = work
    if engine.use_graphs:
        try:
            graph = engine.capture_graph(work)
            run = graph.replay
        except Exception as e:  # noqa: BLE001 - eager still measures something
            print(f"CUDA graph capture failed ({type(e).__name__}: {e}); timing eager "
                  "launches", flush=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(repeats + 1):
        if r == 1:
            start.record()
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


@torch.inference_mode()
def sdpa_attention_ms(engine: PagedEngine, context: int, repeats: int = 10) -> float:
    """PyTorch SDPA over one layer's K/V gathered contiguous, times the layers: the
    sanity check of the dense attention time (gathering excluded)."""
    c = engine.model.c
    nb = blocks_for(context, engine.bs)
    blocks = engine.table[:, :nb].long()
    k = engine.kv[0][0][blocks].flatten(1, 2)[:, :context].transpose(1, 2)  # [B, kvh, T, d]
    v = engine.kv[0][1][blocks].flatten(1, 2)[:, :context].transpose(1, 2)
    q = torch.randn(engine.B, c.num_q_heads, 1, c.head_dim, device=engine.device,
                    dtype=engine.dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        def call() -> Any:
            return sdpa(q, k, v, enable_gqa=True)
        call()
    except TypeError:  # torch without enable_gqa
        g = c.num_q_heads // c.num_kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

        def call() -> Any:
            return sdpa(q, k, v)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    call()
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats * c.num_layers
