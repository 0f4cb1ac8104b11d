"""The reference engine's four modes (speed, quality, passkey, kill) over engine_loop."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from engine_loop import PagedEngine
from engine_model import LLAMA3_8B_SHAPE, SMALL_SHAPE, Model
from engine_report import (
    account_fallbacks,
    attention_limit_ms,
    delta_ppl_percent,
    gating,
    markdown,
    ran_gated,
    summarize,
)
from engine_timing import attention_ms, sdpa_attention_ms
from reference_engine import fractions, kill_epsd, now, restart_epsd

from eps_client import MassSetting, ModelLayout, SelectOptions, SummaryFeatures


def _layout(model: Model, args: argparse.Namespace) -> ModelLayout:
    # questclt (the default method) and quest need the per-channel min/max in the records;
    # with --quest8 questclt reads their 8-bit copy instead (half the bytes); with
    # --quest8-only the records hold that copy alone (method=quest is then refused)
    only8 = getattr(args, "quest8_only", False)
    return ModelLayout(num_layers=model.c.num_layers, num_q_heads=model.c.num_q_heads,
                       num_kv_heads=model.c.num_kv_heads, head_dim=model.c.head_dim,
                       block_size=16, group_blocks=args.group_blocks,
                       coarse_blocks=getattr(args, "coarse_blocks", 0),
                       sketch_dim=args.sketch_dim, phi_seed=0x5EED, kv_dtype="bfloat16",
                       features=SummaryFeatures(key_sum=not only8, quest=not only8,
                                                quest8=args.quest8 or only8))


def _coarse_c(args: argparse.Namespace) -> float | None:
    """SelectOptions.coarse_candidates: --coarse-candidates with a coarse level, else epsd's."""
    return args.coarse_candidates if getattr(args, "coarse_blocks", 0) else None


def _engine(model: Model, args: argparse.Namespace, batch: int, max_context: int,
            select: SelectOptions | None = None) -> PagedEngine:
    device = torch.device("cuda")
    return PagedEngine(model, _layout(model, args), batch=batch, max_context=max_context,
                       target=args.epsd_target,
                       select=select or SelectOptions(first_n=args.first_n, last_n=args.last_n,
                                                      granularity="union",
                                                      coarse_candidates=_coarse_c(args)),
                       deadline_s=args.deadline_ms / 1e3, watchdog_s=args.watchdog_ms / 1e3,
                       device=device, dtype=torch.bfloat16, seed=args.seed,
                       use_graphs=not args.no_graphs, feedback=getattr(args, "feedback", False))


def _common(engine: PagedEngine, args: argparse.Namespace) -> dict[str, Any]:
    return {"date": now(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "model": engine.model.c.name, "attention": engine.attention_name,
            "cuda_graphs": engine.use_graphs, "batch": engine.B, "prompt_tokens": args.context,
            "decode_steps": args.decode_steps, "warmup_steps": args.warmup_steps,
            "group_blocks": args.group_blocks, "sketch_dim": args.sketch_dim,
            "coarse_blocks": getattr(args, "coarse_blocks", 0),
            "coarse_candidates": _coarse_c(args),
            "feedback": getattr(args, "feedback", False),
            "list_budget": getattr(args, "list_budget", False),
            "mass_layers": getattr(args, "mass_layers", None),
            "attention_variant": os.environ.get("EPS_ATTN_VARIANT", "auto"),
            "session_method": engine.client.attach_info.options.method
            if engine.client.attach_info else None}


def calibrate(engine: PagedEngine, context: int, target: float,
              base: SelectOptions) -> tuple[int, float]:
    """The top_pages whose measured fraction of blocks read is closest to ``target``."""
    groups = -(-context // engine.eps_model.group_tokens)
    cache: dict[int, float] = {}

    def frac(k: int) -> float:
        # A selection that fell back (None) says nothing about k: try again, and stop the
        # run rather than let the search read it as "below the target" (on 2026-11-26 a
        # coarse-level run's search for 0.25 ended at top_pages 1025, 100 % read, that way).
        for _ in range(3):
            if k in cache:
                break
            st = engine.select_sync(context, _at(base, k))
            if st is not None and st.pages_total:
                cache[k] = st.pages_visited / st.pages_total
        if k not in cache:
            raise RuntimeError(f"calibration: three selections at top_pages={k} fell back")
        return cache[k]

    lo, hi = 1, groups
    while lo < hi:  # smallest k with frac(k) >= target (frac grows with k)
        mid = (lo + hi) // 2
        if frac(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    best = min((k for k in (lo - 1, lo) if k >= 1), key=lambda k: abs(frac(k) - target))
    return best, frac(best)


def _base(args: argparse.Namespace) -> SelectOptions:
    """The runs' options before their budget value: with --list-budget, the list-level rule
    (budget mass over the list at τ = 1, its floor and ceiling the budget value: the n
    groups of the largest summed softmax shares of the list's heads; docs/policy-selection.md)."""
    base = SelectOptions(first_n=args.first_n, last_n=args.last_n,
                         coarse_candidates=_coarse_c(args))
    if getattr(args, "list_budget", False):
        base = _with(base, budget="mass", mass_scope="list", mass_temperature=1.0,
                     mass_target=1.0)
    if getattr(args, "mass_layers", None):
        base = _with(base, **_mass_layers(args))
    return base


def _mass_layers(args: argparse.Namespace) -> dict[str, Any]:
    """--mass-layers FILE:KEY: the adaptive budget with the per-layer settings that
    eps_eval.layer_calibration --emit wrote (KEY e.g. "fbm-questclt g=8"), each layer's floor
    (a share of its unforced groups) turned into min_pages at the prompt's length."""
    path, _, key = args.mass_layers.partition(":")
    data = json.loads(Path(path).read_text())
    # "_" may stand for a space (scripts/engine_gpu.sh splits EPS_ENGINE_ARGS on spaces)
    layers = data["settings"].get(key) or data["settings"][key.replace("_", " ")]
    groups = -(-args.context // (16 * args.group_blocks))
    unforced = max(1, groups - args.first_n - args.last_n)
    return {"budget": "mass", "mass_scope": data["mass_scope"],
            "mass_layers": [MassSetting(target=v["mass_target"],
                                        temperature=v["mass_temperature"],
                                        min_pages=round(v["floor"] * unforced))
                            for _, v in sorted(layers.items(), key=lambda kv: int(kv[0]))]}


def _at(options: SelectOptions, k: int) -> SelectOptions:
    """options at budget value k: top_pages (per head), and with the list-level rule also
    its floor and ceiling (per list; the coarse level names candidates from top_pages)."""
    if options.mass_layers:  # the adaptive budget: the budget value is not used
        return options
    if options.budget == "mass" and options.mass_scope == "list":
        return _with(options, top_pages=k, min_pages=k, max_pages=k)
    return _with(options, top_pages=k)


def _with(options: SelectOptions, **changes: Any) -> SelectOptions:
    from dataclasses import replace

    return replace(options, **changes)


def run_speed(args: argparse.Namespace, kill: bool = False) -> dict[str, Any]:
    config = LLAMA3_8B_SHAPE if args.model == "llama3-8b-random" else SMALL_SHAPE
    model = Model.random(config, torch.device("cuda"), torch.bfloat16, seed=args.seed)
    P, N = args.context, args.decode_steps
    engine = _engine(model, args, args.batch, P + N + 4)
    engine.prepare_graphs(P)  # first: its warm-up steps write junk K/V and queries
    engine.fill_random(P)
    engine.write_prompt_summaries(P)
    engine.client.attach()
    g = torch.Generator(device="cuda")
    g.manual_seed(args.seed)
    ids = torch.randint(0, config.vocab, (args.batch, N + 1), device="cuda", generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    common = _common(engine, args)
    saved = engine.snapshot()
    base = _base(args)
    if kill:
        return _kill_run(engine, args, inputs, targets, base, common)
    dense = engine.decode(inputs, targets, P, gated=False)
    d = summarize(dense, args.warmup_steps)
    # at P + N, the context of the lists the gated runs' attention is timed with (the last
    # sync step's), so that dense and gated attention read the same context
    dense_attn = attention_ms(engine, False, P + N)
    sdpa_attn = sdpa_attention_ms(engine, P + N)
    rows = [["dense", "100%", "-", d["step_ms_p50"], d["step_ms_p95"], d["step_ms_mean"],
             dense_attn, "-", "-",
             "-", "-", "-", d["host_ms_p50"], "-", "-", "-", "-", "-", "-"]]
    runs = []
    for f, k in ((f, k) for f in fractions(args.fractions) for k in args.reuse):
        engine.restore(saved)
        top, measured = calibrate(engine, P + 1, f, base)
        gated = engine.decode(inputs, targets, P, gated=True, options=_at(base, top), reuse=k)
        s = summarize(gated, args.warmup_steps)
        attn = attention_ms(engine, True, P + N)
        # The same pre-pass on the same buffers with the engine idle: synchronous
        # selections with nothing else on the GPU (docs/benchmarks/gpu-history-2026-11-25-26.md,
        # "2026-11-25").
        idle = [st.prepass_us for st in
                (engine.select_sync(P + N, _at(base, top)) for _ in range(12)) if st]
        limit = attention_limit_ms(d["step_ms_p50"], dense_attn, s["pages_read_fraction"])
        s.update({"target_fraction": f, "reuse": k, "top_pages": top,
                  "calibrated_fraction": measured,
                  "attention_ms": attn, "limit_ms": limit,
                  "prepass_idle_us_p50": statistics.median(idle) if idle else math.nan,
                  "p50_vs_dense": s["step_ms_p50"] / d["step_ms_p50"] - 1.0,
                  "mean_vs_dense": s["step_ms_mean"] / d["step_ms_mean"] - 1.0,
                  **gating(gated), "fallback_reasons": gated.fallback_reasons,
                  "summary_errors": gated.summary_errors, "summary_error": gated.summary_error})
        runs.append(s)
        rows.append([f"gated {f:.3g}" + (f" reuse {k}" if k > 1 else ""),
                     f"{100 * s['pages_read_fraction']:.1f}%", top,
                     s["step_ms_p50"], s["step_ms_p95"], s["step_ms_mean"], attn,
                     s["wait_selection_ms_mean"],
                     s["wait_summaries_ms_p50"], s["prepass_us_p50"], s["prepass_idle_us_p50"],
                     s["rpc_us_p50"],
                     s["host_ms_p50"], limit, s["fallbacks"], s["dense_steps"],
                     s["watchdog_releases"], s["device_errors"], s["refused_lists"]])
    engine.close()
    table = markdown(["run", "blocks read", "top_pages", "step p50 ms", "step p95 ms",
                      "step mean ms", "attention ms", "wait sel ms (mean)", "wait sum ms",
                      "pre-pass us", "pre-pass idle us", "RPC us",
                      "host ms", "limit ms", "fallbacks", "dense steps", "watchdog releases",
                      "device errors", "refused lists"], rows)
    title = (f"speed: {common['model']}, batch {args.batch} x {P} tokens, {N} steps "
             f"({args.warmup_steps} warm-up), {common['device']}, {common['date']}; "
             f"SDPA dense attention {sdpa_attn:.3f} ms/step (one layer x {config.num_layers})")
    ok = all(ran_gated(r) for r in runs)
    return {"common": common, "dense": d, "dense_attention_ms": dense_attn,
            "sdpa_attention_ms": sdpa_attn, "gated": runs, "ok": ok,
            "table": title + "\n" + table}


def _kill_run(engine: PagedEngine, args: argparse.Namespace, inputs: torch.Tensor,
              targets: torch.Tensor, base: SelectOptions, common: dict[str, Any]
              ) -> dict[str, Any]:
    P = args.context
    top, _ = calibrate(engine, P + 1, fractions(args.fractions)[0], base)
    events: list[str] = []
    restarted: list[float] = []

    def on_step(t: int) -> None:
        if t == args.kill_at:
            events.append(f"step {t}: kill -9 epsd (pid {kill_epsd(args)})")
        elif t == args.restart_at:
            took = restart_epsd(args)
            restarted.append(time.monotonic())
            events.append(f"step {t}: epsd restarted (listening after {took:.2f} s)")
        elif restarted and len(restarted) == 1 and engine.client.session_id:
            restarted.append(time.monotonic())
            events.append(f"step {t}: re-attached {restarted[1] - restarted[0]:.3f} s after "
                          "epsd was listening")

    first = engine.step_base
    run = engine.decode(inputs, targets, P, gated=True, options=_at(base, top),
                        on_step=on_step)
    counters = engine.client.counters()
    releases = engine.watchdog.releases
    device_errors = sum(1 for s in run.stats if s.error)
    acc = account_fallbacks(run.fallback_steps, run.accepted_steps, first, run.dense_marks,
                            releases, device_errors)
    selected_after = [s for s in run.accepted_steps if s >= first + args.restart_at]
    acc.update({"client_counters": vars(counters), "events": events,
                "reattaches": counters.reattaches,
                "steps_selected_after_restart": len(selected_after),
                "refused_lists": run.refused_lists,
                "fallback_reasons": run.fallback_reasons,
                "summary_errors": run.summary_errors, "summary_error": run.summary_error,
                "steps": len(run.step_ms), "step_ms_p50": float(np.median(run.step_ms)),
                "step_ms_max": float(np.max(run.step_ms))})
    ok = bool(acc["ok"]) and counters.reattaches >= 1 and len(selected_after) > 0 \
        and len(run.step_ms) == inputs.shape[1] and run.refused_lists == 0
    acc["ok"] = ok
    engine.close()
    table = markdown(
        ["steps", "dense steps", "client fallbacks", "accepted then released",
         "watchdog releases", "re-attaches", "selected after restart", "unexplained",
         "refused lists", "ok"],
        [[acc["steps"], acc["dense_steps"], acc["client_fallbacks"],
          acc["accepted_then_released"], releases, counters.reattaches, len(selected_after),
          len(acc["unexplained_dense_steps"]), run.refused_lists, ok]])
    title = (f"kill -9: {common['model']}, batch {args.batch} x {P} tokens, epsd killed at "
             f"step {args.kill_at}, restarted at {args.restart_at}; {'; '.join(events)}")
    return {"common": common, "kill": acc, "ok": ok, "table": title + "\n" + table}


def _text_tokens(tokenizer: Any, need: int, rows: int) -> np.ndarray:
    import sysconfig
    from pathlib import Path

    lib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for path in sorted(lib.glob("*.py")):
        ids += tokenizer.encode(path.read_text(errors="replace"))
        if len(ids) >= need * rows:
            break
    if len(ids) < need * rows:
        raise SystemExit(f"corpus too short: {len(ids)} tokens for {rows} x {need}")
    return np.array(ids[: need * rows]).reshape(rows, need)


def run_quality(args: argparse.Namespace) -> dict[str, Any]:
    from gguf_llama import ByteBpeTokenizer

    model, reader = Model.from_gguf(args.gguf, torch.device("cuda"), torch.bfloat16)
    P, N = args.context, args.decode_steps
    seqs = torch.from_numpy(_text_tokens(ByteBpeTokenizer(reader), P + N + 1, args.batch)).cuda()
    engine = _engine(model, args, args.batch, P + N + 4)
    engine.prepare_graphs(P)  # first: its warm-up steps write junk K/V and queries
    engine.prefill(seqs[:, :P])
    engine.write_prompt_summaries(P)
    engine.client.attach()
    saved = engine.snapshot()
    inputs, targets = seqs[:, P:-1], seqs[:, P + 1 :]
    common = _common(engine, args)
    dense = engine.decode(inputs, targets, P, gated=False)
    dense_nll = -dense.logp.double().mean().item()
    base = _base(args)
    engine.restore(saved)
    off = engine.decode(inputs, targets, P, gated=True, options=_with(base, method="off"))
    off_delta = (off.logp - dense.logp).abs().max().item()
    off_gating = gating(off)  # method=off visits every group: lists, not dense releases
    rows, runs = [], []
    for method, top, k in ((m, int(t), k) for m in args.methods.split(",")
                           for t in args.top_pages.split(",") for k in args.reuse):
        engine.restore(saved)
        gated = engine.decode(inputs, targets, P, gated=True,
                              options=_at(_with(base, method=method), top), reuse=k)
        s = summarize(gated, 0)  # blocks read over every step, as Δ NLL counts them
        dnll = -gated.logp.double().mean().item() - dense_nll
        agree = (gated.argmax == dense.argmax).double().mean().item()
        r = {"method": method, "top_pages": top, "reuse": k,
             "blocks_read": s["pages_read_fraction"], "delta_nll_per_token": dnll,
             "delta_ppl_percent": delta_ppl_percent(dnll), "top1_agreement": agree,
             **gating(gated)}
        runs.append(r)
        meets = abs(r["delta_ppl_percent"]) <= 1.0 and agree >= 0.95 and \
            r["blocks_read"] <= 0.5
        rows.append([method, top, k, f"{100 * r['blocks_read']:.1f}%", dnll,
                     r["delta_ppl_percent"], agree, r["fallbacks"], r["dense_steps"],
                     r["watchdog_releases"], r["device_errors"], r["refused_lists"],
                     "yes" if meets else ""])
    engine.close()
    table = markdown(["method", "top_pages", "reuse", "blocks read", "Δ NLL/token", "Δ ppl %",
                      "top-1 agreement", "fallbacks", "dense steps", "watchdog releases",
                      "device errors", "refused lists", "meets (≤50% read, |Δppl|≤1%, ≥95%)"],
                     rows)
    title = (f"quality: {common['model']}, batch {args.batch} x {P} tokens of Python stdlib "
             f"source, {N} teacher-forced steps, {common['device']}, {common['date']}; dense "
             f"NLL/token {dense_nll:.4f}; method=off max |Δ logp| {off_delta:.3g} "
             f"({off_gating['dense_steps']} dense steps, {off_gating['watchdog_releases']} "
             f"watchdog releases, {off_gating['device_errors']} device errors)")
    # every gated step, method=off's too, must have run with epsd's lists
    ok = off_delta == 0.0 and ran_gated(off_gating) and all(ran_gated(r) for r in runs)
    return {"common": common, "dense_nll_per_token": dense_nll,
            "off_max_abs_delta_logp": off_delta, "off": off_gating, "gated": runs, "ok": ok,
            "table": title + "\n" + table}


def run_passkey(args: argparse.Namespace) -> dict[str, Any]:
    from gguf_llama import ByteBpeTokenizer

    model, reader = Model.from_gguf(args.gguf, torch.device("cuda"), torch.bfloat16)
    tok = ByteBpeTokenizer(reader)
    P, n, gen = args.context, args.passkeys, 8
    rng = np.random.default_rng(args.seed)
    filler = tok.encode("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                        "There and back again. " * 12)
    question = tok.encode("\nWhat is the pass key? The pass key is")
    keys = [int(k) for k in rng.integers(10000, 99999, size=n)]
    prompts = []
    for i, key in enumerate(keys):
        needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        body = P - len(question) - len(needle)
        hay = (filler * (body // len(filler) + 1))[:body]
        depth = int(body * (0.1 + 0.8 * i / max(n - 1, 1)))
        prompts.append(hay[:depth] + needle + hay[depth:] + question)
    tokens = torch.tensor(prompts, device="cuda")
    engine = _engine(model, args, n, P + gen + 4)
    engine.prepare_graphs(P - 1)  # first: its warm-up steps write junk K/V and queries
    # prefill all but the last prompt token; decoding starts by feeding it at P - 1
    engine.prefill(tokens[:, :-1])
    engine.write_prompt_summaries(P - 1)
    engine.client.attach()
    saved = engine.snapshot()
    common = _common(engine, args)
    common["depths"] = "10-90 %"
    vocab = {i: t for t, i in tok.vocab.items()}
    inverse = {c: b for b, c in tok.byte_map.items()}

    def text(ids: list[int]) -> str:
        return bytes(inverse.get(ch, 32) for i in ids for ch in vocab.get(i, "")).decode(
            errors="replace")

    start = tokens[:, -1:].expand(n, gen).contiguous()

    def accuracy(run: Any) -> tuple[float, list[str]]:
        # greedy: step 0 feeds the prompt's last token at position P - 1, then each argmax
        outs = [text(run.argmax[i].tolist()) for i in range(n)]
        return sum(str(k) in o for k, o in zip(keys, outs, strict=True)) / n, outs

    dense = engine.decode(start, None, P - 1, gated=False, greedy=True)
    d_acc, d_out = accuracy(dense)
    rows = [["dense", "-", "-", "100%", d_acc, "-", "-", "-", "-", "-"]]
    runs = [{"method": "dense", "accuracy": d_acc, "outputs": d_out[:3]}]
    base = _base(args)
    for method, top, k in ((m, int(t), k) for m in args.methods.split(",")
                           for t in args.top_pages.split(",") for k in args.reuse):
        engine.restore(saved)
        run = engine.decode(start, None, P - 1, gated=True, greedy=True,
                            options=_at(_with(base, method=method), top), reuse=k)
        acc, outs = accuracy(run)
        frac = summarize(run, 0)["pages_read_fraction"]
        counts = gating(run)
        runs.append({"method": method, "top_pages": top, "reuse": k, "blocks_read": frac,
                     "accuracy": acc, **counts, "outputs": outs[:3]})
        rows.append([method, top, k, f"{100 * frac:.1f}%", acc, counts["fallbacks"],
                     counts["dense_steps"], counts["watchdog_releases"],
                     counts["device_errors"], counts["refused_lists"]])
    engine.close()
    table = markdown(["run", "top_pages", "reuse", "blocks read", "passkey accuracy", "fallbacks",
                      "dense steps", "watchdog releases", "device errors", "refused lists"],
                     rows)
    title = (f"passkey: {common['model']}, {n} prompts of {P} tokens, depths 10-90 %, greedy "
             f"{gen} tokens, {common['device']}, {common['date']}")
    ok = all(ran_gated(r) for r in runs[1:])  # runs[0] is dense
    return {"common": common, "runs": runs, "keys": keys, "ok": ok,
            "table": title + "\n" + table}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.mode == "speed":
        return run_speed(args)
    if args.mode == "kill":
        return run_speed(args, kill=True)
    if args.mode == "quality":
        return run_quality(args)
    return run_passkey(args)
