#!/usr/bin/env python3
"""A randomized chaos run against one real epsd on the cpu backend (docs/security.md, "Chaos run").

One epsd with small limits; around it, for ``--duration`` seconds, a changing population of
engine processes, each with its own shared buffers and EpsClient (client/python):

- ``steady`` engines (well behaved: a step every 50 ms with a 2 s deadline, stream or unary,
  heartbeats when idle): every step must get a selection, every list within the block table;
- ``chaos`` engines, each life a random script of: steps (stream, unary, async), deadlines of
  1 ms, detach and re-attach, a second client replacing the session, a pause past the lease,
  several unary steps in flight, cancelled streams and calls, Attach calls abandoned mid-build,
  malformed requests (random bytes, out-of-range fields, bad shm names), a shrunk shm object,
  and SIGKILL of itself mid-step or mid-Attach;
- one ``intruder`` of another user (uid 65534) that names the others' session ids and shm
  objects (must be PERMISSION_DENIED or NOT_FOUND, never OK), attaches its own engines up to
  ``--max-sessions-per-user`` and past it (RESOURCE_EXHAUSTED);
- C++ clients: ``eps-load --soak`` (stream or unary, Poisson rate) and ``eps-demo``.

The driver kills random engines with SIGKILL, stops them with SIGSTOP for up to 3 s, Pings
epsd every second (it must answer within ``--ping-bound``), scrapes /metrics and GetStats, and
samples epsd's RSS, threads, open fds, mapped shm objects and /dev/shm. After the load it
stops every client, waits for the leases and the step pool's idle threads, and checks that the
sessions gauge is 0, the session memory gauge 0, no shm object is left mapped or behind, the
threads and fds are back where they started, and epsd exits 0 on SIGTERM. Exit 0 when every
check held, 1 otherwise; the report (stdout and ``--json``) lists the calls and their status
codes per role.

    scripts/chaos.py --epsd build/service/epsd --duration 900 --json /tmp/chaos.json

Run as root (the intruder drops to uid 65534); not part of CI.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from chaos_workers import LEASE_MS, ROOT, TAG, worker_main
from eps_client import _stale_shm
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc

# -- the driver ----------------------------------------------------------------------------------


SHM_NAME = re.compile(r"eps-(?:chaos|chaos-intruder|load|demo)-([0-9]+)-")


def shm_of(pids: set[int]) -> list[str]:
    """The /dev/shm objects the run's clients (processes ``pids``) made."""
    return [n for n in os.listdir("/dev/shm")
            if (m := SHM_NAME.match(n)) and int(m.group(1)) in pids]


def proc_sample(pid: int, pids: set[int]) -> dict[str, Any]:
    """epsd's RSS (kB), threads, open fds and mapped shm objects, and the /dev/shm objects of
    the clients ``pids``."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    maps = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/dev/shm/" in line}
    names: collections.Counter[str] = collections.Counter()
    for t in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended since the listing
            names[Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()] += 1
    return {"rss_kb": rss, "threads": threads, "thread_names": dict(sorted(names.items())),
            "fds": fds, "mapped_shm": len(maps),
            "dev_shm": len(shm_of(pids))}


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.dir = Path(tempfile.mkdtemp(prefix="eps-chaos-"))
        os.chmod(self.dir, 0o755)
        for sub in ("sessions", "tally"):
            (self.dir / sub).mkdir()
            os.chmod(self.dir / sub, 0o777)
        self.target = f"unix://{self.dir}/epsd.sock"
        self.failures: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.pings: list[float] = []
        self.workers: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}
        self.stopped: dict[int, float] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.next_id = 0
        self.pids: set[int] = set()  # every client process the run started

    def fail(self, text: str) -> None:
        print(f"chaos: FAIL {text}", flush=True)
        self.failures.append(text)

    def start_epsd(self) -> None:
        a = self.args
        with open(self.dir / "epsd.log", "wb") as log:
            self.epsd = subprocess.Popen(
                [a.epsd, "--backend=cpu", f"--listen={self.target}", "--socket-mode=0666",
                 "--metrics-listen=127.0.0.1:0", f"--lease-ms={LEASE_MS}",
                 f"--max-sessions={a.max_sessions}",
                 f"--max-sessions-per-user={a.max_sessions_per_user}", "--max-batch=8",
                 "--max-session-bytes=64M", "--max-server-bytes=512M", "--drain-ms=2000"],
                stderr=log, stdout=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = (self.dir / "epsd.log").read_text()
            if (m := re.search(r"metrics on (http://\S+/metrics)", text)) and "listening" in text:
                self.metrics_url = m.group(1)
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"epsd did not start: {(self.dir / 'epsd.log').read_text()}")
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.PageSelectorStub(self.channel)

    def spawn(self, role: str, **extra: Any) -> None:
        self.next_id += 1
        engine_id = extra.pop("engine_id", f"chaos-{self.next_id % 8}")
        cmd = [sys.executable, __file__, "--role", role, "--target", self.target,
               "--run-dir", str(self.dir), "--engine-id", engine_id,
               "--seed", str(self.rng.randrange(2**32)),
               "--max-sessions-per-user", str(self.args.max_sessions_per_user)]
        cmd += ["--stream"] * bool(extra.get("stream")) + ["--stopped"] * bool(extra.get("stopped"))
        with open(self.dir / f"{role}.err", "ab") as err:  # the child keeps its own copy
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        self.workers[p.pid] = (role, p)
        self.pids.add(p.pid)
        self.counts[f"spawned {role}"] += 1

    def spawn_cpp(self) -> None:
        a = self.args
        if self.rng.random() < 0.6:
            mode = self.rng.choice(["stream", "unary"])
            cmd = [a.eps_load, f"--target={self.target}", f"--mode={mode}", "--batch=1",
                   "--context=2k", "--layers=2", "--q-heads=4", "--kv-heads=2", "--head-dim=64",
                   "--rate=poisson:20", "--sessions=2", "--duration=30s", "--floor-calls=0",
                   "--ping-every=0", f"--deadline={self.rng.choice(['2ms', '1s'])}", "--soak", "--sample-every=10s",
                   f"--epsd-pid={self.epsd.pid}", f"--json={self.dir}/eps-load-{self.next_id}.json"]
            role = "eps-load"
        else:
            cmd = [a.eps_demo, f"--target={self.target}", "--steps=200", "--batch=1",
                   "--context=2k", "--pace-ms=30", "--deadline=1s",
                   f"--mode={self.rng.choice(['stream', 'unary'])}"]
            role = "eps-demo"
        self.next_id += 1
        with open(self.dir / f"{role}.out", "ab") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.workers[p.pid] = (role, p)
        self.pids.add(p.pid)
        self.counts[f"spawned {role}"] += 1

    def ping(self) -> None:
        start = time.monotonic()
        try:
            self.stub.Ping(pb.PingRequest(), timeout=self.args.ping_bound)
            self.pings.append(time.monotonic() - start)
        except grpc.RpcError as x:
            self.fail(f"Ping: {x.code().name} after {time.monotonic() - start:.3f} s")
        if self.epsd.poll() is not None:
            self.fail(f"epsd exited {self.epsd.returncode} during the run")
            raise SystemExit(self.report())

    def sample(self, phase: str) -> dict[str, Any]:
        s: dict[str, Any] = {"t": time.monotonic(), "phase": phase, **proc_sample(self.epsd.pid, self.pids)}
        m = scrape(self.metrics_url)
        s["eps_sessions"] = m.get("eps_sessions", -1)
        s["eps_session_memory_bytes"] = m.get("eps_session_memory_bytes", -1)
        stats = self.stub.GetStats(pb.GetStatsRequest(), timeout=5)
        s["stats_sessions"] = stats.sessions_active
        s["stats_listed"] = len(stats.sessions)
        self.samples.append(s)
        return s

    def reap(self) -> None:
        for pid, (role, p) in list(self.workers.items()):
            if p.poll() is not None:
                del self.workers[pid]
                self.stopped.pop(pid, None)
                self.counts[f"exit {role} {p.returncode}"] += 1
                if role in ("steady", "sleeper") and not self.ending:
                    self.fail(f"steady engine {pid} exited {p.returncode}")
                if role == "eps-load" and p.returncode not in (0, 3, -9):
                    self.fail(f"eps-load exited {p.returncode}")

    def chaos_tick(self) -> None:
        rng = self.rng
        chaos = [pid for pid, (role, _) in self.workers.items()
                 if role in ("chaos", "eps-load", "eps-demo") and pid not in self.stopped]
        sleeper = [pid for pid, (role, _) in self.workers.items()
                   if role == "sleeper" and pid not in self.stopped]
        if sleeper and rng.random() < 0.01:
            os.kill(sleeper[0], signal.SIGSTOP)
            self.stopped[sleeper[0]] = time.monotonic() + rng.uniform(0.1, 3.0)
            self.counts["SIGSTOP sleeper"] += 1
        if chaos and rng.random() < 0.08:
            pid = rng.choice(chaos)
            os.kill(pid, signal.SIGKILL)
            self.counts[f"SIGKILL {self.workers[pid][0]}"] += 1
        elif chaos and rng.random() < 0.06:
            pid = rng.choice(chaos)
            os.kill(pid, signal.SIGSTOP)
            self.stopped[pid] = time.monotonic() + rng.uniform(0.1, 3.0)
            self.counts[f"SIGSTOP {self.workers[pid][0]}"] += 1
        for pid, until in list(self.stopped.items()):
            if time.monotonic() >= until:
                os.kill(pid, signal.SIGCONT)
                del self.stopped[pid]

    def run(self) -> int:
        try:
            return self._run()
        finally:  # whatever ended the run (an exception, SystemExit): nothing left behind
            self.kill_everything()

    def kill_everything(self) -> None:
        """SIGCONT and SIGKILL every client still running, and epsd."""
        for _, p in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.kill()
        epsd = getattr(self, "epsd", None)
        if epsd is not None and epsd.poll() is None:
            epsd.kill()
            epsd.wait()

    def _run(self) -> int:
        a = self.args
        self.ending = False
        self.start_epsd()
        self.ping()
        self.start = self.sample("start")
        print(f"chaos: epsd {self.epsd.pid} in {self.dir}; start {self.start}", flush=True)
        for i in range(2):
            self.spawn("steady", engine_id=f"steady-{i}", stream=i == 0)
        self.spawn("sleeper", engine_id="sleeper", stream=True, stopped=True)
        self.spawn("intruder", engine_id="intruder")
        end = time.monotonic() + a.duration
        next_ping = next_sample = 0.0
        while time.monotonic() < end:
            self.reap()
            roles = collections.Counter(role for role, _ in self.workers.values())
            if roles["chaos"] < a.chaos_engines:
                self.spawn("chaos")
            if roles["eps-load"] + roles["eps-demo"] < 1 and a.eps_load:
                self.spawn_cpp()
            self.chaos_tick()
            now = time.monotonic()
            if now >= next_ping:
                self.ping()
                next_ping = now + 1
            if now >= next_sample:
                s = self.sample("load")
                if len(self.samples) % 8 == 0:
                    print(f"chaos: t={now - self.start['t']:.0f}s {s}", flush=True)
                next_sample = now + 2
            time.sleep(0.25)
        return self.finish()

    def finish(self) -> int:
        a = self.args
        self.ending = True
        for pid in list(self.stopped):
            os.kill(pid, signal.SIGCONT)
        self.stopped.clear()
        for _, p in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for pid, (role, p) in self.workers.items():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.fail(f"{role} {pid} did not end on SIGTERM")
                p.kill()
                p.wait()
        self.reap()
        time.sleep(LEASE_MS / 1000 * 3)
        self.ping()
        settled = self.sample("after leases")
        for key in ("eps_sessions", "stats_sessions", "stats_listed", "eps_session_memory_bytes",
                    "mapped_shm"):
            if settled[key] != 0:
                self.fail(f"{key}={settled[key]} once every client was gone")
        # The step pool's threads leave once idle for 30 s; the dead engines' shm objects are
        # reaped by the next client of their tag after 10 s (both documented).
        time.sleep(a.settle)
        removed = [name for tag in (TAG, "load", "demo") for name in _stale_shm.reap_stale(tag)]
        self.ping()
        end = self.sample("end")
        end["reaped_shm"] = len(removed)
        if end["dev_shm"] != 0:
            self.fail(f"left in /dev/shm after reaping: {shm_of(self.pids)}")
        # epsd's own threads (its name; the step pool's leave once idle for 30 s) must be
        # back; gRPC's on-demand pools (its executor, up to two a core, and its timers) may
        # have grown to their bounds.
        own = end["thread_names"].get("epsd", 0)
        if own > self.start["thread_names"].get("epsd", 0):
            self.fail(f"epsd's threads {self.start['thread_names']} -> {end['thread_names']}")
        if end["threads"] > self.start["threads"] + 2 * (os.cpu_count() or 1) + 2:
            self.fail(f"threads {self.start['threads']} -> {end['threads']}")
        if end["fds"] > self.start["fds"] + 2:
            self.fail(f"fds {self.start['fds']} -> {end['fds']}")
        if end["rss_kb"] > self.start["rss_kb"] + a.rss_growth_mb * 1024:
            self.fail(f"RSS {self.start['rss_kb']} -> {end['rss_kb']} kB")
        self.metrics_end = scrape(self.metrics_url)
        self.channel.close()
        sent = time.monotonic()
        self.epsd.send_signal(signal.SIGTERM)
        try:
            rc = self.epsd.wait(timeout=2 + 4 + 5)
        except subprocess.TimeoutExpired:
            self.fail("epsd did not exit within 11 s of SIGTERM")
            self.epsd.kill()
            rc = self.epsd.wait()
        self.exit_s = time.monotonic() - sent
        log = (self.dir / "epsd.log").read_text()
        if rc != 0 or "epsd: stopped" not in log:
            self.fail(f"epsd exited {rc} after SIGTERM")
        return self.report()

    def report(self) -> int:
        calls: collections.Counter[str] = collections.Counter()
        violations: list[str] = []
        for path in (self.dir / "tally").glob("*.json"):
            with contextlib.suppress(json.JSONDecodeError, OSError):
                data = json.loads(path.read_text())
                calls.update(data["calls"])
                violations += data["violations"]
        for path in self.dir.glob("eps-load-*.json"):  # the runs that were not killed
            with contextlib.suppress(json.JSONDecodeError, OSError, KeyError):
                select = json.loads(path.read_text())["select"]
                calls["eps-load.select OK"] += select["count"] - select["errors"]
                for code, n in select["errors_by_code"].items():
                    calls[f"eps-load.select {code}"] += n
        # Every step a client saw selected was counted by epsd (more: replies lost to kills).
        selected = sum(n for key, n in calls.items() if key.endswith(" OK") and any(
            w in key for w in ("select", "flood", "race_step")))
        counted = sum(v for k, v in getattr(self, "metrics_end", {}).items()
                      if k.startswith("eps_steps_total"))
        if hasattr(self, "metrics_end") and counted < selected:
            self.failures.append(f"eps_steps_total={counted} < {selected} steps clients saw "
                                 f"selected")
        pings = sorted(self.pings) or [0.0]
        out = {
            "dir": str(self.dir), "failures": self.failures + violations,
            "samples": self.samples, "calls": dict(sorted(calls.items())),
            "driver": dict(sorted(self.counts.items())),
            "steps_selected_seen": selected, "eps_steps_total": counted,
            "ping_ms": {"n": len(self.pings), "p50": 1e3 * pings[len(pings) // 2],
                        "max": 1e3 * pings[-1]},
            "exit_s": getattr(self, "exit_s", None),
        }
        text = json.dumps(out, indent=1)
        print(text)
        if self.args.json:
            Path(self.args.json).write_text(text)
        return 1 if out["failures"] else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epsd", default=str(ROOT / "build/service/epsd"))
    p.add_argument("--eps-load", default=str(ROOT / "build/load/eps-load"),
                   help="'' leaves the C++ clients out")
    p.add_argument("--eps-demo", default=str(ROOT / "build/demo/eps-demo"))
    p.add_argument("--duration", type=float, default=900, help="seconds of load")
    p.add_argument("--chaos-engines", type=int, default=5)
    p.add_argument("--max-sessions", type=int, default=24)
    p.add_argument("--max-sessions-per-user", type=int, default=10)
    p.add_argument("--ping-bound", type=float, default=2.0, help="seconds a Ping may take")
    p.add_argument("--settle", type=float, default=40, help="seconds after the load")
    p.add_argument("--rss-growth-mb", type=float, default=64)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default="")
    # a worker's
    p.add_argument("--role", default="driver", choices=["driver", "steady", "sleeper", "chaos",
                                                          "intruder"])
    p.add_argument("--target", default="")
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--engine-id", default="")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--stopped", action="store_true")
    args = p.parse_args()
    if args.role != "driver":
        return worker_main(args)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    print(f"chaos: seed {args.seed}", flush=True)
    return Driver(args).run()


if __name__ == "__main__":
    sys.exit(main())
