"""What EpsClient does with inputs it cannot send, after close(), and with a broken tracer:
a bad step input is a counted INVALID_ARGUMENT step failure naming the field, never a value
protobuf sends as 0 nor a stray exception; a closed client refuses every call; a tracer's
failure costs the call its traceparent only."""

from __future__ import annotations

import logging
import threading

import grpc
import numpy as np
import pytest
from conftest import fake_epsd
from engine_state import make_state
from test_client import RecordingSelector

from eps_client import ClientOptions, EpsClient, EpsError, Row
from eps_client import client as client_module
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc
from eps_client.stream import SelectStream

NOWHERE = "unix:///nonexistent/eps-client-inputs.sock"

BAD_INPUTS = [
    (None, [Row(0, 100)], "step=None is not an integer"),
    (-1, [Row(0, 100)], "step=-1 is not in"),
    (2**64, [Row(0, 100)], "step=18446744073709551616 is not in"),
    (9.0, [Row(0, 100)], "step=9.0 is not an integer"),
    (True, [Row(0, 100)], "step=True is a bool"),
    (1, [Row(0, 100), Row(None, 100)], "rows[1].table_row=None is not an integer"),
    (1, [Row(2**31, 100)], "rows[0].table_row=2147483648 is not in"),
    (1, [Row(0, 100.0)], "rows[0].context_tokens=100.0 is not an integer"),
    (1, [Row(0, 2**63)], "rows[0].context_tokens=9223372036854775808 is not in"),
    (1, [Row(0, 100, -1)], "rows[0].seq_id=-1 is not in"),
    (1, [(0,)], "rows[0]=(0,) is not a Row"),
    (1, None, "rows=None is not a sequence of Row"),
]


def unattached_client(**options: object) -> EpsClient:
    """A client of an absent sidecar: whatever reaches the network falls back UNAVAILABLE."""
    return EpsClient.from_request(ClientOptions(target=NOWHERE, **options),  # type: ignore[arg-type]
                                  pb.AttachRequest(engine_id="inputs"))


@pytest.mark.parametrize(("step", "rows", "message"), BAD_INPUTS)
def test_a_bad_step_input_falls_back_as_invalid_argument_naming_the_field(step, rows, message):
    with unattached_client() as client:
        result = client.select_pages(step, rows)
        assert result.fallback and result.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in result.message
        counters = client.counters()
        assert counters.steps == 1 and counters.fallback_error == 1 and counters.fallbacks == 1


@pytest.mark.parametrize(("step", "rows", "message"), BAD_INPUTS[:6])
def test_a_fail_closed_client_raises_invalid_argument_for_a_bad_step_input(step, rows, message):
    with unattached_client(fail_open=False) as client:
        with pytest.raises(EpsError) as e:
            client.select_pages(step, rows)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.message
        assert client.counters().errors == 1 and client.counters().fallbacks == 0


def test_per_step_options_that_are_not_select_options_fail_the_step():
    with unattached_client() as client:
        result = client.select_pages(1, [Row(0, 100)], {"top_pages": 3})  # type: ignore[arg-type]
        assert result.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "options={'top_pages': 3} is not a SelectOptions" in result.message


@pytest.mark.parametrize("async_reply", ["no", 1, None, 0.0])
def test_an_async_reply_that_is_not_a_bool_fails_the_step_naming_it(async_reply):
    # It was read as truthy: async_reply="no" asked epsd for an async reply.
    with unattached_client() as client:
        result = client.select_pages(1, [Row(0, 100)], async_reply=async_reply)
        assert result.fallback and result.code == grpc.StatusCode.INVALID_ARGUMENT, result
        assert f"async_reply={async_reply!r} is not a bool" in result.message


def test_a_none_step_is_not_sent_as_step_zero(epsd, rng):
    state = make_state(rng, contexts=[300])
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
        client.attach()
        state.buffers.visit_count[:] = 99
        result = client.select_pages(None, state.rows)  # type: ignore[arg-type]
        assert result.code == grpc.StatusCode.INVALID_ARGUMENT, result.message
        assert (state.buffers.visit_count == 99).all()  # epsd ran nothing
        assert client.stats().sessions[0].steps == 0
    state.buffers.close()


def test_the_counters_add_up_after_good_and_bad_steps(epsd, rng):
    state = make_state(rng, contexts=[300, 200])
    with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
        client.attach()
        calls = [(1, state.rows), (None, state.rows), (2, [Row(0, 1.5)]),
                 (np.int64(3), state.rows), (4, [Row(0, 10**6)]), (5, None),
                 (6, [Row(*(np.int64(v) for v in state.rows[1]))])]
        results = [client.select_pages(step, rows) for step, rows in calls]  # type: ignore[arg-type]
        assert [r.ok for r in results] == [True, False, False, True, False, False, True]
        assert results[3].step == 3 and type(results[3].step) is int
        c = client.counters()
        assert (c.steps, c.selected, c.fallback_error, c.errors) == (7, 3, 4, 0)
        assert c.steps == c.selected + c.fallbacks + c.errors
    state.buffers.close()


def test_a_closed_client_refuses_every_call(epsd, rng):
    state = make_state(rng, contexts=[300])
    client = state.client(ClientOptions(target=epsd.target, deadline_s=2.0))
    client.attach()
    client.close()
    client.close()  # twice is fine
    result = client.select_pages(1, state.rows)
    assert result.fallback and result.code == grpc.StatusCode.FAILED_PRECONDITION
    assert result.message == "client closed"
    for call in (client.attach, client.detach, client.heartbeat, lambda: client.ping(1.0),
                 client.stats):
        with pytest.raises(EpsError) as e:
            call()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    client.__exit__(None, None, None)
    c = client.counters()
    assert c.steps == 1 and c.fallback_error == 1
    state.buffers.close()


def test_a_fail_closed_client_raises_after_close():
    client = unattached_client(fail_open=False)
    client.close()
    with pytest.raises(EpsError) as e:
        client.select_pages(1, [Row(0, 100)])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_leaving_the_block_after_close_keeps_the_engines_exception(epsd, rng):
    state = make_state(rng, contexts=[300])
    with pytest.raises(RuntimeError) as e:
        with state.client(ClientOptions(target=epsd.target, deadline_s=2.0)) as client:
            client.attach()
            client.close()  # a shutdown hook, say
            raise RuntimeError("the engine's own error")
    assert str(e.value) == "the engine's own error" and e.value.__context__ is None
    state.buffers.close()


class ClosingTracer:
    """A traceparent callable that closes its client: gRPC runs it after the call passed its
    closed check and before the call starts, as close() from another thread can."""

    def __init__(self) -> None:
        self.client: EpsClient | None = None
        self.armed = False

    def __call__(self) -> None:
        if self.armed and self.client is not None:
            self.client.close()


@pytest.mark.parametrize("use_stream", [False, True])
def test_a_client_closed_while_a_call_starts_ends_it_as_closed(epsd, rng, use_stream):
    # grpc raised ValueError ("Cannot invoke RPC: Channel closed!") out of select_pages and
    # every other call: an exception of another kind, never a fallback.
    state = make_state(rng, contexts=[300])
    calls = {"select_pages": None, "attach": lambda c: c.attach(),
             "heartbeat": lambda c: c.heartbeat(), "ping": lambda c: c.ping(1.0),
             "stats": lambda c: c.stats(), "detach": lambda c: c.detach()}
    for name, call in calls.items():
        tracer = ClosingTracer()
        client = state.client(ClientOptions(target=epsd.target, deadline_s=2.0,
                                            use_stream=use_stream, traceparent=tracer))
        tracer.client = client
        client.attach()
        if name == "select_pages":
            assert client.select_pages(1, state.rows).ok
            client._close_stream()  # the next step opens the stream again (with metadata)
            tracer.armed = True
            result = client.select_pages(2, state.rows)
            assert result.fallback and result.code == grpc.StatusCode.FAILED_PRECONDITION
            assert result.message == "client closed"
            c = client.counters()
            assert c.steps == c.selected + c.fallbacks == 2
        else:
            tracer.armed = True
            with pytest.raises(EpsError) as e:
                call(client)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, name
    state.buffers.close()


def test_a_client_closed_while_it_starts_a_re_attach_falls_back_as_closed():
    tracer = ClosingTracer()
    client = EpsClient.from_request(ClientOptions(target=NOWHERE, traceparent=tracer),
                                    pb.AttachRequest(engine_id="inputs"))
    tracer.client, tracer.armed = client, True
    result = client.select_pages(1, [Row(0, 100)])  # not attached: starts a re-attach
    assert result.fallback and result.code == grpc.StatusCode.FAILED_PRECONDITION


def close_on_another_thread(client: EpsClient) -> None:
    """close() run to its end on another thread, as an engine's shutdown hook does while the
    engine thread is inside a call."""
    closer = threading.Thread(target=client.close)
    closer.start()
    closer.join()


class ReattachClosedWhileCollected:
    """A background re-attach that has finished: when the step asks whether it is done,
    close() runs on another thread (clearing the field and cancelling this future) before
    the step collects it."""

    def __init__(self, client: EpsClient) -> None:
        self.client = client
        self.cancelled = False

    def done(self) -> bool:
        close_on_another_thread(self.client)
        return True

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def result(self, timeout: float | None = None) -> pb.AttachResponse:
        if self.cancelled:
            raise grpc.FutureCancelledError()
        return pb.AttachResponse(session_id="granted")


@pytest.mark.parametrize("fail_open", [True, False])
def test_a_client_closed_while_a_step_collects_its_re_attach_ends_the_step_as_closed(fail_open):
    # The step read the field again after close() had set it None (AttributeError out of
    # select_pages), and a cancelled future's FutureCancelledError was not caught.
    client = unattached_client(fail_open=fail_open)
    client._reattach._pending_attach = ReattachClosedWhileCollected(client)  # type: ignore[assignment]
    if fail_open:
        result = client.select_pages(1, [Row(0, 100)])
        assert result.fallback and result.code == grpc.StatusCode.FAILED_PRECONDITION
        assert result.message == "client closed"
    else:
        with pytest.raises(EpsError) as e:
            client.select_pages(1, [Row(0, 100)])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


class HeldSelector(pb_grpc.PageSelectorServicer):
    """Attaches, then holds every step (unary or on the stream) until released, telling the
    test when one has arrived."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()

    def Attach(self, request, context):  # noqa: N802 - gRPC method name
        return pb.AttachResponse(session_id="held")

    def SelectPages(self, request, context):  # noqa: N802
        self.arrived.set()
        self.release.wait(timeout=30)
        return pb.SelectPagesResponse(step=request.step, done=True)

    def StreamSelectPages(self, request_iterator, context):  # noqa: N802
        for request in request_iterator:
            self.arrived.set()
            self.release.wait(timeout=30)
            yield pb.SelectPagesResponse(step=request.step, done=True)


@pytest.mark.parametrize("use_stream", [False, True])
def test_a_client_closed_while_epsd_holds_its_step_ends_it_as_cancelled(tmp_path, use_stream):
    servicer = HeldSelector()
    with fake_epsd(servicer, tmp_path) as target:
        client = EpsClient.from_request(
            ClientOptions(target=target, deadline_s=20.0, use_stream=use_stream),
            pb.AttachRequest(engine_id="e"))
        client.attach()
        closer = threading.Thread(target=lambda: (servicer.arrived.wait(timeout=20),
                                                  client.close()))
        closer.start()
        result = client.select_pages(1, [Row(0, 100)])
        closer.join()
        servicer.release.set()
        assert result.fallback and result.code == grpc.StatusCode.CANCELLED, result
        assert client.counters().fallbacks == 1


def test_a_client_closed_between_sending_a_step_and_waiting_for_it_ends_it_as_cancelled(
        tmp_path, monkeypatch):
    # The step read self._stream again after close() had set it None: AttributeError out of
    # select_pages instead of the closed stream's CANCELLED.
    servicer = HeldSelector()

    class ClosedAfterSend(SelectStream):
        def send(self, request: pb.SelectPagesRequest) -> None:
            super().send(request)
            close_on_another_thread(client)

    monkeypatch.setattr(client_module, "SelectStream", ClosedAfterSend)
    with fake_epsd(servicer, tmp_path) as target:
        client = EpsClient.from_request(ClientOptions(target=target, deadline_s=20.0),
                                        pb.AttachRequest(engine_id="e"))
        client.attach()
        result = client.select_pages(1, [Row(0, 100)])
        servicer.release.set()
        assert result.fallback and result.code == grpc.StatusCode.CANCELLED, result


@pytest.mark.parametrize(("step", "released"), [
    (7, [7]), (np.uint64(7), [7]), (2**64 - 1, [2**64 - 1]),
    (-1, []), (None, []), (2**64, []), ("7", []), (7.0, []), (True, []),
])
def test_on_fallback_gets_only_a_step_number_the_engine_could_have_waited_on(step, released):
    # A step refused as no uint64 (-1, None) was handed to on_fallback as it came: the
    # engine's release_dense(-1) then raised selection_done to 2**64 - 1 for good.
    seen: list[object] = []
    with unattached_client(on_fallback=seen.append) as client:
        result = client.select_pages(step, [Row(0, 100)])
        assert result.fallback
        client.close()
        client.select_pages(step, [Row(0, 100)])  # closed: the same rule
    assert seen == released * 2
    assert all(type(s) is int for s in seen)


def broken_tracer() -> str:
    raise RuntimeError("tracer broken")


@pytest.mark.parametrize("traceparent", [broken_tracer, lambda: 5, lambda: "00-abc\n-01",
                                         lambda: "00-é", lambda: b"00-0af7651916cd43dd"])
@pytest.mark.parametrize("use_stream", [False, True])
def test_a_broken_tracer_costs_the_calls_their_traceparent_only(tmp_path, caplog, traceparent,
                                                                use_stream):
    servicer = RecordingSelector()
    with fake_epsd(servicer, tmp_path) as target:
        options = ClientOptions(target=target, deadline_s=2.0, use_stream=use_stream,
                                traceparent=traceparent)
        with caplog.at_level(logging.WARNING, logger="eps_client"):
            with EpsClient.from_request(options, pb.AttachRequest(engine_id="e")) as client:
                client.attach()
                assert all(client.select_pages(s, [(0, 1, 0)]).ok for s in (1, 2, 3))
    assert servicer.metadata and all("traceparent" not in m for m in servicer.metadata)
    assert len([r for r in caplog.records if "traceparent" in r.getMessage()]) == 1


@pytest.mark.parametrize(("deadline", "error", "message"), [
    (None, None, ""),  # attach_deadline_s: the absent sidecar answers UNAVAILABLE in time
    (-1.0, ValueError, "ping(deadline_s)=-1.0 must be in (0, 3600]"),
    (float("nan"), ValueError, "ping(deadline_s)=nan is not a finite float32"),
    (1e10, ValueError, "ping(deadline_s)=10000000000.0 must be in (0, 3600]"),
    ("abc", TypeError, "ping(deadline_s)='abc' is not a number"),
])
def test_ping_takes_a_deadline_it_can_keep(deadline, error, message):
    # ping(None) once meant no deadline at all (a hung epsd blocked it for good), and a
    # deadline beyond gRPC's range failed at once as DEADLINE_EXCEEDED
    with unattached_client(attach_deadline_s=0.2) as client:
        if error is None:
            with pytest.raises(EpsError) as e:
                client.ping(deadline)
            assert e.value.code in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED)
        else:
            with pytest.raises(error) as e:
                client.ping(deadline)
            assert message in str(e.value)


def test_session_stats_without_a_session_are_refused_rather_than_listing_the_users():
    # stats() (session_only) once sent an empty id, which epsd answers with every session
    # of the caller's user: another engine's counters under this client's name
    with unattached_client() as client:
        with pytest.raises(EpsError) as e:
            client.stats()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "not attached" in e.value.message


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"num_kv_blocks": None}, TypeError, "num_kv_blocks=None is not an integer"),
    ({"num_kv_blocks": 1.5}, TypeError, "num_kv_blocks=1.5 is not an integer"),
    ({"num_kv_blocks": -1}, ValueError, "num_kv_blocks=-1 is not in"),
    ({"max_batch": True}, TypeError, "max_batch=True is a bool"),
    ({"max_batch": 2**32}, ValueError, "max_batch=4294967296 is not in"),
    ({"device": None}, TypeError, "device=None is not an integer"),
    ({"lease_ms": -5}, ValueError, "lease_ms=-5 is not in"),
    ({"engine_id": 7}, TypeError, "engine_id=7 is not a str"),
    ({"device_uuid": "GPU-0"}, TypeError, "device_uuid='GPU-0' is not bytes"),
    ({"select": {"top_pages": 4}}, TypeError, "is not a SelectOptions"),
])
def test_attach_arguments_protobuf_would_send_as_zero_are_refused_naming_them(rng, fields, error,
                                                                             message):
    state = make_state(rng, contexts=[300])
    arguments = {"engine_id": "inputs", **fields}
    with pytest.raises(error) as e:
        EpsClient(state.buffers, options=ClientOptions(target=NOWHERE), **arguments)
    assert message in str(e.value)
    state.buffers.close()


@pytest.mark.parametrize("options", [{}, {"deadline_s": 1.0}, "unix:///tmp/epsd.sock"])
def test_options_that_are_not_client_options_are_refused_naming_them(rng, options):
    # An empty dict was taken as "no options" (the defaults, silently), a filled one raised
    # AttributeError from inside the client.
    state = make_state(rng, contexts=[100])
    try:
        with pytest.raises(TypeError, match=r"options=.* is not a ClientOptions"):
            EpsClient(state.buffers, engine_id="e", options=options)
        with pytest.raises(TypeError, match=r"options=.* is not a ClientOptions"):
            EpsClient.from_request(options, pb.AttachRequest(engine_id="e"))
    finally:
        state.buffers.close()


def test_a_dropped_client_is_freed_without_the_cycle_collector(rng):
    # The re-attach helper once held the client's bound methods, a cycle that kept a dropped,
    # unclosed client (its channel, its connection to epsd) alive until gc ran.
    import gc
    import weakref

    state = make_state(rng, contexts=[100])
    gc.disable()
    try:
        client = state.client(ClientOptions(target="unix:///tmp/eps-no-such-epsd.sock"))
        ref = weakref.ref(client)
        del client
        assert ref() is None
    finally:
        gc.enable()
        state.buffers.close()


def test_a_dropped_client_closes_its_stream_and_its_channel(epsd, rng):
    # A client dropped without close() kept its stream open for good: the stream's reader
    # thread, gRPC's thread blocked on its requests, the channel and its connection to epsd.
    state = make_state(rng, contexts=[100])
    client = state.client(ClientOptions(target=epsd.target, deadline_s=2.0, use_stream=True))
    client.attach()
    assert client.select_pages(1, state.rows).ok
    stream, channel = client._stream, client._channel
    assert stream is not None and not stream.closed.is_set()
    del client  # no cycle: freed at once
    assert stream.closed.wait(timeout=10), "the dropped client's stream is still open"
    with pytest.raises(ValueError, match="closed channel"):
        channel.unary_unary("/eps.v1.PageSelector/Ping")(b"")
    state.buffers.close()
