#!/usr/bin/env python3
"""How long the running step's reply takes with a second step parked behind it, against the
same step alone: the real epsd (cpu backend, shm buffers), its steps sent over the Python
stubs, the parked one from a second channel (docs/design.md, SelectPages).

    .venv/bin/python bench/parked_reply_latency.py --epsd build/service/epsd

A measurement, not a test: it prints the medians and exits 0."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from local_epsd import (  # puts the repository's client on sys.path
    LocalEpsd,
    pb,
    pb_grpc,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client" / "python" / "tests"))
from engine_state import make_state
from eps_client import ModelLayout
from eps_client.requests import attach_request


def model(layers: int) -> ModelLayout:
    """A 70B-like layout: with two rows of 4,000 tokens a cpu step takes about 0.35 s on a
    2-core machine with 80 layers."""
    return ModelLayout(num_layers=layers, num_q_heads=32, num_kv_heads=8, head_dim=128,
                       block_size=16, group_blocks=1, sketch_dim=8, phi_seed=1234)

DEADLINE_S = 30.0


def step_request(session: str, step: int, rows: list[tuple[int, int, int]]) -> pb.SelectPagesRequest:
    return pb.SelectPagesRequest(
        session_id=session, step=step,
        rows=[pb.BatchRow(table_row=r, context_tokens=c, seq_id=s) for r, c, s in rows])


def timed(stub: pb_grpc.PageSelectorStub, request: pb.SelectPagesRequest) -> float:
    """Seconds from sending `request` to its reply (which must be OK)."""
    start = time.perf_counter()
    stub.SelectPages(request, timeout=DEADLINE_S)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsd", default="build/service/epsd", help="the epsd binary")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4000, 4000],
                    help="tokens of each row (at most 8,192 in all: engine_state's blocks)")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--park-after-s", type=float, default=0.05,
                    help="how long after the running step the parked one is sent")
    args = ap.parse_args()
    with LocalEpsd(args.epsd, []) as epsd:
        target = epsd.target
        state = make_state(np.random.default_rng(1), contexts=args.contexts,
                           max_context=max(args.contexts), model=model(args.layers))
        with grpc.insecure_channel(target) as first, grpc.insecure_channel(target) as second:
            grpc.channel_ready_future(first).result(timeout=10)
            grpc.channel_ready_future(second).result(timeout=10)
            running, parking = pb_grpc.PageSelectorStub(first), pb_grpc.PageSelectorStub(second)
            session = running.Attach(attach_request(state.buffers, engine_id="parked-latency"),
                                     timeout=DEADLINE_S).session_id
            step = 0

            def next_request() -> pb.SelectPagesRequest:
                nonlocal step
                step += 1
                return step_request(session, step, state.rows)

            timed(running, next_request())  # warm-up
            alone = [timed(running, next_request()) for _ in range(args.reps)]
            with_parked: list[float] = []
            parked: list[float] = []
            for _ in range(args.reps):
                head, behind = next_request(), next_request()
                thread = threading.Thread(
                    target=lambda r=head: with_parked.append(timed(running, r)))
                thread.start()
                time.sleep(args.park_after_s)  # the running step has started meanwhile
                parked.append(timed(parking, behind))
                thread.join()
        print(f"{time.strftime('%Y-%m-%d %H:%M')} load average {os.getloadavg()}, "
              f"{os.cpu_count()} cpus, contexts {args.contexts}, {args.layers} layers, {args.reps} reps; medians:")
        print(f"running step alone:             {statistics.median(alone):.3f} s")
        print(f"running step, one parked behind: {statistics.median(with_parked):.3f} s")
        print(f"the parked step (sent {args.park_after_s} s later): "
              f"{statistics.median(parked):.3f} s")
        state.buffers.close()


if __name__ == "__main__":
    main()
