"""The reference engine's decode loop: a paged KV cache in vLLM's layout, the shared buffers,
and selection off the critical path (docs/benchmarks/reference-engine.md).

Per gated decode step t (selection step number s = step_base + t), all on one CUDA stream
and with no host wait on the GPU:

    wait selection_done >= s            (the lists of step t; a stream memory op)
    the step's CUDA graph               (views of the lists, 32 layers, logits)
    summary appends of step t's keys    (libeps_engine's queue, on this stream)
    wait summaries_done >= s, then inputs_ready = s + 1
    SelectPages(s + 1, async)           (lag-1 queries: step t's; the pre-pass of t+1 runs
                                         while the host already queues step t+1)

With selections reused for k steps (``decode(reuse=k)``), only a step t with t % k == 0
waits, and inputs_ready and SelectPages come only before such a step; the steps between
read the last lists, which the step's views extend by the blocks written since.

The dense run executes the same graph code with the engine's block table and the context
as seqused_k; both call the same attention kernel. Fail open: a fallback releases step
s + 1 densely on this stream, before its wait (visit_count = -1); a step epsd accepted and
never finished (epsd killed) is released by the watchdog. CUDA events around the waits and
the graph give the breakdown; the host runs at most two steps ahead of the GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from engine_attention import attention_kernel, gather_attention
from engine_model import Model
from engine_snapshot import BufferSnapshot

from eps_client import (
    BufferShape,
    ClientOptions,
    EpsClient,
    ModelLayout,
    Row,
    SelectOptions,
    StepStats,
    blocks_for,
    coarse_groups_for,
    groups_for,
)
from eps_client.cuda import CudaBuffers
from eps_client.engine import (
    DeviceSummaryWriter,
    EngineLibError,
    StepCounters,
    SummaryQueue,
    Watchdog,
    key_appends,
)
from eps_client.outputs import REUSE_WINDOW_BLOCKS, flash_attention_views
from eps_client.torch_writer import TorchSummaryWriter


@dataclass
class RunRecord:
    """Per-step measurements of one decode run."""

    gated: bool
    first_step: int = 0  # the selection step number of decode step 0
    reuse: int = 1  # decode step t read the lists of selection step first_step + t - t % reuse
    step_ms: list[float] = field(default_factory=list)  # GPU time from step to step
    graph_ms: list[float] = field(default_factory=list)
    wait_selection_ms: list[float] = field(default_factory=list)
    wait_summaries_ms: list[float] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)  # host time to queue one step
    rtt_us: list[float] = field(default_factory=list)
    stats: list[StepStats] = field(default_factory=list)  # from replies' `earlier`
    fallback_steps: list[int] = field(default_factory=list)
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    accepted_steps: list[int] = field(default_factory=list)
    dense_marks: list[bool] = field(default_factory=list)  # lists dense on the device
    watchdog_releases: int = 0  # steps of this run the watchdog released
    refused_lists: int = 0  # (layer, row) lists the views refused: the engine's row was read
    logp: Any = None
    argmax: Any = None
    events: list[str] = field(default_factory=list)
    summary_errors: int = 0  # appends refused or skipped (a non-finite key) in this run
    summary_error: str = ""  # the last one's message


class PagedEngine:
    """One batch of sequences: the paged cache, tables, shared buffers, client, graphs."""

    def __init__(self, model: Model, eps_model: ModelLayout, *, batch: int, max_context: int,
                 target: str, select: SelectOptions, deadline_s: float, watchdog_s: float,
                 device: torch.device, dtype: torch.dtype, seed: int = 0,
                 use_graphs: bool = True, engine_id: str = "reference-engine",
                 feedback: bool = False) -> None:
        c = model.c
        self.model, self.eps_model, self.device, self.dtype = model, eps_model, device, dtype
        self.B, self.bs = batch, eps_model.block_size
        self.max_context = max_context
        self.max_blocks = blocks_for(max_context, self.bs)
        self.max_groups = groups_for(max_context, eps_model)
        self.num_blocks = batch * self.max_blocks + 7
        rng = np.random.default_rng(seed)
        physical = rng.permutation(self.num_blocks)[: batch * self.max_blocks]
        self.table_host = physical.reshape(batch, self.max_blocks).astype(np.int32)
        self.table = torch.from_numpy(self.table_host).to(device)
        self.slots_host = rng.permutation(batch * self.max_groups).astype(np.int64).reshape(
            batch, self.max_groups)
        self.kv = [torch.zeros(2, self.num_blocks, self.bs, c.num_kv_heads, c.head_dim,
                               device=device, dtype=dtype) for _ in range(c.num_layers)]
        self.kv_ptrs = np.array([t.data_ptr() for t in self.kv], dtype=np.uint64)
        # The coarse level (docs/policy-selection.md, "Coarse-to-fine"): a record per coarse
        # group too, in shuffled coarse slots (drawn after the tables above, which stay as
        # without it).
        self.max_coarse = coarse_groups_for(max_context, eps_model)
        self.coarse_slots_host = rng.permutation(batch * self.max_coarse).astype(
            np.int64).reshape(batch, self.max_coarse)
        shape = BufferShape(num_slots=batch * self.max_groups, max_seqs=batch,
                            max_context=max_context, max_batch=batch,
                            coarse_slots=batch * self.max_coarse, with_feedback=feedback)
        self.buffers = CudaBuffers(eps_model, shape, device=device.index or 0)
        self.buffers.group_table[:batch, : self.max_groups].copy_(
            torch.from_numpy(self.slots_host.astype(np.int32)))
        self.buffers.block_table[:batch, : self.max_blocks].copy_(self.table)
        self.pool = self.buffers.summary_pool
        TorchSummaryWriter(eps_model, device=device).reset(self.pool,
                                                          torch.arange(self.pool.shape[0]))
        if self.max_coarse:
            self.buffers.coarse_table[:batch, : self.max_coarse].copy_(
                torch.from_numpy(self.coarse_slots_host.astype(np.int32)))
            TorchSummaryWriter(eps_model, device=device).reset(
                self.buffers.coarse_pool, torch.arange(self.buffers.coarse_pool.shape[0]))
        # Made for the buffers: their close() closes it (and the queue) before the pool goes.
        self.writer = DeviceSummaryWriter(eps_model, device.index or 0, buffers=self.buffers)
        self.queue = SummaryQueue(self.writer)
        self._summary_errors_seen = 0
        self.counters = StepCounters.of(self.buffers)
        self.watchdog = Watchdog(self.counters, watchdog_s)
        self.stream = torch.cuda.Stream(device)
        self.client = EpsClient(self.buffers, engine_id=engine_id, num_kv_blocks=self.num_blocks,
                                select=select, backend="cuda", device=device.index or 0,
                                lease_ms=600_000,
                                options=ClientOptions(target=target, deadline_s=deadline_s,
                                                      attach_deadline_s=5.0, use_stream=True,
                                                      on_fallback=self._release_dense))
        self.attend, self.attention_name = attention_kernel()
        self.feedback_targets = self._feedback_targets() if feedback else None
        self.use_graphs = use_graphs
        self.graphs: dict[bool, Any] = {}
        # static inputs and outputs of a step (graph-captured addresses)
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.targets = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.ctx = torch.zeros(batch, dtype=torch.int32, device=device)
        self.logp_out = torch.zeros(batch, dtype=torch.float32, device=device)
        self.argmax_out = torch.zeros(batch, dtype=torch.long, device=device)
        L = c.num_layers
        self.view_table = torch.zeros(L, batch, 1, self.max_blocks, dtype=torch.int32,
                                      device=device)
        self.view_used = torch.zeros(L, batch, 1, dtype=torch.int32, device=device)
        # lists flash_attention_views refused (the engine's row read instead), counted on the
        # device by the captured step: a reused list past the window, a list never written
        self.refused = torch.zeros(1, dtype=torch.int32, device=device)
        self.step_base = 1  # selection step numbers only grow (docs/api-memory.md §3.4)

    def _feedback_targets(self) -> list[Any]:
        """Selection feedback (docs/policy-selection.md): per layer, where the gated attention
        writes each visited group's log-sum-exp: that layer of epsd's feedback buffer, with every
        cache block's index in its sequence (the table is allocated whole up front, so its
        positions never change). Batch row b is table row b."""
        if self.attend is gather_attention:
            raise RuntimeError("--feedback needs eps_client.attention (libeps_attention.so): "
                               f"{self.attention_name}")
        from eps_client.attention import FeedbackTarget, block_positions

        full = torch.full((self.B,), self.max_blocks * self.bs, dtype=torch.int32,
                          device=self.device)
        positions = block_positions(self.table, full, self.num_blocks)
        return [FeedbackTarget(self.buffers.feedback[layer], positions,
                               self.eps_model.group_blocks)
                for layer in range(self.model.c.num_layers)]

    def attend_layer(self, layer: int, q: torch.Tensor, table: torch.Tensor,
                     used: torch.Tensor, gated: bool) -> torch.Tensor:
        """The attention of one layer; gated with feedback, it also writes the feedback."""
        if gated and self.feedback_targets is not None:
            return self.attend(q, self.kv[layer], table, used,
                               feedback=self.feedback_targets[layer])
        return self.attend(q, self.kv[layer], table, used)

    # -- filling the cache -------------------------------------------------------------------

    def fill_random(self, tokens: int, seed: int = 1) -> None:
        """Random keys and values for the first ``tokens`` positions (timing runs)."""
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        for kv in self.kv:
            kv.normal_(0.0, 1.0, generator=g)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, chunk: int = 1024) -> None:
        """Prompt tokens [B, P] through the model: dense causal attention, K/V into the cache.
        The last token's q lands in the query buffer (the first gated step's lag-1 query)."""
        m, c = self.model, self.model.c
        P = tokens.shape[1]
        g = c.num_q_heads // c.num_kv_heads
        for start in range(0, P, chunk):
            pos = torch.arange(start, min(P, start + chunk), device=self.device)
            cos, sin = m.rope_tables(pos)
            x = m.embed[tokens[:, pos]]
            for layer in range(c.num_layers):
                q, k, v = m.qkv(layer, x, cos, sin)
                self._write_kv(layer, pos, k, v)
                end = int(pos[-1]) + 1
                blocks = self.table[:, : blocks_for(end, self.bs)].long()
                kk = self.kv[layer][0][blocks].flatten(1, 2)[:, :end]
                vv = self.kv[layer][1][blocks].flatten(1, 2)[:, :end]
                kk = kk.repeat_interleave(g, dim=2).transpose(1, 2)
                vv = vv.repeat_interleave(g, dim=2).transpose(1, 2)
                mask = torch.arange(end, device=self.device)[None] <= pos[:, None]
                attn = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), kk, vv, attn_mask=mask)
                x = m.finish_layer(layer, x, attn.transpose(1, 2))
                if start + chunk >= P:
                    self.buffers.queries[layer, : self.B].copy_(q[:, -1].float())

    def _write_kv(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        blocks = self.table[:, pos // self.bs].long()  # [B, T]
        within = (pos % self.bs)[None].expand_as(blocks)
        self.kv[layer][0][blocks, within] = k
        self.kv[layer][1][blocks, within] = v

    def write_prompt_summaries(self, tokens: int) -> None:
        """Summaries of positions [0, tokens) with the device writer, straight from the
        cache: one append per (sequence, block, layer, KV head), in g calls so that the
        records of one call are distinct; with a coarse level, the coarse records from the
        same blocks likewise, in coarse_blocks calls."""
        self._append_prompt(tokens, self.eps_model.group_blocks, self.pool, self.slots_host)
        if self.max_coarse:
            self._append_prompt(tokens, self.eps_model.coarse_blocks, self.buffers.coarse_pool,
                                self.coarse_slots_host)

    def _append_prompt(self, tokens: int, blocks_per_record: int, pool: torch.Tensor,
                       slots_host: np.ndarray) -> None:
        """The blocks of [0, tokens) into the records of ``slots_host`` [B, records] of
        ``pool`` (a record holds ``blocks_per_record`` blocks), one block of each record per
        call."""
        H, d = self.model.c.num_kv_heads, self.model.c.head_dim
        nblocks = blocks_for(tokens, self.bs)
        elt = self.kv[0].element_size()
        per = blocks_per_record
        for j in range(per):
            logical = np.arange(j, nblocks, per)
            if logical.size == 0:
                continue
            counts = np.minimum(self.bs, tokens - logical * self.bs)
            b_idx = np.repeat(np.arange(self.B), logical.size)
            lb = np.tile(logical, self.B)
            phys = self.table_host[b_idx, lb].astype(np.uint64)
            head = np.arange(H, dtype=np.uint64)[None, None, :]
            ptrs = (self.kv_ptrs[:, None, None] + (phys[None, :, None] * self.bs * H + head)
                    * np.uint64(d * elt))
            self.writer.append(key_appends(self.eps_model, pool.data_ptr(),
                                           slots_host[b_idx, lb // per], ptrs,
                                           count=np.tile(counts, self.B), stride=H * d,
                                           num_slots=pool.shape[0]),
                               _dtype_name(self.dtype),
                               torch.cuda.current_stream(self.device).cuda_stream)

    def _step_appends(self, position: int) -> np.ndarray:
        """The appends of the key at ``position`` of every row, layer and KV head."""
        H, d = self.model.c.num_kv_heads, self.model.c.head_dim
        lb = position // self.bs
        phys = self.table_host[:, lb].astype(np.uint64)
        slots = self.slots_host[:, position // self.eps_model.group_tokens]
        head = np.arange(H, dtype=np.uint64)[None, None, :]
        offset = (phys[None, :, None] * self.bs + np.uint64(position % self.bs)) * H + head
        ptrs = self.kv_ptrs[:, None, None] + offset * np.uint64(d * self.kv[0].element_size())
        if not self.max_coarse:
            return key_appends(self.eps_model, self.pool.data_ptr(), slots, ptrs,
                               num_slots=self.pool.shape[0])
        coarse = self.coarse_slots_host[:, lb // self.eps_model.coarse_blocks]
        return key_appends(self.eps_model, self.pool.data_ptr(), slots, ptrs,
                           num_slots=self.pool.shape[0],
                           coarse_pool_ptr=self.buffers.coarse_pool.data_ptr(),
                           coarse_slots=coarse,
                           num_coarse_slots=self.buffers.coarse_pool.shape[0])

    # -- one step ----------------------------------------------------------------------------

    def _body(self, gated: bool) -> None:
        """The graph-captured part of a decode step (static inputs and outputs)."""
        m, c = self.model, self.model.c
        cos, sin = m.rope_tables(self.pos)  # [1, 1, d]
        blocks = self.table.gather(1, (self.pos // self.bs).expand(self.B)[:, None]).long()[:, 0]
        within = (self.pos % self.bs).expand(self.B)
        if gated:
            flash_attention_views(self.buffers.visit_blocks, self.buffers.visit_count,
                                  self.table, self.ctx, self.bs,
                                  out=(self.view_table, self.view_used), refused=self.refused)
        x = m.embed[self.ids]
        for layer in range(c.num_layers):
            q, k, v = m.qkv(layer, x, cos, sin,
                            query_out=self.buffers.queries[layer, : self.B] if gated else None)
            self.kv[layer][0][blocks, within] = k
            self.kv[layer][1][blocks, within] = v
            if gated:
                table, used = self.view_table[layer, :, 0], self.view_used[layer, :, 0]
            else:
                table, used = self.table, self.ctx
            x = m.finish_layer(layer, x, self.attend_layer(layer, q, table, used, gated))
        lp = torch.log_softmax(m.logits(x), dim=-1)
        self.logp_out.copy_(lp.gather(1, self.targets[:, None])[:, 0])
        self.argmax_out.copy_(lp.argmax(-1))

    def _run_body(self, gated: bool) -> None:
        if not self.use_graphs:
            self._body(gated)
            return
        graph = self.graphs.get(gated)
        if graph is None:
            try:
                graph = self._capture(gated)
            except Exception as e:  # noqa: BLE001 - eager still measures something
                print(f"CUDA graph capture failed ({type(e).__name__}: {e}); running eager",
                      flush=True)
                self.use_graphs = False
                self._body(gated)
                return
            self.graphs[gated] = graph
        graph.replay()

    def _capture(self, gated: bool) -> Any:
        return self.capture_graph(lambda: self._body(gated))

    def capture_graph(self, work: Any) -> Any:
        """``work`` (CUDA launches on the current stream) captured as a CUDA graph."""
        # warm up on a side stream (torch's recipe), then capture on it. thread_local: the
        # watchdog may call CUDA meanwhile without breaking capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            work()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            ctx = torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local")
        except TypeError:  # older torch
            ctx = torch.cuda.graph(graph, stream=side)
        with ctx:
            work()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return graph

    @torch.inference_mode()
    def prepare_graphs(self, position: int) -> None:
        """Captures the dense and gated step graphs now, while nothing else runs (their
        warm-up writes K/V at ``position``, which the decode rewrites before reading)."""
        if not self.use_graphs:
            return
        self.pos.fill_(position)
        self.ctx.fill_(position + 1)
        self.buffers.visit_count.fill_(-1)  # dense lists: valid whatever epsd wrote before
        # load the kernels that run outside the graphs now: a first launch under lazy loading
        # can stall while the stream waits on a counter
        mark = torch.zeros(1, dtype=torch.bool, device=self.device)
        torch.lt(self.buffers.visit_count[0, 0], 0, out=mark[0])
        self.ids.copy_(self.argmax_out)
        self.logp_out.copy_(self.logp_out)
        for gated in (False, True):
            if gated not in self.graphs:
                try:
                    self.graphs[gated] = self._capture(gated)
                except Exception as e:  # noqa: BLE001 - eager still measures something
                    print(f"CUDA graph capture failed ({type(e).__name__}: {e}); eager",
                          flush=True)
                    self.use_graphs = False
                    return
        torch.cuda.synchronize(self.device)

    # -- a decode run ------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, inputs: torch.Tensor, targets: torch.Tensor | None, start: int,
               gated: bool, options: SelectOptions | None = None, greedy: bool = False,
               on_step: Any = None, reuse: int = 1) -> RunRecord:
        """Decodes inputs.shape[1] steps from position ``start`` (teacher-forced on
        ``inputs``; greedy: feeds back the argmax). ``on_step(t)`` runs before step t.
        ``reuse`` k: one selection every k steps, step t reading the lists selected for step
        t - t % k (selection step number first_step + t - t % k), extended by the blocks
        written since (flash_attention_views); the steps between neither wait nor select."""
        # a list may gain REUSE_WINDOW_BLOCKS - 1 blocks: past that the views refuse it
        longest = (REUSE_WINDOW_BLOCKS - 1) * self.bs + 1
        if not 1 <= reuse <= longest:
            raise ValueError(f"reuse={reuse} not in [1, {longest}] (the views' reuse window "
                             f"at {self.bs}-token blocks)")
        rec = RunRecord(gated=gated, reuse=reuse)
        steps = inputs.shape[1]
        dev = self.device
        L = self.model.c.num_layers
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(5)] for _ in range(steps + 1)]
        marks = torch.zeros(steps, dtype=torch.bool, device=dev)
        logps = torch.zeros(self.B, steps, dtype=torch.float32, device=dev)
        argmaxes = torch.zeros(self.B, steps, dtype=torch.long, device=dev)
        base = rec.first_step = self.step_base
        releases = self.watchdog.releases if gated else 0
        self.step_base += steps + 2
        self.stream.wait_stream(torch.cuda.current_stream(dev))  # inputs made on the default
        with torch.cuda.stream(self.stream):
            sid = self.stream.cuda_stream
            self.refused.zero_()
            if gated and self.buffers.feedback is not None:
                # no entries from an earlier run (another query, maybe another position)
                self.buffers.feedback.fill_(float("nan"))
            if gated:
                self._select(rec, base, start + 1, options, sid)
            for t in range(steps):
                if on_step is not None:
                    on_step(t)
                pos = start + t
                if t >= 2:
                    ev[t - 2][2].synchronize()  # at most two steps ahead of the GPU
                h0 = time.perf_counter()  # host time to queue the step (the throttle excluded)
                if greedy and t > 0:
                    self.ids.copy_(self.argmax_out)
                else:
                    self.ids.copy_(inputs[:, t])
                if targets is not None:
                    self.targets.copy_(targets[:, t])
                self.pos.fill_(pos)
                self.ctx.fill_(pos + 1)
                ev[t][0].record()
                if gated and t % reuse == 0:
                    self.counters.wait_selection(sid, base + t)
                if gated:
                    torch.lt(self.buffers.visit_count[0, 0], 0, out=marks[t])
                ev[t][1].record()
                self._run_body(gated)
                ev[t][2].record()
                logps[:, t].copy_(self.logp_out)
                argmaxes[:, t].copy_(self.argmax_out)
                if gated:
                    self.queue.submit(self._step_appends(pos), _dtype_name(self.dtype), sid,
                                      base + t)
                    ev[t][3].record()
                    self.queue.wait(sid, base + t)
                    ev[t][4].record()
                    if t + 1 < steps and (t + 1) % reuse == 0:
                        self._select(rec, base + t + 1, pos + 2, options, sid)
                else:
                    ev[t][3].record()
                    ev[t][4].record()
                rec.host_ms.append((time.perf_counter() - h0) * 1e3)
            ev[steps][0].record()
        self.stream.synchronize()  # every step's selection_done came, or its release
        if gated:
            rec.watchdog_releases = self.watchdog.releases - releases
        for t in range(steps):
            rec.step_ms.append(ev[t][0].elapsed_time(ev[t + 1][0]))
            rec.wait_selection_ms.append(ev[t][0].elapsed_time(ev[t][1]))
            rec.graph_ms.append(ev[t][1].elapsed_time(ev[t][2]))
            rec.wait_summaries_ms.append(ev[t][3].elapsed_time(ev[t][4]))
        rec.dense_marks = marks.cpu().tolist() if gated else []
        rec.refused_lists = int(self.refused.item()) if gated else 0
        rec.logp, rec.argmax = logps.cpu(), argmaxes.cpu()
        if gated:
            try:
                self.queue.drain()
            except EngineLibError as e:  # DATA_LOSS: appends skipped, counted just below
                if e.code != 15:
                    raise
            errors, rec.summary_error = self.queue.errors()  # counted since the queue began
            rec.summary_errors = errors - self._summary_errors_seen
            self._summary_errors_seen = errors
            # a final sync step collects the statistics of the last async steps
            done = self.client.select_pages(self.step_base, self._rows(start + steps), options)
            self.step_base += 1
            rec.stats += [s for s in done.earlier]
        del L
        return rec

    def _release_dense(self, step: int) -> None:
        """A fallback: released on the engine's stream, ahead of its wait for ``step``."""
        self.counters.release_dense(step, self.stream.cuda_stream)

    def _rows(self, context: int) -> list[Row]:
        return [Row(b, context, b) for b in range(self.B)]

    def _select(self, rec: RunRecord, step: int, context: int, options: SelectOptions | None,
                stream: int) -> None:
        """inputs_ready = step on the stream, then SelectPages(step) with an async reply."""
        self.counters.signal_inputs_ready(stream, step)
        result = self.client.select_pages(step, self._rows(context), options, async_reply=True)
        rec.stats += result.earlier
        if result.ok:
            self.watchdog.arm(step)
            rec.accepted_steps.append(step)
            rec.rtt_us.append(result.round_trip_us)
        else:  # on_fallback already released the step densely
            rec.fallback_steps.append(step)
            key = f"{result.code.name}: {result.message[:80]}"
            rec.fallback_reasons[key] = rec.fallback_reasons.get(key, 0) + 1

    # -- measurements around the loop --------------------------------------------------------

    def select_sync(self, context: int, options: SelectOptions) -> StepStats | None:
        """One synchronous selection at ``context`` (calibration); None on a fallback."""
        result = self.client.select_pages(self.step_base, self._rows(context), options)
        self.step_base += 1
        return result.stats if result.ok else None

    def snapshot(self) -> BufferSnapshot:
        """The shared state every run starts from (engine_snapshot.py), taken once everything
        queued before it (prefill, prompt summaries) has landed."""
        saved = BufferSnapshot.take(self.buffers)
        torch.cuda.synchronize(self.device)
        return saved

    def restore(self, saved: BufferSnapshot) -> None:
        """Puts the state back; synchronised, since a sync selection (calibration) may follow
        at once and epsd reads from its own process (docs/api-memory.md: inputs must have
        landed)."""
        saved.restore(self.buffers)
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        try:
            self.client.detach()
        except Exception:  # noqa: BLE001 - epsd may be gone (kill -9 run)
            pass
        self.client.close()
        torch.cuda.synchronize(self.device)
        # Closes the watchdog, the counters, the queue and the writer first (newest first).
        self.buffers.close()


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16",
            torch.float32: "float32"}[dtype]
