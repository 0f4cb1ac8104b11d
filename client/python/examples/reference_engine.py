#!/usr/bin/env python3
"""Reference engine: a real Llama-architecture model decoding from a paged KV cache,
with attention gated by epsd, next to a dense run of the same loop.

- KV cache in vLLM's layout, per layer ``[2, num_blocks, block_size, kv_heads, d]``,
  with block tables (physical blocks handed out in random order).
- EPS summaries written when K is written (prefill and every decode step) by
  ``TorchSummaryWriter`` into the library's shared summary pool.
- q copied into the shared query buffer in every layer (lag-1 queries).
- One ``SelectPages`` per decode step; attention then reads only the visited
  blocks (a gather of the visited blocks: the visit list is a block-table row,
  ``seqused_k`` tokens). The dense run gathers every block of the same table
  with the same code, so the two differ only in which blocks they read.
- Teacher-forced on the text's own continuation, so both runs see the same
  tokens: next-token agreement (argmax) and Δ log-likelihood of the true next
  token are measured step by step.

    python3 reference_engine.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --epsd-target unix:///tmp/epsd.sock --buffers cuda --batch 4 --prompt-tokens 7680

``--buffers cuda`` allocates the shared buffers with cudaMalloc and exports them
over CUDA IPC (epsd --backend=cuda); ``--buffers shm`` uses POSIX shared memory
(epsd's cpu backend; the engine copies q to the host each layer). ``--device cpu``
runs the whole loop on the CPU (for checking the engine without a GPU).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_llama import ByteBpeTokenizer, LlamaConfig, load_gguf  # noqa: E402

from eps_client import (  # noqa: E402
    BufferShape,
    ClientOptions,
    EpsClient,
    ModelLayout,
    ShmBuffers,
    attach_request,
    blocks_for,
    groups_for,
    pb,
)
from eps_client.torch_writer import TorchSummaryWriter  # noqa: E402


def corpus_text(min_chars: int) -> str:
    """Deterministic long text: the running Python's standard-library sources, in name order."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(lib.glob("*.py")):
        text = path.read_text(errors="replace")
        parts.append(text)
        total += len(text)
        if total >= min_chars:
            break
    return "\n".join(parts)


class Llama:
    """The model's weights on the device and the per-layer math (one token or a prompt)."""

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.c = config

        def w(name: str) -> torch.Tensor:
            return torch.from_numpy(weights[name].copy()).to(device=device, dtype=dtype)

        self.embed = w("token_embd.weight")
        self.lm_head = w("output.weight") if "output.weight" in weights else self.embed
        self.out_norm = w("output_norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": w(p + "attn_norm.weight"), "ffn_norm": w(p + "ffn_norm.weight"),
                "wq": w(p + "attn_q.weight"), "wk": w(p + "attn_k.weight"),
                "wv": w(p + "attn_v.weight"), "wo": w(p + "attn_output.weight"),
                "gate": w(p + "ffn_gate.weight"), "up": w(p + "ffn_up.weight"),
                "down": w(p + "ffn_down.weight"),
            })
        d = config.head_dim
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, device=device,
                                                                   dtype=torch.float32) / d))

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c.rms_eps)
        return xf.to(x.dtype) * weight

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Interleaved RoPE on x [..., tokens, heads, d] at positions [..., tokens]."""
        angles = positions.float()[..., None] * self.inv_freq  # [..., T, d/2]
        cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]
        xf = x.float()
        even, odd = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return out.flatten(-2).to(x.dtype)

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        c, p = self.c, self.layers[layer]
        h = self.norm(x, p["attn_norm"])
        shape = x.shape[:-1]
        q = (h @ p["wq"].T).view(*shape, c.num_q_heads, c.head_dim)
        k = (h @ p["wk"].T).view(*shape, c.num_kv_heads, c.head_dim)
        v = (h @ p["wv"].T).view(*shape, c.num_kv_heads, c.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        p = self.layers[layer]
        x = x + attn.flatten(-2) @ p["wo"].T
        h = self.norm(x, p["ffn_norm"])
        return x + (torch.nn.functional.silu(h @ p["gate"].T) * (h @ p["up"].T)) @ p["down"].T

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self.norm(x, self.out_norm) @ self.lm_head.T).float()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """[B, H, T, d] attention with a boolean mask [T, S] (True = attend)."""
    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if sdpa is not None:
        return sdpa(q, k, v, attn_mask=mask)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)


def paged_attention(q: torch.Tensor, kv: torch.Tensor, blocks: torch.Tensor,
                    counts: torch.Tensor, context: int, block_size: int) -> torch.Tensor:
    """One query per row over the listed blocks of a paged cache.

    q [B, q_heads, d]; kv [2, num_blocks, block_size, kv_heads, d]; blocks [B, n] physical
    ids (a block-table row or a visit list, ascending, the sequence's last block last);
    counts [B] valid entries of ``blocks``; ``context`` tokens per row (the newest included).
    Reads only the listed blocks. Returns [B, q_heads, d].
    """
    B, n = blocks.shape
    qh, d = q.shape[1], q.shape[2]
    kvh = kv.shape[3]
    k = kv[0][blocks].reshape(B, n * block_size, kvh, d)  # the gather: visited blocks only
    v = kv[1][blocks].reshape(B, n * block_size, kvh, d)
    last_tokens = context - (blocks_for(context, block_size) - 1) * block_size
    j = torch.arange(n * block_size, device=q.device)
    block_of, within = j // block_size, j % block_size
    cnt = counts[:, None]
    full = block_of[None] < cnt - 1
    valid = full | ((block_of[None] == cnt - 1) & (within[None] < last_tokens))
    g = qh // kvh
    qg = q.view(B, kvh, g, d).float()
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, k.float()) / math.sqrt(d)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgn,bnhd->bhgd", probs, v.float())
    return out.reshape(B, qh, d).to(q.dtype)


class Engine:
    """Paged KV cache, block tables, summaries and the shared buffers of one batch."""

    def __init__(self, args: argparse.Namespace, model: Llama, eps_model: ModelLayout,
                 device: torch.device, dtype: torch.dtype) -> None:
        c = model.c
        self.args, self.model, self.eps_model, self.device = args, model, eps_model, device
        self.B = args.batch
        self.max_context = args.prompt_tokens + args.decode_steps + 1
        self.bs = eps_model.block_size
        self.max_blocks = blocks_for(self.max_context, self.bs)
        self.max_groups = groups_for(self.max_context, eps_model)
        self.num_blocks = self.B * self.max_blocks + 7
        rng = np.random.default_rng(args.seed)
        physical = rng.permutation(self.num_blocks)[: self.B * self.max_blocks]
        self.block_table = torch.from_numpy(
            physical.reshape(self.B, self.max_blocks).astype(np.int32)).to(device)
        slots = rng.permutation(self.B * self.max_groups).astype(np.int32)
        self.group_slots = torch.from_numpy(slots.reshape(self.B, self.max_groups)).to(device)
        self.kv = [torch.zeros(2, self.num_blocks, self.bs, c.num_kv_heads, c.head_dim,
                               device=device, dtype=dtype) for _ in range(c.num_layers)]
        shape = BufferShape(num_slots=self.B * self.max_groups, max_seqs=self.B,
                            max_context=self.max_context, max_batch=self.B)
        if args.buffers == "cuda":
            from eps_client.cuda import CudaBuffers

            self.buffers = CudaBuffers(eps_model, shape, device=device.index or 0)
            self.pool, self.queries = self.buffers.summary_pool, self.buffers.queries
            self.visit_blocks = self.buffers.visit_blocks
            self.visit_count = self.buffers.visit_count
            backend = pb.BACKEND_CUDA
        else:
            self.buffers = ShmBuffers(eps_model, shape, tag="refengine")
            self.pool = torch.from_numpy(self.buffers.summary_pool)
            self.queries = torch.from_numpy(self.buffers.queries)
            self.visit_blocks = torch.from_numpy(self.buffers.visit_blocks)
            self.visit_count = torch.from_numpy(self.buffers.visit_count)
            backend = pb.BACKEND_CPU
        # The tables are copied into the shared buffers (the engine keeps its own).
        self._copy_table(self.buffers.group_table, self.group_slots)
        self._copy_table(self.buffers.block_table, self.block_table)
        self.writer = TorchSummaryWriter(eps_model, device=self.pool.device)
        self.writer.reset(self.pool, torch.arange(self.pool.shape[0]))
        options = pb.SelectOptions(method=pb.Method.Value(f"METHOD_{args.method.upper()}"),
                                   alpha=args.alpha, first_n=args.first_n, last_n=args.last_n,
                                   top_pages=args.top_pages_list[0],
                                   granularity=pb.GRANULARITY_UNION)
        attach = attach_request(f"reference-engine-{id(self)}", eps_model,
                                self.buffers.descriptors(), max_batch=self.B,
                                num_kv_blocks=self.num_blocks, options=options, backend=backend,
                                device=device.index or 0, lease_ms=600_000)
        self.client = EpsClient(ClientOptions(target=args.epsd_target,
                                              deadline_s=args.deadline_ms / 1e3,
                                              attach_deadline_s=5.0,
                                              use_stream=args.stream), attach)

    @staticmethod
    def _copy_table(dst: object, src: torch.Tensor) -> None:
        if isinstance(dst, np.ndarray):
            dst[: src.shape[0], : src.shape[1]] = src.cpu().numpy()
        else:
            dst[: src.shape[0], : src.shape[1]].copy_(src)

    def _write_queries(self, layer: int, q: torch.Tensor) -> None:
        self.queries[layer, : self.B].copy_(q.float().to(self.queries.device))

    def _write_kv(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, summaries: bool) -> None:
        """k, v [B, T, kv_heads, d] at positions [T] into the paged cache (and the summaries)."""
        blocks = self.block_table[:, positions // self.bs]  # [B, T]
        within = (positions % self.bs)[None].expand_as(blocks)
        self.kv[layer][0][blocks.long(), within] = k
        self.kv[layer][1][blocks.long(), within] = v
        if summaries:
            slots = self.group_slots[:, positions // self.eps_model.group_tokens]  # [B, T]
            self.writer.append(self.pool, layer, slots.reshape(-1).to(self.pool.device),
                               k.reshape(-1, *k.shape[2:]).to(self.pool.device))

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """Prompt tokens [B, P]: dense causal attention, K/V and summaries written; returns
        the hidden state of the last prompt token and leaves its q in the query buffer."""
        m, c = self.model, self.model.c
        P = tokens.shape[1]
        last = None
        for start in range(0, P, chunk):
            pos = torch.arange(start, min(P, start + chunk), device=self.device)
            x = m.embed[tokens[:, pos]]
            for layer in range(c.num_layers):
                q, k, v = m.qkv(layer, x, pos)
                self._write_kv(layer, pos, k, v, summaries=True)
                end = int(pos[-1]) + 1
                blocks = self.block_table[:, : blocks_for(end, self.bs)].long()
                kk = self.kv[layer][0][blocks].flatten(1, 2)[:, :end]  # [B, end, kvh, d]
                vv = self.kv[layer][1][blocks].flatten(1, 2)[:, :end]
                g = c.num_q_heads // c.num_kv_heads
                kk = kk.repeat_interleave(g, dim=2).transpose(1, 2)
                vv = vv.repeat_interleave(g, dim=2).transpose(1, 2)
                mask = torch.arange(end, device=self.device)[None] <= pos[:, None]
                attn = causal_attention(q.transpose(1, 2), kk, vv, mask)
                x = m.finish_layer(layer, x, attn.transpose(1, 2))
                if start + chunk >= P:
                    self._write_queries(layer, q[:, -1])
            last = x[:, -1]
        return last

    def snapshot(self) -> list[torch.Tensor]:
        return [kv.clone() for kv in self.kv] + [self.pool.clone(), self.queries.clone()]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for kv, saved in zip(self.kv, snap[:-2], strict=True):
            kv.copy_(saved)
        self.pool.copy_(snap[-2])
        self.queries.copy_(snap[-1])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, targets: torch.Tensor, start: int, gated: bool,
               options: pb.SelectOptions | None = None) -> dict[str, object]:
        """Teacher-forced decode: step s feeds tokens[:, s] at position start+s. Returns per-step
        log-probabilities of targets, argmax tokens, step times and selection statistics."""
        m, c = self.model, self.model.c
        steps = tokens.shape[1]
        logp, argmax, times, stats, rtts = [], [], [], [], []
        fallbacks = 0
        reasons: dict[str, int] = {}
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for s in range(steps):
            t = start + s
            ctx = t + 1
            sync()
            t0 = time.perf_counter()
            nblocks = blocks_for(ctx, self.bs)
            blocks_dense = self.block_table[:, :nblocks].long()
            counts_dense = torch.full((self.B,), nblocks, device=self.device)
            use_visits = False
            if gated:
                rows = [(b, ctx, b) for b in range(self.B)]
                result = self.client.select_pages(self.args.step_base + t, rows, options)
                if result.ok:
                    use_visits = True
                    counts_all = self.visit_count[:, : self.B].to(self.device)
                    counts_host = counts_all.max(dim=1).values.cpu()  # one sync per step
                    visits = self.visit_blocks[:, : self.B].to(self.device)
                    st = result.response.stats
                    stats.append((st.groups_visited, st.groups_total, st.pages_visited,
                                  st.pages_total, st.prepass_us))
                    rtts.append(result.round_trip_us)
                else:
                    fallbacks += 1
                    reasons[f"{result.code.name}: {result.message}"] = reasons.get(
                        f"{result.code.name}: {result.message}", 0) + 1
            pos = torch.tensor([t], device=self.device)
            x = m.embed[tokens[:, s : s + 1]]  # [B, 1, hidden]
            for layer in range(c.num_layers):
                q, k, v = m.qkv(layer, x, pos)
                self._write_kv(layer, pos, k, v, summaries=gated)
                if gated:
                    self._write_queries(layer, q[:, 0])
                if use_visits:
                    n = int(counts_host[layer])
                    # entries past a row's count are stale: clamp them to valid ids (masked)
                    blocks = visits[layer, :, :n].long().clamp_(0, self.num_blocks - 1)
                    counts = counts_all[layer]
                else:
                    blocks, counts = blocks_dense, counts_dense
                attn = paged_attention(q[:, 0], self.kv[layer], blocks, counts, ctx, self.bs)
                x = m.finish_layer(layer, x, attn[:, None])
            lp = torch.log_softmax(m.logits(x[:, 0]), dim=-1)
            logp.append(lp.gather(1, targets[:, s : s + 1])[:, 0])
            argmax.append(lp.argmax(-1))
            sync()
            times.append(time.perf_counter() - t0)
        return {"logp": torch.stack(logp, 1).cpu(), "argmax": torch.stack(argmax, 1).cpu(),
                "times": times, "stats": stats, "rtt_us": rtts, "fallbacks": fallbacks,
                "fallback_reasons": reasons}


def percentile(values: list[float], p: float) -> float:
    return float(np.percentile(np.array(values), p)) if values else float("nan")


def main() -> int:
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints every thread's stack
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--epsd-target", default="unix:///tmp/epsd.sock")
    ap.add_argument("--buffers", choices=["cuda", "shm"], default="cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=7680)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=8, help="excluded from the timings")
    ap.add_argument("--check-steps", type=int, default=4,
                    help="steps with method=off, which must equal dense exactly")
    ap.add_argument("--method", default="quest", choices=["jl", "fro", "quest", "1pc", "off"])
    ap.add_argument("--top-pages", default="8",
                    help="comma-separated: one gated run per value, against one dense run")
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--first-n", type=int, default=1)
    ap.add_argument("--last-n", type=int, default=2)
    ap.add_argument("--group-blocks", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--sketch-dim", type=int, default=8)
    ap.add_argument("--deadline-ms", type=float, default=50.0)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.step_base = 1
    args.top_pages_list = [int(v) for v in str(args.top_pages).split(",")]

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    config, weights, reader = load_gguf(args.gguf)
    tokenizer = ByteBpeTokenizer(reader)
    model = Llama(config, weights, device, dtype)
    del weights
    print(f"model: {Path(args.gguf).name}: {config}; loaded in {time.perf_counter() - t0:.1f} s",
          flush=True)
    need = args.prompt_tokens + args.decode_steps + 1
    if need > config.context_length:
        print(f"warning: {need} tokens exceed the model's context {config.context_length}")
    stride = need // 2
    text = corpus_text(min_chars=(need + stride * args.batch) * 6)
    ids = tokenizer.encode(text)
    if len(ids) < stride * (args.batch - 1) + need:
        raise SystemExit(f"corpus too short: {len(ids)} tokens")
    seqs = torch.tensor([ids[b * stride : b * stride + need] for b in range(args.batch)],
                        device=device)
    prompt, cont = seqs[:, : args.prompt_tokens], seqs[:, args.prompt_tokens :]
    print(f"corpus: {len(ids)} tokens of Python {sys.version.split()[0]} stdlib source; "
          f"batch {args.batch} x ({args.prompt_tokens} prompt + {args.decode_steps} decode)",
          flush=True)

    eps_model = ModelLayout(num_layers=config.num_layers, num_q_heads=config.num_q_heads,
                            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                            block_size=args.block_size, group_blocks=args.group_blocks,
                            sketch_dim=args.sketch_dim, phi_seed=0x5EED,
                            kv_dtype=pb.DTYPE_BFLOAT16 if dtype == torch.bfloat16
                            else pb.DTYPE_FLOAT16)
    engine = Engine(args, model, eps_model, device, dtype)
    t0 = time.perf_counter()
    engine.prefill(prompt)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"prefill: {time.perf_counter() - t0:.2f} s", flush=True)
    engine.client.attach()  # after the prefill, which may outlast a lease
    snap = engine.snapshot()
    inputs, targets = cont[:, :-1], cont[:, 1:]
    steps = args.decode_steps

    print("decode: dense", flush=True)
    dense = engine.decode(inputs[:, :steps], targets[:, :steps], args.prompt_tokens, gated=False)
    engine.restore(snap)
    check = None
    if args.check_steps > 0:
        off = pb.SelectOptions(method=pb.METHOD_OFF)
        # The first steps also warm epsd up (first kernel launches): a generous deadline.
        deadline, engine.client.options.deadline_s = engine.client.options.deadline_s, 5.0
        check = engine.decode(inputs[:, : args.check_steps], targets[:, : args.check_steps],
                              args.prompt_tokens, gated=True, options=off)
        engine.client.options.deadline_s = deadline
        args.step_base += args.check_steps + 1
        engine.restore(snap)
    w = args.warmup_steps
    d_ms = [x * 1e3 for x in dense["times"][w:]]
    common = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": Path(args.gguf).name, "dtype": args.dtype, "batch": args.batch,
        "prompt_tokens": args.prompt_tokens, "decode_steps": steps, "warmup_steps": w,
        "buffers": args.buffers, "method": args.method, "alpha": args.alpha,
        "first_n": args.first_n, "last_n": args.last_n, "block_size": args.block_size,
        "group_blocks": args.group_blocks, "sketch_dim": args.sketch_dim,
        "dense_step_ms_p50": percentile(d_ms, 50), "dense_step_ms_p95": percentile(d_ms, 95),
        "dense_nll_per_token": -dense["logp"].double().mean().item(),
        "check_off_max_abs_delta_logp": (
            (check["logp"] - dense["logp"][:, : args.check_steps]).abs().max().item()
            if check else None),
        "check_off_fallbacks": check["fallbacks"] if check else None,
        "check_off_fallback_reasons": check["fallback_reasons"] if check else None,
    }
    for key, value in common.items():
        print(f"{key:32s} {value}")
    runs = []
    for top in args.top_pages_list:
        engine.restore(snap)
        options = pb.SelectOptions(top_pages=top)
        gated = engine.decode(inputs[:, :steps], targets[:, :steps], args.prompt_tokens,
                              gated=True, options=options)
        args.step_base += steps + 1
        g_ms = [x * 1e3 for x in gated["times"][w:]]
        dlp = (gated["logp"] - dense["logp"]).double()
        st = gated["stats"]
        gv, gt = sum(x[0] for x in st), sum(x[1] for x in st)
        pv, pt = sum(x[2] for x in st), sum(x[3] for x in st)
        run = {
            "top_pages": top,
            "gated_step_ms_p50": percentile(g_ms, 50), "gated_step_ms_p95": percentile(g_ms, 95),
            "select_rtt_us_p50": percentile(gated["rtt_us"], 50),
            "select_rtt_us_p95": percentile(gated["rtt_us"], 95),
            "prepass_us_p50": percentile([x[4] for x in st], 50),
            "groups_visited_fraction": gv / gt if gt else float("nan"),
            "pages_visited_fraction": pv / pt if pt else float("nan"),
            "next_token_agreement": (gated["argmax"] == dense["argmax"]).double().mean().item(),
            "gated_nll_per_token": -gated["logp"].double().mean().item(),
            "delta_loglik_per_token": dlp.mean().item(),
            "delta_loglik_max_abs": dlp.abs().max().item(),
            "fallbacks": gated["fallbacks"],
            "fallback_reasons": gated["fallback_reasons"],
        }
        runs.append(run)
        print(f"--- gated, top_pages={top}")
        for key, value in run.items():
            print(f"{key:32s} {value}")
    print("\n| top_pages | groups visited | step p50 ms | step p95 ms | agreement | "
          "Δ loglik/token |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| dense | 100% | {common['dense_step_ms_p50']:.2f} | "
          f"{common['dense_step_ms_p95']:.2f} | 1 | 0 |")
    for r in runs:
        print(f"| {r['top_pages']} | {100 * r['groups_visited_fraction']:.1f}% | "
              f"{r['gated_step_ms_p50']:.2f} | {r['gated_step_ms_p95']:.2f} | "
              f"{r['next_token_agreement']:.4f} | {r['delta_loglik_per_token']:+.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"common": common, "gated": runs}, indent=2))
    engine.client.detach()
    engine.client.close()
    counters = engine.client.counters()
    print(f"client counters: {counters}")
    fallbacks = sum(r["fallbacks"] for r in runs) + (check["fallbacks"] if check else 0)
    ok = fallbacks == 0 and (check is None or common["check_off_max_abs_delta_logp"] == 0)
    if not ok:
        print(f"FAILED: {fallbacks} fallbacks, or method=off differed from dense",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
