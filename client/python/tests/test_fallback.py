"""Fail-open: an absent or slow sidecar costs the engine at most the deadline, never a hang,
and every fallback is counted by reason."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from conftest import fake_epsd

from eps_client import ClientOptions, EpsClient, EpsError
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc


def test_absent_sidecar_falls_back_at_once_and_attach_fails_fast(tmp_path):
    options = ClientOptions(target=f"unix://{tmp_path}/nobody.sock", deadline_s=0.002,
                            attach_deadline_s=0.5, reattach_backoff_s=0.05)
    with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
        start = time.monotonic()
        results = [client.select_pages(step, [(0, 1, 0)]) for step in range(1, 51)]
        elapsed = time.monotonic() - start
        assert all(r.fallback for r in results)
        assert elapsed < 1.0, f"50 fallback steps took {elapsed:.3f} s"
        counters = client.counters()
        assert counters.steps == 50 and counters.fallback_not_attached == 50
        assert counters.selected == 0
        start = time.monotonic()
        with pytest.raises(EpsError) as e:
            client.attach()
        assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - start < 2.0


class StalledSelector(pb_grpc.PageSelectorServicer):
    """Attaches, then holds every SelectPages until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        return pb.AttachResponse(session_id="stalled")

    def SelectPages(self, request, context):  # noqa: N802
        self.release.wait(timeout=30)
        return pb.SelectPagesResponse(step=request.step, done=True)

    def StreamSelectPages(self, request_iterator, context):  # noqa: N802
        for request in request_iterator:
            self.release.wait(timeout=30)
            yield pb.SelectPagesResponse(step=request.step, done=True)


@pytest.fixture
def stalled(tmp_path):
    servicer = StalledSelector()
    with fake_epsd(servicer, tmp_path, "stalled") as target:
        yield target, servicer
        servicer.release.set()


@pytest.mark.parametrize("use_stream", [False, True])
def test_missed_deadline_falls_back_within_the_deadline(stalled, use_stream):
    target, servicer = stalled
    options = ClientOptions(target=target, deadline_s=0.02, use_stream=use_stream)
    with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
        client.attach()
        for step in (1, 2, 3):
            start = time.monotonic()
            result = client.select_pages(step, [(0, 1, 0)])
            elapsed = time.monotonic() - start
            assert result.fallback and result.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert elapsed < 0.5, f"step {step} took {elapsed:.3f} s with a 20 ms deadline"
        assert client.counters().fallback_deadline == 3
        # Once the sidecar answers again, the next step selects (late replies are dropped).
        servicer.release.set()
        options.deadline_s = 2.0
        assert client.select_pages(4, [(0, 1, 0)]).ok


def test_epsd_killed_mid_session_falls_back_as_unavailable(epsd, tmp_path):
    import numpy as np
    from engine_state import make_state

    state = make_state(np.random.default_rng(5), contexts=[200])
    options = ClientOptions(target=epsd.target, deadline_s=2.0, reattach_backoff_s=10.0)
    with state.client(options) as client:
        client.attach()
        assert client.select_pages(1, state.rows).ok
        epsd.stop()
        start = time.monotonic()
        result = client.select_pages(2, state.rows)
        assert result.fallback and result.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 2.5
        assert client.counters().fallback_unavailable == 1
    state.buffers.close()


@pytest.mark.parametrize("use_stream", [False, True])
def test_a_stopped_epsd_runs_none_of_the_steps_the_engine_gave_up_on(epsd, use_stream):
    """epsd stopped (alive, silent) while the engine takes 20 steps: each falls back at its
    deadline. Resumed, epsd must not run them (they would write lists the engine no longer
    waits for), and selection resumes. On the stream the client cancels the stream at each
    miss; before, every queued step ran after SIGCONT."""
    import os
    import signal

    import numpy as np
    from engine_state import make_state

    state = make_state(np.random.default_rng(7), contexts=[200])
    # Step 1 and the steps after SIGCONT on a generous deadline: on a loaded machine one
    # scheduling delay makes a 30 ms step miss, and a step that missed may still have run on
    # epsd (counted there, not in `selected`). The 20 steps while epsd is stopped take 30 ms.
    options = ClientOptions(target=epsd.target, deadline_s=2.0, use_stream=use_stream)
    with state.client(options) as client:
        client.attach()
        assert client.select_pages(1, state.rows).ok
        options.deadline_s = 0.03
        assert epsd.process is not None
        os.kill(epsd.process.pid, signal.SIGSTOP)
        stat = f"/proc/{epsd.process.pid}/stat"
        until = time.monotonic() + 2.0
        while time.monotonic() < until:  # kill returns before the process has stopped
            with open(stat) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.001)
        try:
            for step in range(2, 22):
                result = client.select_pages(step, state.rows)
                assert result.fallback, f"step {step}"
        finally:
            os.kill(epsd.process.pid, signal.SIGCONT)
        options.deadline_s = 2.0
        step, ok = 22, False
        while step < 122 and not ok:
            ok = client.select_pages(step, state.rows).ok
            step += 1
        assert ok
        stats = client.stub.GetStats(pb.GetStatsRequest(session_id=client.session_id), timeout=5)
        ran = stats.sessions[0].steps
        selected = client.counters().selected
        assert ran <= selected + 3, f"epsd ran {ran} steps, the client selected {selected}"
    state.buffers.close()


class WrongStep(pb_grpc.PageSelectorServicer):
    """Answers every step with another step's number, and records the steps each stream
    carried."""

    def __init__(self) -> None:
        self.streams: list[list[int]] = []

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        return pb.AttachResponse(session_id="wrong")

    def SelectPages(self, request, context):  # noqa: N802
        return pb.SelectPagesResponse(step=request.step + 1000, done=True)

    def StreamSelectPages(self, request_iterator, context):  # noqa: N802
        steps: list[int] = []
        self.streams.append(steps)
        for request in request_iterator:
            steps.append(request.step)
            yield pb.SelectPagesResponse(step=request.step + 1000, done=True)


@pytest.mark.parametrize("use_stream", [False, True], ids=["unary", "stream"])
def test_a_reply_for_another_step_is_an_error_fallback_at_once(tmp_path, use_stream):
    """On the stream the reply was dropped, and the step waited out its whole deadline for
    one that never came, counted as a deadline miss."""
    servicer = WrongStep()
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=20.0, use_stream=use_stream)
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            client.attach()
            for step in (7, 8):
                start = time.monotonic()
                result = client.select_pages(step, [(0, 1, 0)])
                assert time.monotonic() - start < 10.0  # far less than the 20 s deadline
                assert result.fallback and result.code == grpc.StatusCode.INTERNAL
                assert f"epsd answered step {step + 1000} for step {step}" in result.message
            counters = client.counters()
            assert counters.fallback_error == 2 and counters.fallback_deadline == 0
            assert counters.selected == 0
    if use_stream:  # a stream that answered another step carries no more
        assert servicer.streams == [[7], [8]]


class NotDone(pb_grpc.PageSelectorServicer):
    """Grants a session and answers every step with done=False, sync or not."""

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        return pb.AttachResponse(session_id="s-1")

    def SelectPages(self, request, context):  # noqa: N802
        return pb.SelectPagesResponse(step=request.step, done=False)

    def StreamSelectPages(self, request_iterator, context):  # noqa: N802
        for request in request_iterator:
            yield pb.SelectPagesResponse(step=request.step, done=False)


@pytest.mark.parametrize("use_stream", [False, True], ids=["unary", "stream"])
def test_a_sync_reply_that_is_not_done_is_an_error_fallback(tmp_path, use_stream):
    """It was handed to the engine as a selection whose lists epsd had not finished; an
    async call's reply (done=False by design) stays a selection."""
    with fake_epsd(NotDone(), tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=20.0, use_stream=use_stream)
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            client.attach()
            result = client.select_pages(1, [(0, 1, 0)])
            assert result.fallback and result.code == grpc.StatusCode.INTERNAL, result
            assert "epsd answered step 1 with done=false" in result.message
            result = client.select_pages(2, [(0, 1, 0)], async_reply=True)
            assert result.ok and not result.done, result
            assert client.counters().fallback_error == 1


class CountingAttach(pb_grpc.PageSelectorServicer):
    """Grants "s-<n>" for the n-th Attach and answers every step."""

    def __init__(self) -> None:
        self.attaches = 0

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        self.attaches += 1
        return pb.AttachResponse(session_id=f"s-{self.attaches}")

    def Detach(self, request, context):  # noqa: N802
        return pb.DetachResponse()

    def SelectPages(self, request, context):  # noqa: N802
        return pb.SelectPagesResponse(step=request.step, done=True)


def test_steps_after_detach_are_refused_until_attach_is_called_again(tmp_path):
    """A step after detach() started a background Attach: the session the engine had just
    ended came back behind its back."""
    servicer = CountingAttach()
    released: list[int] = []
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=2.0, use_stream=False,
                                reattach_backoff_s=0, on_fallback=released.append)
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            client.attach()
            assert client.select_pages(1, [(0, 1, 0)]).ok
            client.detach()
            for step in (2, 3, 4):
                result = client.select_pages(step, [(0, 1, 0)])
                assert result.fallback and result.code == grpc.StatusCode.FAILED_PRECONDITION
                assert "the client detached: call attach()" in result.message
            assert released == [2, 3, 4]
            counters = client.counters()
            assert counters.fallback_error == 3 and counters.fallback_not_attached == 0
            assert servicer.attaches == 1  # nothing re-attached
            client.attach()
            assert client.select_pages(5, [(0, 1, 0)]).ok
            assert servicer.attaches == 2


class Draining(pb_grpc.PageSelectorServicer):
    """Cancels every step, as a draining epsd's gRPC refuses new calls, recording the
    fallback reports the steps carried."""

    def __init__(self) -> None:
        self.reports: list[int] = []

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        return pb.AttachResponse(session_id="draining")

    def SelectPages(self, request, context):  # noqa: N802
        self.reports.append(request.fallbacks.unavailable)
        context.abort(grpc.StatusCode.CANCELLED, "Cancelling all calls")


def test_a_step_epsd_cancels_while_draining_is_an_unavailable_fallback_reported_again(
        tmp_path):
    # It was counted as fallback_error, and its fallback report as delivered.
    servicer = Draining()
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=2.0, use_stream=False,
                                reattach_backoff_s=0)
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            client.attach()
            first = client.select_pages(1, [(0, 1, 0)])
            assert first.fallback and first.code == grpc.StatusCode.CANCELLED
            assert client.counters().fallback_unavailable == 1
            assert client.counters().fallback_error == 0
            client.attach()  # the client forgot the session; a new epsd would grant one
            client.select_pages(2, [(0, 1, 0)])
    # The second step carried the first's fallback: not taken as delivered by a CANCELLED.
    assert servicer.reports[-1] >= 1


class SlowAttach(pb_grpc.PageSelectorServicer):
    """Grants sessions after 200 ms, and records which it granted and which were detached."""

    def __init__(self) -> None:
        self.granted: list[str] = []
        self.detached: list[str] = []

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        time.sleep(0.2)
        self.granted.append(f"s-{len(self.granted) + 1}")
        return pb.AttachResponse(session_id=self.granted[-1])

    def Detach(self, request, context):  # noqa: N802
        self.detached.append(request.session_id)
        return pb.DetachResponse()


def test_detach_also_ends_a_session_a_background_reattach_is_being_granted(tmp_path):
    """A step with no session starts a background Attach and falls back; detaching right
    after used to find no session id, and the session granted a moment later stayed on
    epsd until its lease ran out."""
    servicer = SlowAttach()
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=0.05, attach_deadline_s=5.0)
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            assert client.select_pages(1, [(0, 1, 0)]).fallback  # the re-attach starts
        assert servicer.granted == ["s-1"]
        assert servicer.detached == ["s-1"]


class HeldAttach(pb_grpc.PageSelectorServicer):
    """Holds every Attach until released (or 5 s), then grants a session."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        self.calls += 1
        self.release.wait(5.0)
        return pb.AttachResponse(session_id=f"s-{self.calls}")


def test_attach_with_a_background_reattach_in_flight_keeps_to_one_attach_deadline(tmp_path):
    """attach() waited attach_deadline for the background re-attach, then another
    attach_deadline for its own call: twice what the option promises."""
    servicer = HeldAttach()
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=0.05, attach_deadline_s=0.6)
        client = EpsClient.from_request(options, pb.AttachRequest(engine_id="e"))
        try:
            assert client.select_pages(1, [(0, 1, 0)]).fallback  # the re-attach starts
            start = time.monotonic()
            with pytest.raises(EpsError) as e:
                client.attach()
            took = time.monotonic() - start
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert took < 0.6 + 0.45, took  # one deadline (two were >= 1.2 s)
        finally:
            servicer.release.set()
            client.close()


def test_attach_adopts_a_background_reattach_granted_meanwhile(tmp_path):
    servicer = SlowAttach()
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=0.05, attach_deadline_s=5.0)
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            assert client.select_pages(1, [(0, 1, 0)]).fallback  # the re-attach starts
            info = client.attach()
            assert info.session_id == "s-1" and client.session_id == "s-1"
        assert servicer.granted == ["s-1"]  # no second Attach replaced it


class UndecodableAttach(pb_grpc.PageSelectorServicer):
    """Grants sessions whose effective options no SelectOptions holds (a NaN top_p), or
    answers OK with no session id at all."""

    def __init__(self, no_id: bool = False) -> None:
        self.attaches = 0
        self.no_id = no_id
        self.selects = 0

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        self.attaches += 1
        if self.no_id:
            return pb.AttachResponse()
        reply = pb.AttachResponse(session_id=f"s-{self.attaches}")
        reply.effective_options.top_p = float("nan")
        return reply

    def SelectPages(self, request, context):  # noqa: N802
        self.selects += 1
        return pb.SelectPagesResponse(step=request.step, done=True)


def test_an_attach_answered_ok_without_a_session_id_is_an_internal_error(tmp_path):
    # As the C++ client's (docs/api-failures.md §5.4): it was adopted as a session with an
    # empty id, and every step then went to epsd naming none.
    servicer = UndecodableAttach(no_id=True)
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=5.0, attach_deadline_s=5.0,
                                reattach_backoff_s=3600.0, use_stream=False)
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            with pytest.raises(EpsError) as e:
                client.attach()
            assert e.value.code == grpc.StatusCode.INTERNAL
            assert "granted no session_id" in e.value.message
            assert client.attach_info is None
            result = client.select_pages(1, [(0, 1, 0)])
            assert result.fallback and "backing off" in result.message, result
    assert servicer.selects == 0


def test_an_attach_reply_that_does_not_decode_is_an_internal_error_not_a_session(tmp_path):
    # It raised the ValueError of SelectOptions out of attach(), with the session adopted
    # anyway, and out of a fail-open select_pages that collected a background re-attach.
    servicer = UndecodableAttach()
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=5.0, attach_deadline_s=5.0,
                                reattach_backoff_s=0.0, use_stream=False)
        with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
            with pytest.raises(EpsError) as e:
                client.attach()
            assert e.value.code == grpc.StatusCode.INTERNAL
            assert "top_p=nan" in e.value.message
            assert client.session_id == "" and client.attach_info is None
            assert client.select_pages(1, [(0, 1, 0)]).fallback  # the re-attach starts
            client._reattach._pending_attach.result(timeout=5.0)
            options.reattach_backoff_s = 3600.0
            result = client.select_pages(2, [(0, 1, 0)])  # it collects the reply
            assert result.fallback and result.code == grpc.StatusCode.INTERNAL, result
            assert "top_p=nan" in result.message and client.session_id == ""
            result = client.select_pages(3, [(0, 1, 0)])  # backing off: no third Attach
            assert result.fallback and "backing off" in result.message, result
            assert servicer.attaches == 2
            assert client.counters().fallback_error == 1


def test_an_exception_from_on_fallback_reaches_the_caller_with_the_fallback_counted(tmp_path):
    """The client does not hide the engine's own error (docs/integration/python-client.md):
    the callback's exception leaves select_pages, and the fallback it was called for is
    counted before it runs."""

    class ReleaseFailed(RuntimeError):
        pass

    def release(step: int) -> None:
        raise ReleaseFailed(f"could not release step {step}")

    options = ClientOptions(target=f"unix://{tmp_path}/nobody.sock", deadline_s=0.002,
                            reattach_backoff_s=0.05, on_fallback=release)
    with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
        with pytest.raises(ReleaseFailed, match="could not release step 7"):
            client.select_pages(7, [(0, 1, 0)])
        counters = client.counters()
        assert counters.steps == 1 and counters.fallback_not_attached == 1
