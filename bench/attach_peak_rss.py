"""epsd's peak resident memory (VmHWM) before and after one Attach whose message carries
`--mib` MiB of inline summary-pool data (cpu backend): what receiving a large message
costs beyond the budgets, which charge the session's buffers but not the request
(docs/deploy.md, "Memory budgets"). Prints both peaks, the resident memory before (idle)
and after, the rise of the peak and its ratio to the message size, and how the Attach
ended.

  .venv/bin/python bench/attach_peak_rss.py --epsd build/service/epsd --mib 60 \\
      -- --max-server-bytes=1024M --max-session-bytes=512M

Flags after `--` go to epsd; with a --max-session-bytes below the pool the Attach is
refused (RESOURCE_EXHAUSTED) after the whole message was received, so the rise is the
message's alone; accepted, it includes the session's own copy of the pool.
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
    parser.add_argument("flags", nargs="*", help="epsd flags, after --")
    args = parser.parse_args()
    request = inline_attach("bench-peak-rss", args.mib << 20, send_pool=True)
    size = request.ByteSize()
    with LocalEpsd(args.epsd, args.flags) as epsd:
        time.sleep(1)  # let start-up allocations settle: a measurement pause, not a sync
        before, idle = epsd.status_kb("VmHWM"), epsd.status_kb("VmRSS")
        with grpc.insecure_channel(epsd.target) as channel:
            try:
                pb_grpc.PageSelectorStub(channel).Attach(request, timeout=60)
                outcome = "OK"
            except grpc.RpcError as e:
                outcome = f"{e.code().name}: {e.details()}"
        after = epsd.status_kb("VmHWM")
        rss = epsd.status_kb("VmRSS")
    rise = (after - before) << 10  # /proc's kB are KiB
    print(f"epsd flags: {' '.join(args.flags) or '(none)'}")
    print(f"Attach message: {size} bytes ({size / MIB:.1f} MiB); outcome: {outcome}")
    print(f"VmHWM before: {before} kB ({before / 1024:.1f} MiB); "
          f"after: {after} kB ({after / 1024:.1f} MiB)")
    print(f"VmRSS before: {idle} kB ({idle / 1024:.1f} MiB); "
          f"after: {rss} kB ({rss / 1024:.1f} MiB)")
    print(f"peak rise: {rise / MIB:.1f} MiB ({rise / 1e6:.0f} MB), "
          f"{rise / size:.2f} times the message")


if __name__ == "__main__":
    main()
