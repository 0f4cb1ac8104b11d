"""Shared set-up of the eps-load end-to-end tests (eps_load_test.py, eps_load_signals_test.py):
the binaries, a real epsd on a fresh Unix socket, and a run of eps-load."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

EPS_LOAD = os.environ.get("EPS_LOAD_BIN", "build/load/eps-load")
EPSD = os.environ.get("EPSD_BIN", "build/service/epsd")


def _socket_accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
        return True


@pytest.fixture
def epsd(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """Starts epsd on a fresh Unix socket; yields (target, pid) once it serves: epsd binds
    the socket before its gRPC server and telemetry start, and says "listening on" once they
    have (as tests/service/epsd_process.h waits for). /metrics off: the default port is fixed,
    and another process holding it would stop epsd."""
    path = f"/tmp/eps-load-test-{uuid.uuid4().hex[:12]}.sock"
    log_path = tmp_path / "epsd.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [EPSD, f"--listen=unix://{path}", "--backend=cpu", "--metrics-listen=off"],
            stderr=log,
            stdout=log,
        )
        try:
            deadline = time.monotonic() + 15
            while not ("listening on " in log_path.read_text() and _socket_accepts(path)):
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, (
                    f"epsd did not serve within 15 s: {log_path.read_text()}")
                time.sleep(0.02)  # polling a child's start-up, not synchronising threads
            yield f"unix://{path}", proc.pid
        finally:
            proc.kill()
            proc.wait()
            Path(path).unlink(missing_ok=True)
            Path(path + ".lock").unlink(missing_ok=True)  # epsd keeps it (service/unix_socket.h)


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EPS_LOAD, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
