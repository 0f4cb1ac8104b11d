"""epsd's peak resident memory (VmHWM) before and after one Attach whose message carries
`--mib` MiB of inline summary-pool data (cpu backend): what receiving a large message
costs beyond the budgets, which charge the session's buffers but not the request
(docs/deploy-operations.md, "Memory budgets"). Prints the peak and resident memory before (idle)
and after each Attach, the rise of the peak and its ratio to the message size, and how
the Attach ended; --count sends several, one after another on one channel.

  .venv/bin/python bench/attach_peak_rss.py --epsd build/service/epsd --mib 60 --count 8 \\
      -- --max-server-bytes=1024M --max-session-bytes=32M

Flags after `--` go to epsd; with a --max-session-bytes below the pool the Attach is
refused (RESOURCE_EXHAUSTED) after the whole message was received, so the rise is the
message's alone; accepted, it includes the session's own copy of the pool, and with
--count each Attach (one engine_id) replaces the last, so a hand-over holds two.
"""

from __future__ import annotations

import argparse
import time

import grpc
from local_epsd import LocalEpsd, inline_attach, pb_grpc

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsd", default="build/service/epsd")
    parser.add_argument("--mib", type=int, default=60, help="inline data in the Attach")
    parser.add_argument("--count", type=int, default=1,
                        help="Attaches sent one after another; the peak is read after each")
    parser.add_argument("flags", nargs="*", help="epsd flags, after --")
    args = parser.parse_args()
    request = inline_attach("bench-peak-rss", args.mib << 20, send_pool=True)
    size = request.ByteSize()
    print(f"epsd flags: {' '.join(args.flags) or '(none)'}")
    print(f"Attach message: {size} bytes ({size / MIB:.1f} MiB)")
    with LocalEpsd(args.epsd, args.flags) as epsd:
        time.sleep(1)  # let start-up allocations settle: a measurement pause, not a sync
        before, idle = epsd.status_kb("VmHWM"), epsd.status_kb("VmRSS")
        print(f"before: VmHWM {before} kB ({before / 1024:.1f} MiB), "
              f"VmRSS {idle} kB ({idle / 1024:.1f} MiB)")
        with grpc.insecure_channel(epsd.target) as channel:
            stub = pb_grpc.PageSelectorStub(channel)
            for i in range(args.count):
                try:
                    stub.Attach(request, timeout=60)
                    outcome = "OK"
                except grpc.RpcError as e:
                    outcome = e.code().name
                    if i == 0:
                        print(f"Attach 1: {outcome}: {e.details()}")
                after, rss = epsd.status_kb("VmHWM"), epsd.status_kb("VmRSS")
                rise = (after - before) << 10  # /proc's kB are KiB
                print(f"after Attach {i + 1} ({outcome}): VmHWM {after} kB "
                      f"({after / 1024:.1f} MiB), VmRSS {rss} kB ({rss / 1024:.1f} MiB); "
                      f"peak rise {rise / MIB:.1f} MiB ({rise / 1e6:.0f} MB), "
                      f"{rise / size:.2f} times the message")


if __name__ == "__main__":
    main()
