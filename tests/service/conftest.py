"""Shared fixtures of the Python suites of tests/service (observability_limits_test.py,
unread_replies_test.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from observability_test import Epsd


@pytest.fixture
def start_epsd() -> Iterator[Callable[..., Epsd]]:
    """Starts epsd as Epsd(...) does; whatever a failed test left running is killed after it."""
    started: list[Epsd] = []

    def start(tmp: Path, env: dict[str, str], flags: list[str]) -> Epsd:
        started.append(Epsd(tmp, env, flags))
        return started[-1]

    yield start
    for epsd in started:
        if epsd.proc.poll() is None:
            epsd.proc.kill()
            epsd.proc.wait()
