"""eps-demo and eps_core_demo: sizes that cannot fit, running out of memory, signals, and a
run that never reaches epsd.

ctest sets EPS_BINARIES to "name=path;..." for the built binaries. No epsd runs, except in
the test of an Attach that epsd refuses: eps-demo falls back to dense attention at every
step, which is all these tests need.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def binaries() -> dict[str, str]:
    value = os.environ.get("EPS_BINARIES", "")
    assert value, "set EPS_BINARIES (ctest does)"
    return dict(item.split("=", 1) for item in value.split(";") if item)


def shm_objects(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"eps-demo-{pid}-*"))


NO_EPSD = "--target=unix:///tmp/eps-demo-test-no-epsd.sock"


@pytest.mark.parametrize("name", ["eps-demo", "eps_core_demo"])
def test_a_size_that_cannot_fit_in_memory_exits_2_naming_the_flags(name: str) -> None:
    done = subprocess.run(
        [binaries()[name], "--batch=512", "--context=16M"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--batch=512" in done.stderr and "--context=16777216" in done.stderr
    assert "bytes" in done.stderr and "memory" in done.stderr


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_eps_demo_stops_on_a_signal_and_removes_its_shared_memory(
    sig: int, code: int
) -> None:
    proc = subprocess.Popen(
        [
            binaries()["eps-demo"],
            NO_EPSD,
            "--context=1k",
            "--steps=20000",
            "--pace-ms=5",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not shm_objects(proc.pid):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "eps-demo made no shared-memory object"
        time.sleep(0.02)  # polling a child's start-up, not synchronising threads
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == code, stderr
    assert "stopped by signal" in stderr
    assert not shm_objects(proc.pid)


def test_eps_demo_out_of_memory_is_a_clean_error_that_removes_its_shared_memory() -> (
    None
):
    # Fits this machine's memory, not a 1.5 GiB address space: the synthetic keys
    # (4 GiB) fail to allocate after the shared buffers exist.
    limited = 'ulimit -v 1572864 && exec "$0" "$@"'  # exec: the same pid, for /dev/shm
    proc = subprocess.Popen(
        [
            "sh",
            "-c",
            limited,
            binaries()["eps-demo"],
            NO_EPSD,
            "--batch=16",
            "--context=128k",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert "out of memory" in stderr
    assert not shm_objects(proc.pid)


def test_eps_demo_that_never_reaches_epsd_exits_3_after_its_dense_steps() -> None:
    # Fail-open runs every step densely; exit 0 read as a working installation.
    done = subprocess.run(
        [binaries()["eps-demo"], NO_EPSD, "--context=1k", "--steps=3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "3 steps, 0 selected, 3 fallbacks" in done.stdout
    assert "no step was selected by epsd at unix:///tmp/eps-demo-test-no-epsd.sock" in done.stderr
    assert "UNAVAILABLE" in done.stderr and "(is epsd running?)" in done.stderr, done.stderr


def test_eps_demo_does_not_ask_whether_epsd_runs_when_epsd_refused_the_attach() -> None:
    # epsd answered RESOURCE_EXHAUSTED; "(is epsd running?)" sent the reader the wrong way.
    with tempfile.TemporaryDirectory(prefix="eps-demo-", dir="/tmp") as tmp:
        socket = Path(tmp) / "epsd.sock"
        epsd = subprocess.Popen(
            [binaries()["epsd"], f"--listen=unix://{socket}", "--backend=cpu",
             "--metrics-listen=off", "--max-batch=1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert epsd.stderr is not None
            line = epsd.stderr.readline()  # its first line says it listens
            assert "listening on" in line, line + epsd.stderr.read()
            done = subprocess.run(
                [binaries()["eps-demo"], f"--target=unix://{socket}", "--context=1k",
                 "--batch=2", "--steps=1"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        finally:
            epsd.terminate()
            epsd.communicate(timeout=30)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "RESOURCE_EXHAUSTED: max_batch=2 exceeds the server's --max-batch=1" in done.stderr
    assert "is epsd running" not in done.stderr, done.stderr
