"""A small random engine state in ShmBuffers: keys with structure, summaries from the
numpy writer, shuffled slots and physical blocks, queries; shared by the client tests."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eps_client import (
    BufferShape,
    ClientOptions,
    EpsClient,
    ModelLayout,
    SelectOptions,
    ShmBuffers,
    SummaryWriter,
    blocks_for,
    groups_for,
)
from eps_client.layout import coarse_group_of, coarse_groups_for
from eps_client.proto import page_selector_pb2 as pb
from eps_client.requests import attach_request

MODEL = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                    group_blocks=2, sketch_dim=8, phi_seed=1234)
OPTIONS = SelectOptions(method="jl", alpha=1.0, first_n=1, last_n=1, top_pages=3, strict=False,
                        heads="all", budget="threshold", granularity="union")
NUM_KV_BLOCKS = 512


@dataclass
class EngineState:
    buffers: ShmBuffers
    contexts: list[int]
    rows: list[tuple[int, int, int]]  # (table_row, context_tokens, seq_id)
    select: SelectOptions = OPTIONS

    def client(self, options: ClientOptions, engine_id: str = "pytest-engine") -> EpsClient:
        return EpsClient(self.buffers, engine_id=engine_id, num_kv_blocks=NUM_KV_BLOCKS,
                         select=self.select, options=options)

    def attach(self, engine_id: str = "pytest-engine") -> pb.AttachRequest:
        """The AttachRequest such a client sends (for the core/ reference tool)."""
        return attach_request(self.buffers, engine_id=engine_id, num_kv_blocks=NUM_KV_BLOCKS,
                              select=self.select)

    def new_queries(self, rng: np.random.Generator) -> None:
        self.buffers.queries[...] = rng.standard_normal(self.buffers.queries.shape)


def make_state(rng: np.random.Generator, contexts: list[int], max_context: int = 1024,
               model: ModelLayout = MODEL, select: SelectOptions = OPTIONS,
               with_feedback: bool = False, per_kv_head: bool = False) -> EngineState:
    """With ``model.coarse_blocks`` > 0, the coarse records of the same keys too; with
    ``with_feedback`` the (NaN) selection-feedback buffer; with ``per_kv_head`` visit lists
    per KV head."""
    MODEL = model  # noqa: N806 - the module's model unless the test brings its own
    max_groups = groups_for(max_context, MODEL)
    max_coarse = coarse_groups_for(max_context, MODEL)
    shape = BufferShape(num_slots=len(contexts) * max_groups, max_seqs=len(contexts) + 1,
                        max_context=max_context, max_batch=len(contexts),
                        coarse_slots=len(contexts) * max_coarse, with_feedback=with_feedback,
                        per_kv_head=per_kv_head)
    buf = ShmBuffers(MODEL, shape, tag="pytest")
    writer = SummaryWriter(MODEL)
    writer.reset(buf.summary_pool)
    if buf.coarse_pool is not None:
        writer.reset(buf.coarse_pool)
    free_coarse = list(rng.permutation(shape.coarse_slots))
    free_slots = list(rng.permutation(shape.num_slots))
    free_blocks = list(rng.permutation(NUM_KV_BLOCKS))
    rows = []
    for b, ctx in enumerate(contexts):
        table_row = b + 1  # row 0 stays unused: rows need not match batch positions
        groups = groups_for(ctx, MODEL)
        slots = [int(free_slots.pop()) for _ in range(groups)]
        buf.group_table[table_row, :groups] = slots
        buf.block_table[table_row, : blocks_for(ctx, MODEL.block_size)] = [
            int(free_blocks.pop()) for _ in range(blocks_for(ctx, MODEL.block_size))]
        token_slots = np.array(slots)[np.arange(ctx) // MODEL.group_tokens]
        coarse: dict[str, np.ndarray] = {}
        if buf.coarse_table is not None:
            n_coarse = coarse_groups_for(ctx, MODEL)
            coarse_slots = [int(free_coarse.pop()) for _ in range(n_coarse)]
            buf.coarse_table[table_row, :n_coarse] = coarse_slots
            coarse = {"coarse_pool": buf.coarse_pool,
                      "coarse_slots": np.array(coarse_slots)[
                          coarse_group_of(np.arange(ctx), MODEL)]}
        for layer in range(MODEL.num_layers):
            keys = rng.standard_normal((ctx, MODEL.num_kv_heads, MODEL.head_dim)).astype(np.float32)
            # a few groups carry a strong shared direction, so scores differ between groups
            hot = rng.choice(groups, size=max(1, groups // 4), replace=False)
            direction = rng.standard_normal(MODEL.head_dim).astype(np.float32) * 4
            for g in hot:
                keys[g * MODEL.group_tokens : (g + 1) * MODEL.group_tokens] += direction
            writer.append(buf.summary_pool, layer, token_slots, keys, **coarse)
        rows.append((table_row, ctx, 100 + b))
    state = EngineState(buf, contexts, rows, select)
    state.new_queries(rng)
    return state


def core_visits(tool: str, tmp: Path, state: EngineState,
                attach: pb.AttachRequest) -> tuple[np.ndarray, np.ndarray]:
    """visit_blocks and visit_count as core/'s reference step computes them."""
    (tmp / "attach.bin").write_bytes(attach.SerializeToString())
    rows = ",".join(f"{r}:{c}" for r, c, _ in state.rows)
    subprocess.run([tool, "select", str(tmp / "attach.bin"), rows, str(tmp / "visits.bin")],
                   check=True)
    raw = np.fromfile(tmp / "visits.bin", dtype=np.int32)
    buf = state.buffers
    n_visit = buf.visit_blocks.size
    return raw[:n_visit].reshape(buf.visit_blocks.shape), raw[n_visit:].reshape(
        buf.visit_count.shape)
