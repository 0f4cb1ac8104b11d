"""The smallest correct engine loop with epsd (docs/integration/quickstart.md), on the CPU:
attach, write summaries when K is written, one select_pages per decode step, attention over
the listed blocks, dense on a fallback. numpy stands in for the engine's tensors.

    python3 integrate.py unix:///tmp/epsd.sock        (epsd --backend=cpu listening there)
"""

import sys

import numpy as np

from eps_client import (
    BufferShape,
    ClientOptions,
    EpsClient,
    ModelLayout,
    Row,
    SelectOptions,
    ShmBuffers,
    SummaryWriter,
)
from eps_client.outputs import flash_attention_views_reference as attention_views

L, H, QH, D, BS, PROMPT, STEPS = 2, 2, 4, 64, 16, 2048, 32
model = ModelLayout(num_layers=L, num_q_heads=QH, num_kv_heads=H, head_dim=D, kv_dtype="float32")
rng = np.random.default_rng(0)
kv = np.zeros((L, 2, 256, BS, H, D), np.float32)  # the engine's paged cache: 256 blocks of 16
CONTEXT = 4096  # tokens a sequence may reach; one summary slot per group of them
shape = BufferShape(num_slots=CONTEXT // model.group_tokens, max_seqs=1, max_context=CONTEXT,
                    max_batch=1)
with ShmBuffers(model, shape) as buf, EpsClient(
        buf, engine_id="integrate-example", select=SelectOptions(top_pages=4),
        options=ClientOptions(target=sys.argv[1])) as client:
    writer = SummaryWriter(model)
    writer.reset(buf.summary_pool)
    buf.block_table[0] = np.arange(buf.block_table.shape[1])  # logical block b is physical b
    buf.group_table[0] = np.arange(buf.group_table.shape[1])  # group p's summary is slot p
    def write_kv(layer: int, positions: np.ndarray) -> None:  # the model's K/V write + summaries
        k, v = rng.standard_normal((2, len(positions), H, D)).astype(np.float32)
        kv[layer, :, positions // BS, positions % BS] = np.stack([k, v], 1)
        writer.append(buf.summary_pool, layer, positions // model.group_tokens, k)
        buf.queries[layer, 0] = rng.standard_normal((QH, D))  # q: the next step's selection's

    for layer in range(L):
        write_kv(layer, np.arange(PROMPT))  # prefill
    client.attach()  # after the prefill, which may outlast a lease
    fallbacks = 0
    for pos in range(PROMPT, PROMPT + STEPS):  # decode: one call per step, before the model
        # lag-1: selected with the queries of the step before (the prefill's last, at first)
        result = client.select_pages(pos, [Row(table_row=0, context_tokens=pos + 1)])
        counts = buf.visit_count if result.ok else np.full_like(buf.visit_count, -1)
        fallbacks += result.fallback  # -1: attend densely over the engine's own table
        tables, used = attention_views(buf.visit_blocks, counts, buf.block_table[:1],
                                       np.array([pos + 1]), BS)
        for layer in range(L):  # this step's K/V and q, then attention over the listed blocks
            write_kv(layer, np.array([pos]))
            n = int(used[layer, 0, 0])
            k = kv[layer, 0, tables[layer, 0, 0, : -(-n // BS)]].reshape(-1, H, D)[:n]
            s = np.einsum("hgd,nhd->hgn", buf.queries[layer, 0].reshape(H, -1, D), k)
            p = np.exp(s - s.max(-1, keepdims=True))
    print(f"{STEPS} steps, {fallbacks} fallbacks, the last read {n} of {pos + 1} tokens")
