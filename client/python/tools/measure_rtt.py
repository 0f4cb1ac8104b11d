#!/usr/bin/env python3
"""Round trips of EpsClient.select_pages against a real epsd (cpu backend, shm buffers), unary
and stream, with no client deadline to speak of: the distribution that the default deadline
is chosen from (docs/integration/python-client.md).

    EPSD_BIN=build/service/epsd PYTHONPATH=client/python/src:client/python/tests \
        python3 client/python/tools/measure_rtt.py --steps 2000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from engine_state import make_state

from eps_client import ClientOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="eps-rtt-"))
    target = f"unix://{folder}/epsd.sock"
    epsd = subprocess.Popen([os.environ["EPSD_BIN"], f"--listen={target}", "--backend=cpu",
                             "--metrics-listen=off"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(target) as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
        state = make_state(np.random.default_rng(1), contexts=[900, 517, 1000])
        print(f"{time.strftime('%Y-%m-%d %H:%M')} load average {os.getloadavg()}, "
              f"{os.cpu_count()} cpus, {args.steps} steps each")
        for use_stream in (False, True):
            with state.client(ClientOptions(target=target, deadline_s=1.0,
                                            use_stream=use_stream)) as client:
                client.attach()
                rtt = np.array([client.select_pages(s, state.rows).round_trip_us
                                for s in range(1, args.steps + 1)]) / 1e3
            q = np.percentile(rtt, [50, 90, 99, 99.9, 100])
            print(f"{'stream' if use_stream else 'unary ':6s} ms: p50 {q[0]:.2f}  p90 {q[1]:.2f}"
                  f"  p99 {q[2]:.2f}  p99.9 {q[3]:.2f}  max {q[4]:.2f}"
                  f"  over 20 ms: {(rtt > 20).sum()}  over 50 ms: {(rtt > 50).sum()}")
        state.buffers.close()
    finally:
        epsd.kill()
        epsd.wait()


if __name__ == "__main__":
    main()
