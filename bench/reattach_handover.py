"""How long a restarted engine waits to attach again when the server's memory budget is
nearly full of its own old session (cpu backend): one session fills --max-server-bytes,
the engine "restarts" (drops its channel without Detach, so the old session lives on
until its lease runs out) and attaches again with the same engine_id, retrying every
--retry-ms while epsd answers RESOURCE_EXHAUSTED, as a client that falls back would.
Prints, per round, the time from the first try until an Attach succeeded and how many
tries were refused, then a summary and the other engine's wait (docs/api-failures.md 5.5).

  .venv/bin/python bench/reattach_handover.py --epsd build/service/epsd --rounds 5

Each Attach is a message of about 100 bytes: its summary pool is declared inline with no
data, so epsd allocates it zeroed, and the time is not a large message's transfer; the
first Attach, into an empty server, is timed too, as what any Attach of that size costs
without a hand-over. Before the rounds, another engine's Attach of the same size is
tried and should be RESOURCE_EXHAUSTED: the budget really has no room beside the old
session. After the rounds, that other engine
retries until it attaches: it gets no hand-over, so it waits out the last session's lease,
which is what a replacing Attach did before epsd let it use the replaced session's bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc
from local_epsd import LocalEpsd, inline_attach, pb, pb_grpc


def attach_until_ok(target: str, request: pb.AttachRequest, retry_s: float,
                    give_up_s: float) -> tuple[float, int, str]:
    """Attaches over a fresh channel until it succeeds: (seconds, refused tries, session)."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.PageSelectorStub(channel)
        start = time.monotonic()
        refused = 0
        while True:
            try:
                reply = stub.Attach(request, timeout=30)
                return time.monotonic() - start, refused, reply.session_id
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                refused += 1
                if time.monotonic() - start > give_up_s:
                    raise RuntimeError(f"still refused after {give_up_s} s: {e.details()}")
                time.sleep(retry_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsd", default="build/service/epsd")
    parser.add_argument("--server-mib", type=int, default=128, help="--max-server-bytes")
    parser.add_argument("--fill", type=float, default=0.9,
                        help="share of --max-server-bytes the engine's session takes")
    parser.add_argument("--lease-ms", type=int, default=10000)
    parser.add_argument("--retry-ms", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    flags = [f"--max-server-bytes={args.server_mib}M", f"--max-session-bytes={args.server_mib}M",
             f"--lease-ms={args.lease_ms}"]
    pool = int(args.fill * (args.server_mib << 20))
    engine = inline_attach("bench-engine", pool, send_pool=False)
    other = inline_attach("bench-other-engine", pool, send_pool=False)
    give_up_s = 2 * args.lease_ms / 1000 + 5
    times = []
    with LocalEpsd(args.epsd, flags) as epsd:
        print(f"epsd flags: {' '.join(flags)}; summary pool {pool} bytes, "
              f"Attach message {engine.ByteSize()} bytes")
        first, _, old = attach_until_ok(epsd.target, engine, 0, 0)
        print(f"first Attach (empty server, no hand-over): {first:.3f} s")
        with grpc.insecure_channel(epsd.target) as channel:
            try:
                pb_grpc.PageSelectorStub(channel).Attach(other, timeout=30)
                print("another engine's Attach: OK (the budget was not full)")
            except grpc.RpcError as e:
                print(f"another engine's Attach: {e.code().name}: {e.details()}")
        for i in range(args.rounds):
            seconds, refused, new = attach_until_ok(epsd.target, engine, args.retry_ms / 1000,
                                                    give_up_s)
            with grpc.insecure_channel(epsd.target) as channel:
                try:
                    pb_grpc.PageSelectorStub(channel).Heartbeat(
                        pb.HeartbeatRequest(session_id=old), timeout=30)
                    old_state = "old session still answers"
                except grpc.RpcError as e:
                    old_state = f"old session {e.code().name}"
            print(f"round {i + 1}: replacing Attach took {seconds:.3f} s, {refused} tries "
                  f"refused; {old_state}")
            times.append(seconds)
            old = new
        seconds, refused, _ = attach_until_ok(epsd.target, other, args.retry_ms / 1000,
                                              give_up_s)
    print(f"{len(times)} replacing Attaches: min {min(times):.3f} s, "
          f"median {statistics.median(times):.3f} s, max {max(times):.3f} s "
          f"(lease {args.lease_ms} ms)")
    print(f"another engine's Attach (no hand-over): {seconds:.3f} s, {refused} tries refused")


if __name__ == "__main__":
    main()
