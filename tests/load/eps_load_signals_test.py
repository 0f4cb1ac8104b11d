"""eps-load ended by a signal (SIGINT, SIGTERM, SIGKILL) against a real epsd: the run stops
early with its report, between calls, against an epsd that stopped answering, during the RPC
floor, and leaves no temporary or a half report (shared set-up in conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import EPS_LOAD


def _start_until(target: str, flags: list[str], marker: str) -> subprocess.Popen[str]:
    """A long eps-load run at a small shape, read until a stderr line holds `marker`."""
    proc = subprocess.Popen(
        [
            EPS_LOAD,
            f"--target={target}",
            "--preset=smollm2-135m",
            "--batch=1",
            "--context=1k",
            "--duration=10m",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    while line and marker not in line:
        line = proc.stderr.readline()
    assert marker in line, line
    return proc


def test_sigint_ends_a_long_run_early_with_a_report(epsd: tuple[str, int], tmp_path: Path) -> None:
    target, _ = epsd
    out = tmp_path / "out.json"
    # The RPC floor's line comes first, then "running" once the sessions run.
    proc = _start_until(target, ["--warmup=0", "--rate=poisson:50", f"--json={out}"], "running")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stdout + stderr
    assert "stopped early" in stdout
    report = json.loads(out.read_text())
    assert report["stopped_early"] is True
    assert report["measured_s"] < 60
    assert not [p for p in Path("/dev/shm").glob(f"eps-load-{proc.pid}-*")]


def test_a_run_killed_by_sigkill_leaves_no_temporary_beside_its_report(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    # The report's temporary was `out.json.PID.tmp` from the start: a run killed by a signal
    # it cannot handle left it behind. Now it has no name until the report is written.
    target, _ = epsd
    out = tmp_path / "out.json"
    proc = _start_until(target, ["--warmup=0", "--floor-calls=0", "--rate=poisson:50",
                                 f"--json={out}"], "running")
    proc.kill()
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("out.json")]


def test_sigint_ends_an_open_loop_between_its_calls(epsd: tuple[str, int], tmp_path: Path) -> None:
    # At 0.02 calls/s the sessions sleep tens of seconds between calls; SIGINT once waited
    # that out.
    target, _ = epsd
    proc = _start_until(target, ["--warmup=0", "--floor-calls=0", "--rate=0.02"], "running")
    time.sleep(0.5)  # the first call (at the start) is sent; the next is seconds away
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    waited = time.monotonic() - sent
    assert proc.returncode == 0, stdout + stderr
    assert "stopped early" in stdout
    # A hang guard, well under the gaps: the wait is cut into 20 ms slices.
    assert waited < 5, f"SIGINT took {waited:.1f} s to end the run"


def test_sigint_against_an_epsd_that_stopped_answering_waits_one_deadline(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    # A closed loop once sent its Ping after SIGINT (a second deadline), and the sessions
    # detached one after another after the run (500 ms each): 11-14 s here, minutes with
    # more sessions. Now the calls in flight end at their deadline and every session
    # detaches at once.
    target, pid = epsd
    out = tmp_path / "out.json"
    proc = _start_until(
        target,
        ["--warmup=0", "--floor-calls=0", "--sessions=16", "--deadline=3s", f"--json={out}"],
        "running",
    )
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.5)  # every session's call in flight is now one epsd will not answer
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        os.kill(pid, signal.SIGCONT)
    report = json.loads(out.read_text())
    assert report["stopped_early"] is True
    # Calls were in flight when epsd stopped, and their deadline ended them (the first
    # call of a session may fall before the window, which starts 10 ms after "running").
    assert report["client_fallbacks"]["deadline"] >= 1, report
    errors = report["select"]["errors_by_code"] | report["ping"]["errors_by_code"]
    assert set(errors) <= {"DEADLINE_EXCEEDED"}, report
    # The failed calls the window measured make it exit 3, with the report.
    assert proc.returncode == (3 if errors else 0), stdout + stderr
    # A hang guard, not a timing: one 3 s deadline, then the detaches together (500 ms), with
    # 4 s to spare for a loaded host; the old behaviour took two deadlines and 16 detaches
    # one after another (at least 6 + 8 = 14 s).
    deadline_s, detach_s, spare_s = 3.0, 0.5, 4.0
    assert waited < deadline_s + detach_s + spare_s, f"SIGINT took {waited:.1f} s to end the run"


def test_sigint_ends_the_rpc_floor(epsd: tuple[str, int], tmp_path: Path) -> None:
    # The floor's rounds once ignored the stop flag: SIGINT waited for all of them.
    target, _ = epsd
    # Printed as the floor's rounds begin.
    proc = _start_until(target, ["--floor-calls=10000000"], "measuring the RPC floor")
    # A burst, so that some land while the floor's child process starts: a SIGINT there
    # once ended the wait for its address and was reported as a server that cannot listen.
    for _ in range(20):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.001)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1, stdout + stderr
    assert "stopped by a signal while measuring the RPC floor" in stderr, stderr


def test_sigint_during_the_rpc_floor_leaves_an_earlier_json_report(
    epsd: tuple[str, int], tmp_path: Path
) -> None:
    target, _ = epsd
    out = tmp_path / "out.json"
    out.write_text('{"earlier": true}\n')
    proc = _start_until(target, ["--floor-calls=10000000", f"--json={out}"],
                        "measuring the RPC floor")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1, stdout + stderr
    assert out.read_text() == '{"earlier": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epsd.log", "out.json"]
