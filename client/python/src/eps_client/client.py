"""The engine-side client of epsd, mirroring client/cpp/eps_client.h (docs/api.md).

One ``select_pages`` per decode step with a deadline; a step never waits for
anything else: re-attaching runs in the background. Fail open: on a miss, an
error or an absent sidecar the step's result says ``fallback`` and the engine
attends densely with its own block table; every fallback is counted by reason
and reported to epsd on the next step that reaches it (its
``eps_client_fallbacks_total`` metric), as the C++ client does. After a sidecar
restart (or lease expiry) the client re-attaches by itself (idempotent per
engine_id) while steps fall back (eps_client.reattach); after detach() it does not, until
attach(). Unary or bidirectional-stream transport (eps_client.stream); the stream keeps one
call open, holding only the step asked (a failed step gives it up), so a reply for another
step is an error.

The API takes and returns plain Python values (eps_client.types); failed calls
raise ``EpsError`` with a status code. Leaving a ``with EpsClient(...)`` block
detaches the session and closes the channel.

Thread safety: one engine thread calls select_pages / attach / detach at a time;
``counters()`` may be read and ``close()`` called from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import grpc

from eps_client import _values
from eps_client.client_options import ClientOptions, valid_traceparent
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc
from eps_client.reattach import BackgroundAttach
from eps_client.requests import _step_request, attach_request
from eps_client.stream import SelectStream
from eps_client.types import (
    AttachInfo,
    Backend,
    ClientCounters,
    EpsError,
    Row,
    SelectOptions,
    StepResult,
    StepStats,
)

_log = logging.getLogger("eps_client")


def _new_client_id() -> int:
    """A random, nonzero id for one client's fallback reports (client/cpp NewClientId)."""
    while True:
        if (client_id := secrets.randbits(64)) != 0:
            return client_id


_CLOSED = "client closed"
_DETACHED = "the client detached: call attach() to attach again before a step"

_FALLBACK_REASON = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "fallback_deadline",
    grpc.StatusCode.UNAVAILABLE: "fallback_unavailable",
    # epsd's own cancel (its SIGTERM drain refuses new calls so): it is going away.
    grpc.StatusCode.CANCELLED: "fallback_unavailable",
    grpc.StatusCode.NOT_FOUND: "fallback_not_attached",
}


class EpsClient:
    """Attaches an engine's buffers to epsd and selects pages once per decode step.

    ``buffers`` is the library's ShmBuffers or CudaBuffers (anything with ``layout`` and
    ``descriptors()``); ``select`` the session's policy; ``options`` the transport."""

    def __init__(self, buffers: Any, *, engine_id: str, max_batch: int | None = None,
                 num_kv_blocks: int = 0, select: SelectOptions | None = None,
                 backend: Backend = "auto", device: int = 0, lease_ms: int = 0,
                 options: ClientOptions | None = None, device_uuid: bytes = b"") -> None:
        request = attach_request(buffers, engine_id=engine_id, max_batch=max_batch,
                                 num_kv_blocks=num_kv_blocks, select=select, backend=backend,
                                 device=device, lease_ms=lease_ms, device_uuid=device_uuid)
        self._init(ClientOptions() if options is None else options, request)

    @classmethod
    def from_request(cls, options: ClientOptions, request: pb.AttachRequest) -> EpsClient:
        """A client for a prepared AttachRequest (tests, tools; engines use the constructor)."""
        client = cls.__new__(cls)
        client._init(options, request)
        return client

    def _init(self, options: ClientOptions, request: pb.AttachRequest) -> None:
        if not isinstance(options, ClientOptions):  # {} would read as "the defaults"
            raise TypeError(f"options={options!r} is not a ClientOptions")
        self.options = options
        self._attach = pb.AttachRequest()
        self._attach.CopyFrom(request)
        self._channel = self._new_channel()
        self.session_id = ""
        self.attach_info: AttachInfo | None = None
        self._attached_before = False
        self._reattach = BackgroundAttach()
        self._stream: SelectStream | None = None
        # Guards the counters, and the swaps of _stream, which close() on another thread clears
        # while the engine thread may be using it.
        self._lock = threading.Lock()
        self._counters = ClientCounters()
        self._reported = ClientCounters()  # fallbacks epsd was told about (engine thread)
        # Fixed for the client's life: epsd keeps the largest totals it saw per id.
        self.client_id = _new_client_id()
        self._closed = False
        # detach() ran and attach() has not since: steps are refused rather than re-attaching
        # by themselves (the session the engine ended would come back behind its back).
        self._detached = False
        self._traceparent_warned = False

    def _new_channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel(self.options.target, options=[
            ("grpc.initial_reconnect_backoff_ms", 20),
            ("grpc.min_reconnect_backoff_ms", 20),
            ("grpc.max_reconnect_backoff_ms", 100),
        ])
        self.stub = pb_grpc.PageSelectorStub(channel)
        return channel

    # -- lifecycle ---------------------------------------------------------------------------

    def attach(self) -> AttachInfo:
        """Attaches (or re-attaches); raises EpsError. select_pages also does this lazily,
        unless detach() ran since the last attach()."""
        self._check_open()
        self._detached = False  # whatever this call answers: steps may re-attach again
        # One attach_deadline for the whole call: a background re-attach in flight is waited
        # for within it, and a session it was granted is this call's answer.
        deadline = time.monotonic() + self.options.attach_deadline_s
        if self._take_pending_attach(deadline) and self.attach_info is not None:
            return self.attach_info
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EpsError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           "Attach: attach_deadline passed waiting for a background re-attach")
        try:
            response = self.stub.Attach(self._attach, timeout=remaining,
                                        metadata=self._metadata())
        except grpc.RpcError as e:
            self._reattach.back_off(self.options.reattach_backoff_s)
            raise EpsError(e.code(), e.details() or "") from None
        except ValueError as e:
            raise self._closed_meanwhile(e) from None
        return self._adopt(response)

    def detach(self) -> None:
        """Ends the session (raises EpsError if epsd refuses; nothing to do if not attached),
        also one a background re-attach is being granted (waiting for it, within
        attach_deadline_s), which would otherwise stay on epsd until its lease ran out.
        Until attach() is called again, every step is refused with FAILED_PRECONDITION (a
        fail-open step falls back, counted in fallback_error) and nothing re-attaches."""
        self._check_open()
        self._detached = True
        self._close_stream()
        deadline = time.monotonic() + self.options.attach_deadline_s  # one for the whole call
        self._take_pending_attach(deadline)
        if not self.session_id:
            return
        session, self.session_id = self.session_id, ""
        with self._unary_call():
            self.stub.Detach(pb.DetachRequest(session_id=session),
                             timeout=max(deadline - time.monotonic(), 0.001),
                             metadata=self._metadata())

    def heartbeat(self) -> int:
        """Renews the lease; returns it in ms."""
        self._check_open()
        with self._unary_call():
            try:
                return int(self.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id),
                                               timeout=self.options.attach_deadline_s,
                                               metadata=self._metadata()).lease_ms)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self.session_id = ""
                raise

    def ping(self, deadline_s: float | None = None) -> None:
        """An empty call within ``deadline_s`` (None: ``attach_deadline_s``); raises EpsError
        when it fails."""
        self._check_open()
        timeout = self.options.attach_deadline_s if deadline_s is None else \
            _values.duration("ping(deadline_s)", deadline_s)
        with self._unary_call():
            self.stub.Ping(pb.PingRequest(), timeout=timeout, metadata=self._metadata())

    def stats(self, session_only: bool = True) -> pb.GetStatsResponse:
        """GetStats (an operator's view; the message is returned as is). ``session_only``:
        this client's session, which it must hold (EpsError FAILED_PRECONDITION when it is not
        attached); False: the server's counters and every session of this user, ids left
        empty (docs/api.md)."""
        self._check_open()
        if _values.boolean("session_only", session_only) and not self.session_id:
            raise EpsError(grpc.StatusCode.FAILED_PRECONDITION,
                           "stats(session_only=True): the client is not attached (attach() "
                           "first, or stats(session_only=False) for every session of this user)")
        request = pb.GetStatsRequest(session_id=self.session_id if session_only else "")
        with self._unary_call():
            return self.stub.GetStats(request, timeout=self.options.attach_deadline_s,
                                      metadata=self._metadata())

    def close(self) -> None:
        """Closes the stream and the channel. It does not detach: the session stays on epsd
        until its lease runs out (``detach()`` first, or leave the ``with`` block, to end it).
        Afterwards every call raises ``EpsError(FAILED_PRECONDITION, "client closed")`` (a
        fail-open ``select_pages`` falls back with that code); closing again does nothing.
        It may be called from another thread while a call is in flight: that call ends as
        CANCELLED (the call epsd held was cancelled), or, if it had not reached epsd yet, as
        one made after close(); a fail-open ``select_pages`` falls back with either code and
        raises nothing, wherever in the step close() lands."""
        self._shut_down(wait=True)

    def __del__(self) -> None:
        """A client dropped without close() is closed as it is collected (its stream, its
        background re-attach and its channel; not detached: the session stays on epsd until
        its lease runs out). Nothing else ends them: the stream's threads hold the call, and
        gRPC does not close a channel it collects."""
        try:
            self._shut_down(wait=False)
        except Exception:  # noqa: BLE001 - a finalizer must not raise (interpreter teardown)
            pass

    def _shut_down(self, *, wait: bool) -> None:
        """close()'s work. ``wait``: join the stream's reader thread; a finalizer does not,
        since it may run on any thread that collects the client."""
        if getattr(self, "_closed", True):
            return  # closed, or never made (the constructor raised before _init)
        self._closed = True
        if (stream := self._take_stream()) is not None:
            if wait:
                stream.close()
            else:
                stream.cancel()
        self._reattach.cancel()
        self._channel.close()

    def __enter__(self) -> EpsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        """Detaches (best effort: an absent sidecar has nothing to detach) and closes; never
        raises, so that an exception leaving the block is the engine's own."""
        if self._closed:
            return  # closed already (a shutdown hook, say): no channel left to detach through
        try:
            self.detach()
        except EpsError:
            pass
        finally:
            self.close()

    def counters(self) -> ClientCounters:
        with self._lock:
            return ClientCounters(**vars(self._counters))

    # -- the step ----------------------------------------------------------------------------

    def select_pages(self, step: int, rows: Iterable[Row | tuple[int, int] | tuple[int, int, int]],
                     options: SelectOptions | None = None, *,
                     async_reply: bool = False) -> StepResult:
        """One decode step. ``rows``: Row or (table_row, context_tokens[, seq_id]) per batch
        position. ``async_reply`` (a bool; cuda backend): the reply comes once the step is
        queued and the engine's stream waits on selection_done.

        Never waits past the deadline; on a fallback, attend densely. A fail-closed client
        raises EpsError instead of falling back."""
        self._count("steps")
        start = time.monotonic()
        deadline = start + self.options.deadline_s
        if self._closed:
            return self._failed(step, grpc.StatusCode.FAILED_PRECONDITION, _CLOSED, start)
        if self._detached:
            return self._failed(step, grpc.StatusCode.FAILED_PRECONDITION, _DETACHED, start)
        try:
            request = _step_request(step, rows, options, async_reply)
        except (TypeError, ValueError, OverflowError) as e:
            # A bad input is this step's failure (counted, fallen back or raised), never an
            # exception of another kind, nor a value protobuf would send as 0.
            return self._failed(step, grpc.StatusCode.INVALID_ARGUMENT, str(e), start)
        step = request.step
        if not self.session_id:
            try:
                with self._ended_by_close():
                    reason = self._poll_reattach()
            except EpsError as e:
                return self._failed(step, e.code, e.message, start)
            if reason is not None:
                return self._failed(step, grpc.StatusCode.UNAVAILABLE, reason, start,
                                    counter="fallback_not_attached")
        request.session_id = self.session_id
        now = self.counters()
        self._add_report(request, now)
        try:
            with self._ended_by_close():
                if self.options.use_stream:
                    response = self._call_stream(request, deadline)
                else:
                    response = self._call_unary(request, deadline)
            if response.step != step:
                # epsd echoes the step it ran: another step's reply says nothing of this one.
                raise EpsError(grpc.StatusCode.INTERNAL,
                               f"epsd answered step {response.step} for step {step}")
            if request.reply_mode != pb.REPLY_MODE_ASYNC and not response.done:
                # A sync reply comes once the outputs are written: one that says otherwise
                # would have the engine read lists epsd has not finished (or written at all).
                raise EpsError(grpc.StatusCode.INTERNAL,
                               f"epsd answered step {step} with done=false, though the call "
                               "asked for a sync reply")
            if time.monotonic() > deadline:
                # A reply taken late (this thread was descheduled, say) is a miss: the
                # engine has moved on and must not use it.
                raise EpsError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "SelectPages answered after the client deadline")
        except EpsError as e:
            if e.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.CANCELLED):
                self._reported = now  # the server saw the report
            if e.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                          grpc.StatusCode.CANCELLED):
                self._close_stream()
                self.session_id = ""  # re-attach at the next step (idempotent per engine_id)
            elif (stream := self._take_stream()) is not None:
                # A miss: the stream still holds this step (and maybe later ones) for epsd,
                # which would run them after the engine gave up on them. Any other failure
                # (a reply for another step, say): a live stream must only ever hold the
                # step asked. Either way cancel it now, without waiting, and open a fresh
                # one for the next step.
                stream.cancel()
            return self._failed(step, e.code, e.message, start)
        self._reported = now
        self._count("selected")
        return StepResult(step=step, done=response.done,
                          stats=StepStats.from_proto(response.stats) if response.done else None,
                          earlier=[StepStats.from_proto(s) for s in response.earlier],
                          round_trip_us=(time.monotonic() - start) * 1e6)

    # -- internals ---------------------------------------------------------------------------

    def _add_report(self, request: pb.SelectPagesRequest, now: ClientCounters) -> None:
        """The client's fallback totals ride on the step for epsd's metrics until the server
        has surely seen them: until a reply other than UNAVAILABLE or DEADLINE_EXCEEDED, which
        may or may not have reached it. Totals with this client's id, not deltas (as
        client/cpp sends them): epsd counts only their increase, so a report that arrives
        twice counts once and none is lost."""
        if now.fallbacks == self._reported.fallbacks:
            return
        f = request.fallbacks
        f.client_id = self.client_id
        f.deadline = now.fallback_deadline
        f.unavailable = now.fallback_unavailable
        f.not_attached = now.fallback_not_attached
        f.error = now.fallback_error

    def _metadata(self) -> list[tuple[str, str]]:
        """The call's traceparent, if any. A tracer that fails or gives something that is not
        a W3C traceparent costs the call its trace context, never the call (logged once)."""
        tp = self.options.traceparent
        try:
            value = tp() if callable(tp) else tp
        except Exception as e:  # noqa: BLE001 - the tracer's failure is not the step's
            self._drop_traceparent(f"the traceparent callable raised {type(e).__name__}: {e}")
            return []
        if value is None or value == "":
            return []
        if not valid_traceparent(value):
            self._drop_traceparent(f"traceparent {value!r:.80} is not a W3C traceparent")
            return []
        assert isinstance(value, str)
        return [("traceparent", value)]

    def _drop_traceparent(self, why: str) -> None:
        if not self._traceparent_warned:
            self._traceparent_warned = True
            _log.warning("eps_client: calls go without traceparent: %s (logged once)", why)

    @contextlib.contextmanager
    def _unary_call(self) -> Iterator[None]:
        """A unary call's failures as EpsError: epsd's status, or a channel close() closed
        meanwhile (_closed_meanwhile)."""
        try:
            yield
        except grpc.RpcError as e:
            raise EpsError(e.code(), e.details() or "") from None
        except ValueError as e:
            raise self._closed_meanwhile(e) from None

    @contextlib.contextmanager
    def _ended_by_close(self) -> Iterator[None]:
        """A step's exchange with epsd, which close() on another thread may end at any point:
        it clears the stream and the re-attach in flight, cancels their calls and closes
        the channel. Whatever that makes the exchange raise (grpc's ValueError for a closed
        channel, a cancelled future, ...) ends the step as one made after close() (EpsError
        FAILED_PRECONDITION), the documented outcome, rather than escaping select_pages.
        EpsError passes as it is; an exception while the client is open is re-raised."""
        try:
            yield
        except EpsError:
            raise
        except Exception:
            if not self._closed:
                raise
            raise EpsError(grpc.StatusCode.FAILED_PRECONDITION, _CLOSED) from None

    def _closed_meanwhile(self, e: ValueError) -> EpsError:
        """grpc raises ValueError for a call on a closed channel: close() from another thread
        after this call passed its check. Such a call ends as one made after close(); any
        other ValueError is re-raised."""
        if not self._closed:
            raise e
        return EpsError(grpc.StatusCode.FAILED_PRECONDITION, _CLOSED)

    def _check_open(self) -> None:
        if self._closed:
            raise EpsError(grpc.StatusCode.FAILED_PRECONDITION, _CLOSED)

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._counters, name, getattr(self._counters, name) + 1)

    def _failed(self, step: int, code: grpc.StatusCode, message: str, start: float,
                counter: str | None = None) -> StepResult:
        if not self.options.fail_open:
            self._count("errors")
            raise EpsError(code, message)
        self._count(counter or _FALLBACK_REASON.get(code, "fallback_error"))
        if self.options.on_fallback is not None:
            # Only a step number the engine could have waited on (a uint64, as an int): a
            # step refused as not one (-1, None, 2**64) has nothing to release, and handed
            # on it would reach the engine's counters as a wrapped value (2**64 - 1).
            try:
                number = _values.integer("step", step, *_values.UINT64)
            except (TypeError, ValueError):
                number = None
            if number is not None:
                self.options.on_fallback(number)
        return StepResult(step=step, fallback=True, code=code, message=message,
                          round_trip_us=(time.monotonic() - start) * 1e6)

    def _take_pending_attach(self, deadline: float) -> bool:
        """Waits for a background re-attach until `deadline` (time.monotonic()) and adopts the
        session it was granted, if any (True); one not finished by then is cancelled."""
        if (response := self._reattach.take(deadline)) is None:
            return False
        self._adopt(response)
        return True

    def _adopt(self, response: pb.AttachResponse) -> AttachInfo:
        """The session an Attach was granted, now this client's. A reply this client cannot
        read (an empty session_id, an effective option no SelectOptions holds: a NaN top_p,
        say) grants nothing:
        EpsError INTERNAL naming it, and the next re-attach waits out the backoff, as after
        a failed Attach. epsd's reply is not trusted to be well-formed."""
        try:
            if not response.session_id:  # no step may go out with an empty id
                raise ValueError("epsd answered OK but granted no session_id")
            info = AttachInfo.from_proto(response)
        except (TypeError, ValueError) as e:
            self._reattach.back_off(self.options.reattach_backoff_s)
            raise EpsError(grpc.StatusCode.INTERNAL,
                           f"epsd's Attach reply does not decode: {e}") from None
        if self._attached_before:
            self._count("reattaches")
        self._attached_before = True
        self.session_id = response.session_id
        self.attach_info = info
        return info

    def _poll_reattach(self) -> str | None:
        """Not attached: adopts the session a finished background re-attach was granted, or
        starts one when the backoff allows (eps_client.reattach). Never waits. Returns why the
        step must fall back, or None."""
        outcome = self._reattach.poll(self.options.reattach_backoff_s, self._start_reattach,
                                       self._check_open)
        if isinstance(outcome, str):
            return outcome
        self._adopt(outcome)
        return None

    def _start_reattach(self) -> grpc.Future:
        """The background re-attach's Attach, not waited for."""
        # wait_for_ready: the Attach waits (up to its deadline) for the channel to connect
        # instead of failing at once while the channel is in reconnect backoff, so the first
        # attempt after epsd comes back succeeds.
        return self.stub.Attach.future(
            self._attach, timeout=self.options.attach_deadline_s, metadata=self._metadata(),
            wait_for_ready=True)

    def _call_unary(self, request: pb.SelectPagesRequest,
                    deadline: float) -> pb.SelectPagesResponse:
        # gRPC's own deadline backs ours up (+1 ms); ours is enforced here.
        try:
            future = self.stub.SelectPages.future(
                request, timeout=max(deadline - time.monotonic(), 0.0) + 0.001,
                metadata=self._metadata())
        except ValueError as e:
            raise self._closed_meanwhile(e) from None
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except grpc.FutureTimeoutError:
            future.cancel()
            raise EpsError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           "SelectPages missed the client deadline") from None
        except grpc.FutureCancelledError:
            raise EpsError(grpc.StatusCode.CANCELLED, "SelectPages was cancelled") from None
        except grpc.RpcError as e:
            raise EpsError(e.code(), e.details() or "") from None

    def _call_stream(self, request: pb.SelectPagesRequest,
                     deadline: float) -> pb.SelectPagesResponse:
        # close() on another thread clears self._stream (and closes that stream) at any
        # moment: the step uses its own reference, so it ends on the closed stream's
        # CANCELLED rather than on a None.
        stream = self._stream
        if stream is not None and stream.closed.is_set():
            self._close_stream()
            stream = None
        if stream is None:
            try:
                stream = SelectStream(self.stub, self._metadata())
            except ValueError as e:
                raise self._closed_meanwhile(e) from None
            with self._lock:
                self._stream = stream
            if self._closed:  # close() ran before the field was set: it never saw this one
                self._close_stream()
                raise EpsError(grpc.StatusCode.FAILED_PRECONDITION, _CLOSED)
        stream.send(request)
        return stream.receive(request.step, deadline)

    def _take_stream(self) -> SelectStream | None:
        """The open stream, if any, now the client's no longer (one thread gets it)."""
        with self._lock:
            stream, self._stream = self._stream, None
        return stream

    def _close_stream(self) -> None:
        if (stream := self._take_stream()) is not None:
            stream.close()
