"""The engine-side client of epsd (DESIGN §5-6), mirroring client/cpp/eps_client.h.

One ``select_pages`` per decode step with a deadline (default 2 ms); a step never
waits for anything else: re-attaching runs in the background. Fail open: on a
miss, an error or an absent sidecar the step's result says ``fallback`` and the
engine attends densely with its own block table; every fallback is counted by
reason. After a sidecar restart (or lease expiry) the client re-attaches by
itself (idempotent per engine_id) while steps fall back. Unary or
bidirectional-stream transport; the stream keeps one call open and matches
replies by step.

Thread safety: one engine thread calls select_pages / attach / detach at a time;
``counters()`` may be read from any thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc

Traceparent = str | Callable[[], str | None] | None


@dataclass
class ClientOptions:
    target: str = "unix:///tmp/epsd.sock"
    deadline_s: float = 0.002  # per select_pages
    attach_deadline_s: float = 0.5  # attach, detach, heartbeat, re-attach
    reattach_backoff_s: float = 0.1  # between re-attach attempts
    fail_open: bool = True  # False: a failed step is an error for the engine
    use_stream: bool = False
    # W3C trace context sent as "traceparent" metadata: a fixed string, or a
    # callable asked once per call (e.g. the current OpenTelemetry span's).
    traceparent: Traceparent = None


@dataclass
class StepResult:
    fallback: bool = False  # attend densely this step (fail-open only)
    code: grpc.StatusCode = grpc.StatusCode.OK  # why, when fallback; the error when fail-closed
    message: str = ""
    response: pb.SelectPagesResponse | None = None
    round_trip_us: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.fallback and self.code == grpc.StatusCode.OK


@dataclass
class ClientCounters:
    steps: int = 0
    selected: int = 0
    fallback_deadline: int = 0
    fallback_unavailable: int = 0
    fallback_not_attached: int = 0
    fallback_error: int = 0
    reattaches: int = 0
    errors: int = 0  # failed steps returned to a fail-closed engine (not fallbacks)

    @property
    def fallbacks(self) -> int:
        return (self.fallback_deadline + self.fallback_unavailable + self.fallback_not_attached
                + self.fallback_error)


class EpsError(Exception):
    """A failed call: ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


_FALLBACK_REASON = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "fallback_deadline",
    grpc.StatusCode.UNAVAILABLE: "fallback_unavailable",
    grpc.StatusCode.NOT_FOUND: "fallback_not_attached",
}


class _Stream:
    """One open StreamSelectPages call: requests go through a queue, replies are
    read by a thread into another queue and matched by step."""

    _END = object()

    def __init__(self, stub: pb_grpc.PageSelectorStub, metadata: list[tuple[str, str]]) -> None:
        self._requests: queue.Queue[object] = queue.Queue()
        self.replies: queue.Queue[object] = queue.Queue()
        self.closed = threading.Event()
        self.final: tuple[grpc.StatusCode, str] = (grpc.StatusCode.UNAVAILABLE, "stream closed")
        self._call = stub.StreamSelectPages(self._outgoing(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="eps-stream-reader", daemon=True)
        self._reader.start()

    def _outgoing(self) -> Iterator[pb.SelectPagesRequest]:
        while True:
            item = self._requests.get()
            if item is self._END:
                return
            assert isinstance(item, pb.SelectPagesRequest)
            yield item

    def _read(self) -> None:
        try:
            for reply in self._call:
                self.replies.put(reply)
        except grpc.RpcError as e:
            self.final = (e.code(), e.details() or "")
        finally:
            self.closed.set()
            self.replies.put(self._END)

    def send(self, request: pb.SelectPagesRequest) -> None:
        self._requests.put(request)

    def receive(self, step: int, deadline: float) -> pb.SelectPagesResponse:
        while True:
            remaining = deadline - time.monotonic()
            try:
                reply = self.replies.get(timeout=max(remaining, 0.0)) if remaining > 0 \
                    else self.replies.get_nowait()
            except queue.Empty:
                raise EpsError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no reply for step {step} in time") from None
            if reply is self._END:
                self.replies.put(self._END)  # later receives see the end too
                raise EpsError(*self.final)
            assert isinstance(reply, pb.SelectPagesResponse)
            if reply.step == step:
                return reply
            # a reply to a step the engine gave up on: dropped

    def close(self) -> None:
        self._requests.put(self._END)
        self._call.cancel()
        self._reader.join(timeout=5)


class EpsClient:
    """Attaches an engine's buffers to epsd and selects pages once per decode step."""

    def __init__(self, options: ClientOptions, attach: pb.AttachRequest) -> None:
        self.options = options
        self._attach = pb.AttachRequest()
        self._attach.CopyFrom(attach)
        self._channel = grpc.insecure_channel(options.target, options=[
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 500),
        ])
        self.stub = pb_grpc.PageSelectorStub(self._channel)
        self.session_id = ""
        self.attach_response: pb.AttachResponse | None = None
        self._attached_before = False
        self._next_attach_try = 0.0
        self._pending_attach: grpc.Future | None = None
        self._stream: _Stream | None = None
        self._lock = threading.Lock()  # guards the counters
        self._counters = ClientCounters()

    # -- lifecycle ---------------------------------------------------------------------------

    def attach(self) -> pb.AttachResponse:
        """Attaches (or re-attaches); raises EpsError. select_pages also does this lazily."""
        if self._pending_attach is not None:
            pending, self._pending_attach = self._pending_attach, None
            try:
                self._adopt(pending.result())
            except grpc.RpcError:
                pass
        try:
            response = self.stub.Attach(self._attach, timeout=self.options.attach_deadline_s,
                                        metadata=self._metadata())
        except grpc.RpcError as e:
            self._next_attach_try = time.monotonic() + self.options.reattach_backoff_s
            raise EpsError(e.code(), e.details() or "") from None
        self._adopt(response)
        return response

    def detach(self) -> None:
        self._close_stream()
        if not self.session_id:
            return
        session, self.session_id = self.session_id, ""
        try:
            self.stub.Detach(pb.DetachRequest(session_id=session),
                             timeout=self.options.attach_deadline_s, metadata=self._metadata())
        except grpc.RpcError as e:
            raise EpsError(e.code(), e.details() or "") from None

    def heartbeat(self) -> int:
        """Renews the lease; returns it in ms."""
        try:
            return self.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id),
                                       timeout=self.options.attach_deadline_s,
                                       metadata=self._metadata()).lease_ms
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self.session_id = ""
            raise EpsError(e.code(), e.details() or "") from None

    def ping(self, deadline_s: float) -> None:
        try:
            self.stub.Ping(pb.PingRequest(), timeout=deadline_s, metadata=self._metadata())
        except grpc.RpcError as e:
            raise EpsError(e.code(), e.details() or "") from None

    def stats(self, session_only: bool = True) -> pb.GetStatsResponse:
        request = pb.GetStatsRequest(session_id=self.session_id if session_only else "")
        try:
            return self.stub.GetStats(request, timeout=self.options.attach_deadline_s,
                                      metadata=self._metadata())
        except grpc.RpcError as e:
            raise EpsError(e.code(), e.details() or "") from None

    def close(self) -> None:
        """Closes the stream and the channel (without detaching)."""
        self._close_stream()
        if self._pending_attach is not None:
            self._pending_attach.cancel()
            self._pending_attach = None
        self._channel.close()

    def __enter__(self) -> EpsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def counters(self) -> ClientCounters:
        with self._lock:
            return ClientCounters(**vars(self._counters))

    # -- the step ----------------------------------------------------------------------------

    def select_pages(self, step: int, rows: Iterable[pb.BatchRow | tuple[int, int, int]],
                     options: pb.SelectOptions | None = None) -> StepResult:
        """One decode step. ``rows`` are BatchRow messages or (table_row, context_tokens, seq_id).

        Never waits past the deadline; on a fallback, attend densely."""
        self._count("steps")
        start = time.monotonic()
        deadline = start + self.options.deadline_s
        if not self.session_id:
            reason = self._poll_reattach()
            if reason is not None:
                return self._failed(grpc.StatusCode.UNAVAILABLE, reason, start,
                                    counter="fallback_not_attached")
        request = pb.SelectPagesRequest(session_id=self.session_id, step=step)
        for row in rows:
            if isinstance(row, pb.BatchRow):
                request.rows.append(row)
            else:
                table_row, context_tokens, seq_id = row
                request.rows.add(table_row=table_row, context_tokens=context_tokens,
                                 seq_id=seq_id)
        if options is not None:
            request.options.CopyFrom(options)
        try:
            if self.options.use_stream:
                response = self._call_stream(request, deadline)
            else:
                response = self._call_unary(request, deadline)
            if time.monotonic() > deadline:
                # A reply taken late (this thread was descheduled, say) is a miss: the
                # engine has moved on and must not use it.
                raise EpsError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "SelectPages answered after the client deadline")
        except EpsError as e:
            if e.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                self._close_stream()
            if e.code == grpc.StatusCode.NOT_FOUND:
                self.session_id = ""  # re-attach at the next step
            return self._failed(e.code, e.message, start)
        self._count("selected")
        return StepResult(response=response, round_trip_us=(time.monotonic() - start) * 1e6)

    # -- internals ---------------------------------------------------------------------------

    def _metadata(self) -> list[tuple[str, str]]:
        tp = self.options.traceparent
        value = tp() if callable(tp) else tp
        return [("traceparent", value)] if value else []

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._counters, name, getattr(self._counters, name) + 1)

    def _failed(self, code: grpc.StatusCode, message: str, start: float,
                counter: str | None = None) -> StepResult:
        result = StepResult(code=code, message=message,
                            round_trip_us=(time.monotonic() - start) * 1e6)
        if not self.options.fail_open:
            self._count("errors")
            return result
        self._count(counter or _FALLBACK_REASON.get(code, "fallback_error"))
        result.fallback = True
        return result

    def _adopt(self, response: pb.AttachResponse) -> None:
        if self._attached_before:
            self._count("reattaches")
        self._attached_before = True
        self.session_id = response.session_id
        self.attach_response = response

    def _poll_reattach(self) -> str | None:
        """Not attached: collects a finished background re-attach or starts one when the
        backoff allows. Never waits. Returns why the step must fall back, or None."""
        if self._pending_attach is not None:
            if not self._pending_attach.done():
                return "re-attach in progress"
            pending, self._pending_attach = self._pending_attach, None
            try:
                self._adopt(pending.result())
                return None
            except grpc.RpcError as e:
                self._next_attach_try = time.monotonic() + self.options.reattach_backoff_s
                return f"re-attach failed: {e.code().name}: {e.details()}"
        if time.monotonic() < self._next_attach_try:
            return "not attached; re-attach backing off"
        self._pending_attach = self.stub.Attach.future(
            self._attach, timeout=self.options.attach_deadline_s, metadata=self._metadata())
        return "not attached; re-attach started"

    def _call_unary(self, request: pb.SelectPagesRequest,
                    deadline: float) -> pb.SelectPagesResponse:
        # gRPC's own deadline backs ours up (+1 ms); ours is enforced here.
        future = self.stub.SelectPages.future(
            request, timeout=max(deadline - time.monotonic(), 0.0) + 0.001,
            metadata=self._metadata())
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except grpc.FutureTimeoutError:
            future.cancel()
            raise EpsError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           "SelectPages missed the client deadline") from None
        except grpc.RpcError as e:
            raise EpsError(e.code(), e.details() or "") from None

    def _call_stream(self, request: pb.SelectPagesRequest,
                     deadline: float) -> pb.SelectPagesResponse:
        if self._stream is not None and self._stream.closed.is_set():
            self._close_stream()
        if self._stream is None:
            self._stream = _Stream(self.stub, self._metadata())
        self._stream.send(request)
        return self._stream.receive(request.step, deadline)

    def _close_stream(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            stream.close()


def batch_rows(rows: Sequence[tuple[int, int, int]]) -> list[pb.BatchRow]:
    """BatchRow messages from (table_row, context_tokens, seq_id) triples."""
    return [pb.BatchRow(table_row=r, context_tokens=c, seq_id=s) for r, c, s in rows]


