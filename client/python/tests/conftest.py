"""Fixtures: the real epsd (EPSD_BIN, set by ctest), the C++ reference tool
(EPS_CORE_REFERENCE), and a printed seed for every randomized test."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest


@contextlib.contextmanager
def fake_epsd(servicer: object, folder: Path, name: str = "fake") -> Iterator[str]:
    """A fake epsd: `servicer` (a PageSelectorServicer) served on a Unix socket in `folder`
    until the block ends; yields its target."""
    from concurrent import futures

    from eps_client.proto import page_selector_pb2_grpc as pb_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PageSelectorServicer_to_server(servicer, server)
    target = f"unix://{folder}/{name}.sock"
    server.add_insecure_port(target)
    server.start()
    try:
        yield target
    finally:
        server.stop(grace=None)


class Epsd:
    """One epsd process on a Unix socket in a temporary folder (CPU backend)."""

    def __init__(self, folder: Path, flags: list[str] | None = None) -> None:
        binary = os.environ.get("EPSD_BIN")
        if not binary:
            pytest.fail("EPSD_BIN is not set (ctest sets it to build/service/epsd)")
        self.socket = folder / "epsd.sock"
        self.target = f"unix://{self.socket}"
        self.log_path = folder / "epsd.log"
        self.binary = binary
        self.flags = flags or []
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    f"--listen={self.target}",
                    "--backend=cpu",
                    "--metrics-listen=off",  # tests run side by side under ctest -j
                    *self.flags,
                ],
                stdout=log, stderr=log)
        with grpc.insecure_channel(self.target) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=10)
            except grpc.FutureTimeoutError:
                self.stop()
                pytest.fail(f"epsd did not come up: {self.log()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def epsd(tmp_path: Path) -> Iterator[Epsd]:
    server = Epsd(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def core_reference() -> str:
    tool = os.environ.get("EPS_CORE_REFERENCE")
    if not tool:
        pytest.fail("EPS_CORE_REFERENCE is not set (ctest sets it to eps_core_reference)")
    return tool


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    seed = int(os.environ.get("EPS_TEST_SEED", random.randrange(1 << 31)))
    print(f"{request.node.name}: seed {seed} (replay with EPS_TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.fixture
def quest8_edges() -> np.ndarray:
    """127·2^e for every e whose product is a float32 (subnormal ones included), with the
    float32 just below and just above each: where the quest8 scale's power of two changes."""
    exact = np.array([127.0 * 2.0**e for e in range(-149, 121)], dtype=np.float32)
    return np.concatenate([exact, np.nextafter(exact, np.float32(0.0)),
                           np.nextafter(exact, np.float32(np.inf))])
