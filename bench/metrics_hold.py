"""Scrape latency of epsd's /metrics while other clients hold connections to it: HOLDERS
threads each connect, send nothing and wait for the server to close the connection, then
connect again at once (so HOLDERS connections are held open all the time); meanwhile this
scrapes /metrics back to back and prints each scrape's time, then a summary.

  epsd --backend=cpu --metrics-listen=127.0.0.1:9464 &
  .venv/bin/python bench/metrics_hold.py --port 9464 --holders 64 --seconds 30
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time


def hold(port: int, stop: float) -> None:
    while time.monotonic() < stop:
        try:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.settimeout(max(0.1, stop - time.monotonic()))
                s.recv(16)  # returns when the server closes the connection
        except OSError:
            time.sleep(0.05)


def scrape(port: int) -> tuple[float, int]:
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(120)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        size = 0
        while chunk := s.recv(65536):
            size += len(chunk)
    return time.monotonic() - start, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--holders", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30)
    args = parser.parse_args()
    stop = time.monotonic() + args.seconds
    for _ in range(args.holders):
        threading.Thread(target=hold, args=(args.port, stop), daemon=True).start()
    time.sleep(1)  # let the holders connect: a warm-up, not a synchronisation
    times = []
    while time.monotonic() < stop - 1:
        seconds, size = scrape(args.port)
        times.append(seconds)
        print(f"scrape: {seconds:.2f} s, {size} bytes", flush=True)
    if times:
        print(
            f"{len(times)} scrapes with {args.holders} holders: min {min(times):.2f} s, "
            f"median {statistics.median(times):.2f} s, max {max(times):.2f} s"
        )


if __name__ == "__main__":
    main()
