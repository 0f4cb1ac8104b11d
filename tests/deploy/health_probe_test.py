"""eps-health-probe and the image's entrypoint against the real epsd.

ctest sets EPSD and EPS_HEALTH_PROBE to the built binaries. epsd is started the
way the container starts it: deploy/docker/epsd-entrypoint.sh with a flags file.
"""

from __future__ import annotations

import os
import queue
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "deploy/docker/epsd-entrypoint.sh"


def binary(name: str) -> str:
    path = os.environ.get(name)
    assert path, f"set {name} to the built binary (ctest does)"
    return os.path.abspath(path)


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("EPS_HEALTH_PROBE"), *args], capture_output=True, text=True, timeout=30, check=False
    )


def start_epsd(flags_file: Path | None, *args: str) -> subprocess.Popen[str]:
    environment = dict(os.environ, EPSD_BIN=binary("EPSD"), EPSD_FLAGS_FILE=str(flags_file or ""))
    return subprocess.Popen(
        # Several epsd run at once under ctest -j: none binds the default metrics port.
        ["sh", str(ENTRYPOINT), *args, "--metrics-listen=off"],
        env=environment,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_listening(process: subprocess.Popen[str], seconds: float = 20) -> str:
    """The address epsd prints once it serves; fails if it exits or stays silent."""
    assert process.stderr is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if not selector.select(left):
            break
        line = process.stderr.readline()
        if not line:
            pytest.fail(f"epsd exited with {process.wait()} before listening")
        if "listening on" in line:
            return line.split("listening on ", 1)[1].split()[0]
    pytest.fail(f"epsd did not listen within {seconds} s")


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture()
def socket_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    short = Path(tempfile.mkdtemp(prefix="eps-probe-", dir="/tmp"))
    yield short
    shutil.rmtree(short)


@pytest.fixture()
def epsd(socket_dir: Path) -> Iterator[str]:
    """epsd started from a flags file written as the ConfigMap's is; yields its address."""
    flags = socket_dir / "epsd.flags"
    flags.write_text(
        f"# as in the ConfigMap\n--listen=unix://{socket_dir}/epsd.sock\n"
        "--socket-mode=0660  # comment\n\n--backend=cpu"
    )  # last line without a newline
    process = start_epsd(flags)
    try:
        yield wait_listening(process)
    finally:
        stop(process)


def test_probe_reports_serving_for_the_page_selector(epsd: str, socket_dir: Path) -> None:
    assert epsd == f"unix://{socket_dir}/epsd.sock"
    done = probe(f"--addr={epsd}")
    assert done.returncode == 0, done.stderr
    assert "'eps.v1.PageSelector': SERVING" in done.stdout
    assert probe(f"--addr={epsd}", "--service=").returncode == 0


def test_probe_fails_for_an_unknown_service(socket_dir: Path) -> None:
    process = start_epsd(None, f"--listen=unix://{socket_dir}/epsd.sock")
    try:
        address = wait_listening(process)
        done = probe(f"--addr={address}", "--service=no.such.Service")
        assert done.returncode == 1
        assert "code 5" in done.stderr  # NOT_FOUND
    finally:
        stop(process)


def test_probe_fails_fast_when_no_server_listens(socket_dir: Path) -> None:
    started = time.monotonic()
    done = probe(f"--addr=unix://{socket_dir}/absent.sock", "--timeout-ms=2000")
    assert done.returncode == 1
    assert time.monotonic() - started < 10
    assert "absent.sock" in done.stderr


def test_probe_fails_after_epsd_is_killed(socket_dir: Path) -> None:
    process = start_epsd(None, f"--listen=unix://{socket_dir}/epsd.sock")
    address = wait_listening(process)
    assert probe(f"--addr={address}").returncode == 0
    process.kill()
    process.wait()
    done = probe(f"--addr={address}", "--timeout-ms=2000")
    assert done.returncode == 1, done.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--timeout-ms=0"],
        ["--timeout-ms=abc"],
        ["--addr="],
        ["stray"],
        ["--port=1"],
        # gRPC would dial these somewhere else: 99999 wraps, abc is port 0, no port is 443.
        ["--addr=127.0.0.1:99999"],
        ["--addr=127.0.0.1:abc"],
        ["--addr=localhost"],
        ["--addr=127.0.0.1:"],
        ["--addr=unix:"],
        # No client can dial these: unix://x names an authority, port 0 no server.
        ["--addr=unix://relative.sock"],
        ["--addr=unix:///"],
        ["--addr=127.0.0.1:0"],
    ],
)
def test_probe_rejects_bad_usage_naming_the_argument(args: list[str]) -> None:
    done = probe(*args)
    assert done.returncode == 2
    assert done.stderr.startswith("eps-health-probe: ")
    assert args[0].split("=")[0] in done.stderr
    assert "eps-health-probe --help" in done.stderr


def wait_line(process: subprocess.Popen[str], marker: str, seconds: float = 20) -> str:
    """The word after marker in epsd's stderr (read on a thread: lines arrive in bursts)."""
    assert process.stderr is not None
    stderr = process.stderr
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stderr:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if marker in line:
            return line.split(marker, 1)[1].split()[0]
    pytest.fail(f"epsd did not print {marker!r} within {seconds} s")


def test_probe_over_the_tcp_health_port_as_kubelet_does(socket_dir: Path) -> None:
    process = start_epsd(
        None, f"--listen=unix://{socket_dir}/epsd.sock", "--health-listen=127.0.0.1:0"
    )
    try:
        address = wait_line(process, "grpc.health.v1 on ")
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        for service in ("", "eps.v1.PageSelector"):
            done = probe(f"--addr={address}", f"--service={service}", "--timeout-ms=2s")
            assert done.returncode == 0, done.stderr
            assert "SERVING" in done.stdout
    finally:
        stop(process)


def ipv6_loopback_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_manifests_wildcard_health_port_answers_over_ipv4_and_ipv6(socket_dir: Path) -> None:
    # The ConfigMaps' --health-listen=[::]:9465, read from a flags file as the container
    # reads it (the brackets are no glob there): kubelet dials the pod IP, IPv6 on an
    # IPv6-only or IPv6-primary cluster.
    flags = socket_dir / "epsd.flags"
    flags.write_text(
        f"--listen=unix://{socket_dir}/epsd.sock\n--health-listen=[::]:0\n--allow-remote\n"
        "--backend=cpu\n"
    )
    process = start_epsd(flags)
    try:
        address = wait_line(process, "grpc.health.v1 on ")
        assert address.startswith("[::]:") and not address.endswith(":0"), address
        port = address.rsplit(":", 1)[1]
        hosts = ["127.0.0.1"] + (["[::1]"] if ipv6_loopback_available() else [])
        for host in hosts:
            done = probe(
                f"--addr={host}:{port}", "--service=eps.v1.PageSelector", "--timeout-ms=2s"
            )
            assert done.returncode == 0, (host, done.stderr)
            assert "SERVING" in done.stdout
    finally:
        stop(process)


def test_a_non_loopback_health_port_needs_allow_remote(socket_dir: Path) -> None:
    process = start_epsd(
        None, f"--listen=unix://{socket_dir}/epsd.sock", "--health-listen=0.0.0.0:0"
    )
    assert process.wait(timeout=30) == 2
    assert process.stderr is not None
    assert "--allow-remote" in process.stderr.read()


def test_entrypoint_arguments_override_the_flags_file(socket_dir: Path) -> None:
    flags = socket_dir / "epsd.flags"
    flags.write_text(f"--listen=unix://{socket_dir}/from-file.sock\n")
    process = start_epsd(flags, f"--listen=unix://{socket_dir}/from-args.sock")
    try:
        assert wait_listening(process) == f"unix://{socket_dir}/from-args.sock"
    finally:
        stop(process)


def test_entrypoint_reads_a_flags_file_with_crlf_line_ends(socket_dir: Path) -> None:
    # Each value once ended in "\r": "--backend=cpu\r: want one of cpu, cuda, auto".
    flags = socket_dir / "epsd.flags"
    flags.write_bytes(
        f"# saved on Windows\r\n--listen=unix://{socket_dir}/epsd.sock\r\n"
        "--socket-mode=0660 # comment\r\n--backend=cpu\r\n".encode()
    )
    process = start_epsd(flags)
    try:
        address = wait_listening(process)
        assert address == f"unix://{socket_dir}/epsd.sock"
        assert (socket_dir / "epsd.sock").is_socket()
        assert probe(f"--addr={address}").returncode == 0
    finally:
        stop(process)


def open_file_limits(pid: int) -> tuple[str, str]:
    """The soft and hard 'Max open files' of a process, as /proc/PID/limits shows them."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    pytest.fail(f"/proc/{pid}/limits has no 'Max open files' line")


def test_entrypoint_raises_the_open_file_limit_to_the_hard_limit(socket_dir: Path) -> None:
    # Each client connection holds one of epsd's descriptors: at a soft limit of 1,024,
    # 1,014 idle connections left epsd unable to open an engine's shm object.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = min(256, hard)
    if soft == hard:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to raise")
    environment = dict(os.environ, EPSD_BIN=binary("EPSD"), EPSD_FLAGS_FILE="")
    # A shell lowers the soft limit, as a runtime's default would, and execs the entrypoint.
    process = subprocess.Popen(
        ["sh", "-c", f'ulimit -Sn {soft} && exec sh "$0" "$@"', str(ENTRYPOINT),
         f"--listen=unix://{socket_dir}/epsd.sock", "--metrics-listen=off"],
        env=environment,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_listening(process)
        # The entrypoint execs epsd: the process is epsd itself.
        assert open_file_limits(process.pid) == (str(hard), str(hard))
    finally:
        stop(process)


def test_entrypoint_refuses_a_missing_flags_file(socket_dir: Path) -> None:
    process = start_epsd(socket_dir / "missing.flags")
    assert process.wait(timeout=30) == 2
    assert process.stderr is not None
    assert "cannot read flags file" in process.stderr.read()


def test_entrypoint_refuses_a_flags_file_that_is_a_directory(socket_dir: Path) -> None:
    # Reading a directory failed inside the read loop, and epsd started without the flags.
    process = start_epsd(socket_dir)
    assert process.wait(timeout=30) == 2
    assert process.stderr is not None
    assert "readable regular file" in process.stderr.read()


def test_entrypoint_does_not_glob_flag_values(socket_dir: Path) -> None:
    # With globbing, '--eps-method=*' would expand to this file's name, a valid flag.
    (socket_dir / "--eps-method=jl").write_text("")
    flags = socket_dir / "epsd.flags"
    flags.write_text("--eps-method=*\n")
    env = dict(os.environ, EPSD_BIN=binary("EPSD"), EPSD_FLAGS_FILE=str(flags))
    done = subprocess.run(
        ["sh", str(ENTRYPOINT), "--help"],
        env=env,
        cwd=socket_dir,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "--eps-method=*" in done.stderr
