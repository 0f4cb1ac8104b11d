"""The client's recovery and reporting (issue: hardening, clients): it re-attaches within
0.5 s of epsd coming back, reports every fallback to epsd once, and falls back on none of a
healthy epsd's steps with the default deadline."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from conftest import fake_epsd
from engine_state import make_state

from eps_client import ClientOptions, EpsClient
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc


@pytest.mark.parametrize("use_stream", [False, True])
def test_reattaches_within_half_a_second_after_epsd_restarts(epsd, rng, use_stream):
    state = make_state(rng, contexts=[300, 200])
    options = ClientOptions(target=epsd.target, deadline_s=2.0, use_stream=use_stream)
    with state.client(options) as client:
        client.attach()
        assert client.select_pages(1, state.rows).ok
        epsd.stop()  # kill -9
        step = 2
        for _ in range(20):  # the engine keeps stepping (densely) while epsd is away
            assert client.select_pages(step, state.rows).fallback
            step += 1
            time.sleep(0.005)
        epsd.start()  # returns once epsd accepts connections
        up = time.monotonic()
        while not (result := client.select_pages(step, state.rows)).ok:
            assert result.fallback
            step += 1
            assert time.monotonic() - up < 5, f"no re-attach: {result.code} {result.message}"
            time.sleep(0.001)  # a decode step's worth of other work
        elapsed = time.monotonic() - up
        assert elapsed < 0.5, f"re-attached {elapsed:.3f} s after epsd came back"
        assert client.counters().reattaches == 1
    state.buffers.close()


class ReportRecorder(pb_grpc.PageSelectorServicer):
    """A fake epsd that fails the steps it is told to and records each step's report."""

    def __init__(self, failing: dict[int, grpc.StatusCode]) -> None:
        self.failing = failing
        self.reports: list[tuple[int, int, int, int]] = []
        self.lock = threading.Lock()

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        return pb.AttachResponse(session_id="s")

    def SelectPages(self, request, context):  # noqa: N802
        f = request.fallbacks
        with self.lock:
            self.reports.append((f.deadline, f.unavailable, f.not_attached, f.error))
        code = self.failing.get(request.step)
        if code is not None:
            context.abort(code, f"step {request.step} fails")
        return pb.SelectPagesResponse(step=request.step, done=True)


def test_fallbacks_are_reported_to_epsd_once_each(tmp_path):
    failing = {2: grpc.StatusCode.INVALID_ARGUMENT, 3: grpc.StatusCode.INVALID_ARGUMENT,
               5: grpc.StatusCode.RESOURCE_EXHAUSTED}
    servicer = ReportRecorder(failing)
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=2.0, use_stream=False)
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            client.attach()
            outcomes = [client.select_pages(step, [(0, 1)]).fallback for step in range(1, 8)]
            assert outcomes == [False, True, True, False, True, False, False]
            assert client.counters().fallback_error == 3
    errors = [r[3] for r in servicer.reports]
    # each step carries the fallbacks since the previous report: step 3 reports step 2's,
    # step 4 step 3's, step 6 step 5's; all three reach epsd, each once
    assert errors == [0, 0, 1, 1, 0, 1, 0]
    assert sum(errors) == 3


@pytest.mark.parametrize("use_stream", [False, True])
def test_a_healthy_epsd_causes_no_fallbacks_with_the_default_deadline(epsd, rng, use_stream):
    """The default deadline was chosen from round trips measured on a loaded 2-core machine
    (docs/integration/python-client.md); this checks it on the machine running the test."""
    state = make_state(rng, contexts=[900, 517, 1000])
    options = ClientOptions(target=epsd.target, use_stream=use_stream)
    with state.client(options) as client:
        client.attach()
        results = [client.select_pages(step, state.rows) for step in range(1, 201)]
    late = [r for r in results if r.fallback]
    assert not late, f"{len(late)} of 200 steps fell back: {late[0].code} {late[0].message}"
    state.buffers.close()
