"""Sparse paged decode attention on the GPU: µs per layer and GB/s of KV bytes read,
next to a device-to-device copy and PyTorch's SDPA (flash backend) over a contiguous
cache of the same tokens. Results: docs/benchmarks/attention.md.

Run on a machine with a CUDA device, torch and libeps_attention.so:
  EPS_ATTENTION_LIB=build/gpu/attention/libeps_attention.so \
  PYTHONPATH=client/python/src python3 bench/attention_bench.py [--quick]

Every call runs inside a CUDA graph of `layers` calls (each over its own copy of the
cache, so the L2 holds none of it between calls), replayed several times: the times
are GPU times per layer, without Python's launch cost.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location(
    "eps_attention", HERE.parent / "client/python/src/eps_client/attention.py"
)
assert spec and spec.loader
attention = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = attention  # its dataclasses look their module up there
spec.loader.exec_module(attention)

Q_HEADS, KV_HEADS, D, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
L2_FLUSH_BYTES = 256 << 20  # caches per configuration at least this large in total


def graph_time_us(fn, calls: int, replays: int = 5) -> float:
    """GPU µs per call of fn(i) for i in range(calls), captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up (and allocations) outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (replays * calls)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: GB/s counting bytes read and written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = graph_time_us(lambda i: dst.copy_(src), 4)
    return 2 * n / us / 1e3


def visit_lists(table: torch.Tensor, share: float, gen: torch.Generator) -> tuple:
    """Random subsets of each row's blocks (the last one always), in logical order."""
    batch, blocks = table.shape
    keep = max(1, round(share * blocks))
    if keep == blocks:
        return table, blocks
    lists = torch.empty(batch, keep, dtype=torch.int32)
    for b in range(batch):
        chosen = torch.randperm(blocks - 1, generator=gen)[: keep - 1].sort().values
        lists[b, :-1] = table[b, chosen]
        lists[b, -1] = table[b, -1]
    return lists, keep


def feedback_target(tables: torch.Tensor, batch: int, blocks: int, group_blocks: int = 2):
    """Selection feedback into one buffer shared by the layers (timing only): every
    block's position from the layers' tables, `group_blocks` blocks a group."""
    positions = torch.full((tables.numel(),), -1, dtype=torch.int32)
    rows = tables.reshape(-1, blocks).long()
    positions[rows] = torch.arange(blocks, dtype=torch.int32)[None].expand(rows.shape[0], -1)
    buffer = torch.full((batch, Q_HEADS, -(-blocks // group_blocks)), float("nan"),
                        device="cuda")
    return attention.FeedbackTarget(buffer, positions.cuda(), group_blocks)


def run_config(batch: int, context: int, shares: list[float], copy_gbs: float, rows: list,
               feedback: tuple[int, ...] = ()) -> None:
    blocks = context // BLOCK
    kv_bytes_dense = batch * context * KV_HEADS * D * 2 * 2
    layers = max(1, math.ceil(L2_FLUSH_BYTES / kv_bytes_dense))
    gen = torch.Generator().manual_seed(batch * 1000003 + context)
    num_blocks = batch * blocks * layers
    cache = torch.empty(2, num_blocks, BLOCK, KV_HEADS, D, dtype=DTYPE, device="cuda")
    cache.normal_()
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = perm.view(layers, batch, blocks)
    q = torch.randn(batch, Q_HEADS, D, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    dense_us = None
    targets = {g: feedback_target(tables, batch, blocks, g) for g in feedback}
    for share in shares:
        lists, keep = [], 0
        for layer in range(layers):
            lst, keep = visit_lists(tables[layer], share, gen)
            lists.append(lst.cuda())
        seqused = torch.full((batch,), (keep - 1) * BLOCK + BLOCK, dtype=torch.int32,
                             device="cuda")
        us = graph_time_us(
            lambda i, lists=lists, seqused=seqused: attention.paged_decode_attention(
                q, cache, lists[i % layers], seqused, out=out), layers * 4)
        read = batch * keep * BLOCK * KV_HEADS * D * 2 * 2
        padded_us = float("nan")
        if keep < blocks:
            # epsd's visit_blocks rows are as wide as the block table: the same lists in
            # a full-width buffer size the grid for the full width (idle splits return).
            wide = [torch.nn.functional.pad(lst, (0, blocks - keep)) for lst in lists]
            padded_us = graph_time_us(
                lambda i, wide=wide, seqused=seqused: attention.paged_decode_attention(
                    q, cache, wide[i % layers], seqused, out=out), layers * 4)
        feedback_us = {}
        for g, target in targets.items():
            # each call starts from NaN entries, as epsd leaves them after a step: the
            # buffer's fill is timed alone and subtracted
            def with_feedback(i: int, lists=lists, seqused=seqused, target=target) -> None:
                target.buffer.fill_(float("nan"))
                attention.paged_decode_attention(q, cache, lists[i % layers], seqused, out=out,
                                                 feedback=target)

            feedback_us[g] = (graph_time_us(with_feedback, layers * 4)
                              - graph_time_us(lambda i, t=target: t.buffer.fill_(float("nan")),
                                              layers * 4))
        if share == 1.0:
            dense_us = us
        rows.append({"batch": batch, "context": context, "share": share, "us": us,
                     "gbs": read / us / 1e3, "copy": copy_gbs, "padded_us": padded_us,
                     "vs_dense": us / dense_us if dense_us else float("nan"),
                     "feedback_us": feedback_us})
    # The dense baseline an engine already has: SDPA's flash kernel over contiguous K/V.
    sdpa_us = float("nan")
    sdpa_err = float("nan")
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ks, vs = [], []
        for layer in range(layers):
            idx = tables[layer].long().cuda()  # [batch, blocks]
            k = cache[0][idx].reshape(batch, context, KV_HEADS, D).transpose(1, 2).contiguous()
            v = cache[1][idx].reshape(batch, context, KV_HEADS, D).transpose(1, 2).contiguous()
            ks.append(k)
            vs.append(v)
        q4 = q.unsqueeze(2)  # [batch, heads, 1, d]

        def sdpa(i: int) -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q4, ks[i % layers], vs[i % layers], enable_gqa=True)

        sdpa_us = graph_time_us(sdpa, layers * 4)
        ref = sdpa(0).squeeze(2).float()
        seqused = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        ours = attention.paged_decode_attention(q, cache, tables[0].cuda(), seqused).float()
        sdpa_err = (ours - ref).abs().max().item()
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"SDPA flash baseline failed for batch {batch} context {context}: {e}",
              file=sys.stderr)
    for row in rows:
        if row["batch"] == batch and row["context"] == context:
            row["sdpa_us"] = sdpa_us
            row["sdpa_err"] = sdpa_err


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true",
                        help="batch 1 x 8k, 8 x 32k, 1 x 128k and 32 x 32k; 100 and 25 %% only")
    parser.add_argument("--feedback", default="",
                        help="also time each row writing selection feedback at these group "
                             "sizes (e.g. 1,2)")
    parser.add_argument("--splits", action="store_true",
                        help="also sweep num_splits at batch 8 x 32k dense and batch 1 x 128k")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    lib = os.environ.get("EPS_ATTENTION_LIB")
    variant = os.environ.get("EPS_ATTN_VARIANT", "")
    print(f"# command: {' '.join(sys.argv)}  EPS_ATTENTION_LIB={lib}  "
          f"EPS_ATTN_VARIANT={variant or '(default)'}")
    copy_gbs = copy_bandwidth()
    print(f"# device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written)")
    feedback = tuple(int(g) for g in args.feedback.split(",") if g)
    shares = [1.0, 0.25] if args.quick else [1.0, 0.5, 0.25, 0.125]
    configs = [(1, 8192), (8, 32768), (1, 131072), (32, 32768)] if args.quick else [
        (b, c) for b in (1, 8, 32) for c in (8192, 32768, 131072)]
    rows: list[dict] = []
    for batch, context in configs:
        run_config(batch, context, shares, copy_gbs, rows, feedback)
        torch.cuda.empty_cache()  # the configuration's caches are gone with its frame
    fb = feedback
    print("| batch | context | blocks read | µs/layer | GB/s KV read | % of copy | "
          "× dense | µs, full-width lists | SDPA flash µs | × SDPA | max abs diff to SDPA |"
          + "".join(f" µs with feedback, g = {g} |" for g in fb))
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(fb))
    for r in rows:
        vs_sdpa = r["us"] / r["sdpa_us"] if r["share"] == 1.0 else float("nan")
        print(f"| {r['batch']} | {r['context'] // 1024}k | {r['share'] * 100:g} % | "
              f"{r['us']:.1f} | {r['gbs']:.0f} | {100 * r['gbs'] / r['copy']:.0f} % | "
              f"{r['vs_dense']:.2f} | {r['padded_us']:.1f} | "
              + (f"{r['sdpa_us']:.1f} | {vs_sdpa:.2f} | {r['sdpa_err']:.1e} |"
                 if r["share"] == 1.0 else "| | |")
              + "".join(f" {r['feedback_us'][g]:.1f} |" for g in fb))
    if args.splits:
        for batch, context in ((8, 32768), (1, 131072)):
            sweep_splits(batch, context)
            torch.cuda.empty_cache()


def sweep_splits(batch: int, context: int) -> None:
    """Dense time for several num_splits (0: the library's choice)."""
    blocks = context // BLOCK
    layers = max(1, math.ceil(L2_FLUSH_BYTES / (batch * context * KV_HEADS * D * 4)))
    cache = torch.empty(2, batch * blocks * layers, BLOCK, KV_HEADS, D, dtype=DTYPE,
                        device="cuda").normal_()
    tables = torch.randperm(batch * blocks * layers).to(torch.int32).cuda().view(
        layers, batch, blocks)
    q = torch.randn(batch, Q_HEADS, D, dtype=DTYPE, device="cuda")
    seqused = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    line = []
    for splits in (0, 4, 8, 16, 32, 64, 128, 256):
        us = graph_time_us(lambda i, s=splits: attention._run(
            q, cache, tables[i % layers], seqused, kind=0, dense=None, context=None,
            softmax_scale=None, softcap=0.0, out=None, return_lse=False,
            names=("block_table", "seqused_k"), num_splits=s), layers * 4)
        gbs = batch * context * KV_HEADS * D * 4 / us / 1e3
        line.append(f"{splits or 'auto'}: {us:.1f} µs {gbs:.0f} GB/s")
    print(f"# splits, batch {batch} x {context // 1024}k dense: " + "; ".join(line))

if __name__ == "__main__":
    main()
