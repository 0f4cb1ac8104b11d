"""The client's recovery and reporting (issue: hardening, clients): it re-attaches promptly
after epsd comes back (within 2 s on a loaded CI machine; 0.5 s on the developer machine, over
4 s before wait_for_ready), reports every fallback to epsd once (totals with the client's id,
as client/cpp sends them), and a healthy epsd causes no error fallback and at most a rare
deadline miss (2 of 200 steps) with the default deadline."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import grpc
import pytest
from conftest import Epsd, fake_epsd
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
        print(f"re-attached {elapsed:.3f} s after epsd came back")
        # Milliseconds on an idle machine, bounded by the reconnect backoff (capped at 100 ms),
        # the re-attach backoff (50 ms) and the calls' tails; 2 s leaves room for a loaded CI
        # machine and still fails the client without wait_for_ready, which took over 4 s
        # (docs/integration/python-client.md).
        assert elapsed < 2.0, f"re-attached {elapsed:.3f} s after epsd came back"
        assert client.counters().reattaches == 1
    state.buffers.close()


class ReportRecorder(pb_grpc.PageSelectorServicer):
    """A fake epsd that fails the steps it is told to and records each step's report."""

    def __init__(self, failing: dict[int, grpc.StatusCode]) -> None:
        self.failing = failing
        self.reports: list[tuple[int, int, int, int]] = []
        self.client_ids: set[int] = set()
        self.lock = threading.Lock()

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        return pb.AttachResponse(session_id="s")

    def SelectPages(self, request, context):  # noqa: N802
        f = request.fallbacks
        with self.lock:
            self.reports.append((f.deadline, f.unavailable, f.not_attached, f.error))
            if request.HasField("fallbacks"):
                self.client_ids.add(f.client_id)
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
            client_id = client.client_id
    errors = [r[3] for r in servicer.reports]
    # a step carries the client's totals while epsd may not have seen them: step 3 reports
    # step 2's fallback, step 4 step 3's too, step 6 all three; with the client's id, so that
    # epsd counts each once (a report that arrives twice raises no total)
    assert errors == [0, 0, 1, 2, 0, 3, 0]
    assert servicer.client_ids == {client_id} and client_id != 0


def test_two_clients_report_with_distinct_nonzero_ids():
    request = pb.AttachRequest(engine_id="e")
    ids = {EpsClient.from_request(ClientOptions(), request).client_id for _ in range(8)}
    assert len(ids) == 8 and 0 not in ids and all(0 < i < 1 << 64 for i in ids)


def scrape_fallbacks(epsd: Epsd) -> dict[str, float]:
    """eps_client_fallbacks_total by reason, from epsd's /metrics."""
    found = re.search(r"metrics on (http://\S+)", epsd.log())
    assert found, epsd.log()
    with urllib.request.urlopen(found.group(1), timeout=10) as reply:
        text = reply.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^eps_client_fallbacks_total\{reason="(\w+)"\} (\S+)$', text, re.MULTILINE)}


@pytest.mark.parametrize("use_stream", [False, True])
def test_epsd_counts_each_fallback_once_after_deadline_misses(tmp_path, rng, use_stream):
    """A step that misses its deadline may or may not have reached epsd, so the next step
    sends its report again: epsd must count what the client counted, no more."""
    epsd = Epsd(tmp_path, flags=["--metrics-listen=127.0.0.1:0"])
    try:
        state = make_state(rng, contexts=[300, 200])
        options = ClientOptions(target=epsd.target, deadline_s=2.0, use_stream=use_stream)
        with state.client(options) as client:
            client.attach()
            step = 1
            assert client.select_pages(step, state.rows).ok
            client.options.deadline_s = 1e-6  # every step misses, most after reaching epsd
            for step in range(2, 12):
                assert client.select_pages(step, state.rows).code == \
                    grpc.StatusCode.DEADLINE_EXCEEDED
            client.options.deadline_s = 2.0
            for step in range(12, 15):  # the first that succeeds settles the report
                assert client.select_pages(step, state.rows).ok
            counters = client.counters()
            assert counters.fallback_deadline == 10
            seen = scrape_fallbacks(epsd)
        assert seen == {"deadline": 10, "unavailable": 0, "not_attached": 0, "error": 0}
        state.buffers.close()
    finally:
        epsd.stop()


@pytest.mark.parametrize("use_stream", [False, True])
def test_a_healthy_epsd_causes_no_fallbacks_with_the_default_deadline(epsd, rng, use_stream):
    """The default deadline was chosen from round trips measured on a loaded 2-core machine
    (docs/integration/python-client.md); this checks it on the machine running the test. A
    CI machine can deschedule the test for longer than the deadline now and then: at most 2
    of the 200 steps may miss it; any other fallback (an error) fails the test."""
    state = make_state(rng, contexts=[900, 517, 1000])
    options = ClientOptions(target=epsd.target, use_stream=use_stream)
    with state.client(options) as client:
        client.attach()
        results = [client.select_pages(step, state.rows) for step in range(1, 201)]
        counters = client.counters()
    late = [r for r in results if r.fallback]
    missed = [r for r in late if r.code == grpc.StatusCode.DEADLINE_EXCEEDED]
    print(f"{len(late)} of 200 steps fell back, {len(missed)} of them at the deadline")
    others = [r for r in late if r.code != grpc.StatusCode.DEADLINE_EXCEEDED]
    assert not others, (f"{len(others)} of 200 steps fell back on an error: "
                        f"{others[0].code} {others[0].message}")
    assert len(missed) <= 2, (f"{len(missed)} of 200 steps missed the default deadline: "
                              f"{[round(r.round_trip_us / 1e3, 1) for r in missed]} ms")
    assert counters.fallbacks == counters.fallback_deadline == len(missed)
    assert counters.selected == 200 - len(missed)
    state.buffers.close()
