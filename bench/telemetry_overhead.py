"""SelectPages latency with tracing off, with the exporter pointed at a dead
endpoint, and with a live OTLP receiver: epsd (cpu backend) and the C++ client
(tests/service/observability_traffic), configurations interleaved round by
round so machine noise hits them alike. Prints p50/p99 of the client's round
trip per round and the median over rounds.

  .venv/bin/python bench/telemetry_overhead.py [--steps 2000] [--rounds 5] [--build build]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "service"))
from otlp_receiver import OtlpReceiver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_round(build: Path, env: dict[str, str], steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sock = f"unix://{tmp}/epsd.sock"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        full_env.update(env)
        epsd = subprocess.Popen(
            [
                str(build / "service/epsd"),
                f"--listen={sock}",
                "--backend=cpu",
                "--metrics-listen=127.0.0.1:0",
                f"--step-log={tmp}/steps.jsonl",
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        assert epsd.stderr is not None
        url = ""
        for line in epsd.stderr:  # ready once it says where it serves
            if m := re.search(r"metrics on (http://\S+)", line):
                url = m.group(1).rstrip(";")
                break
        out = subprocess.run(
            [
                str(build / "tests/service/observability_traffic"),
                f"--target={sock}",
                f"--steps={steps}",
                f"--seed={seed}",
                "--quiet",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # The service's own time per step (arrival to status), free of the client's scheduling.
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        series = 'grpc_method="SelectPages",grpc_service="eps.v1.PageSelector",grpc_type="unary"}'
        total = float(
            re.search(r"grpc_server_handling_seconds_sum\{" + series + r" (\S+)", text).group(1)
        )
        count = float(
            re.search(r"grpc_server_handling_seconds_count\{" + series + r" (\S+)", text).group(1)
        )
        epsd.send_signal(signal.SIGTERM)
        epsd.wait(timeout=30)
        summary = json.loads(out.splitlines()[-1])
        summary["server_mean_us"] = 1e6 * total / count
        # Per-step service time from the step log (written after SIGTERM flushed it).
        log = Path(f"{tmp}/steps.jsonl").read_text().splitlines()
        server = sorted(json.loads(line)["server_us"] for line in log)
        summary["server_p50_us"] = server[len(server) // 2]
        summary["server_p99_us"] = server[min(len(server) - 1, int(0.99 * len(server)))]
        return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--build", type=Path, default=Path("build"))
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    receiver = OtlpReceiver().start()
    configs = {
        "tracing off": {},
        "dead endpoint (grpc)": {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"},
        "dead endpoint (http)": {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        },
        "live receiver (grpc)": {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}"
        },
    }
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, env in configs.items():
            summary = run_round(args.build, env, args.steps, args.seed + r)
            assert summary["fallbacks"] == 0, summary
            results[name].append(summary)
            print(
                f"round {r + 1} {name:22s} p50 {summary['p50_us']:7.1f} us  "
                f"p99 {summary['p99_us']:7.1f} us  server p50 {summary['server_p50_us']} us "
                f"p99 {summary['server_p99_us']} us mean {summary['server_mean_us']:6.1f} us",
                flush=True,
            )
    receiver.stop()
    print(f"\n{args.steps} steps x {args.rounds} rounds, median over rounds:")
    print(
        "| configuration | client p50 (us) | client p99 (us) | server p50 (us) "
        "| server p99 (us) | server mean (us) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rounds in results.items():
        p50 = statistics.median(s["p50_us"] for s in rounds)
        p99 = statistics.median(s["p99_us"] for s in rounds)
        server = statistics.median(s["server_mean_us"] for s in rounds)
        s50 = statistics.median(s["server_p50_us"] for s in rounds)
        s99 = statistics.median(s["server_p99_us"] for s in rounds)
        print(f"| {name} | {p50:.1f} | {p99:.1f} | {s50} | {s99} | {server:.1f} |")


if __name__ == "__main__":
    main()
