"""EpsClient's re-attach after epsd restarted or the session was lost (docs/api-failures.md
§5.4), as client/cpp/reattach.h does it: a step with no session never attaches inline. It polls
this, which starts one Attach in the background once the re-attach backoff since the last
failure has passed, and falls back at once; a later step collects the session that Attach was
granted. attach() and detach() wait for the one in flight within their own deadline (take);
close() cancels it.

Thread safety: poll, take and back_off are for the engine thread, as EpsClient's calls are;
cancel (close()) may run on another thread at any moment, so the field is swapped under a lock
and the engine thread reads it once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from eps_client.proto import page_selector_pb2 as pb
from eps_client.types import EpsError


class BackgroundAttach:
    """At most one background Attach in flight. poll's ``start`` starts one (wait_for_ready,
    with the client's metadata) and returns its future; its ``check_open`` raises the client's
    EpsError (FAILED_PRECONDITION, ``client closed``) once close() ran. They and the backoff are
    passed with each call, not kept: the backoff is read from the client's options then (an
    engine may change them), and holding the client's methods would be a cycle that keeps a
    dropped, unclosed client (its channel, its connection to epsd) alive until gc runs."""

    def __init__(self) -> None:
        self._next_attach_try = 0.0
        self._pending_attach: grpc.Future | None = None
        # Guards the swaps of _pending_attach, which close() on another thread clears while the
        # engine thread may be using it.
        self._lock = threading.Lock()

    def back_off(self, backoff_s: float) -> None:
        """No re-attach starts before ``backoff_s`` from now: after a failed Attach."""
        self._next_attach_try = time.monotonic() + backoff_s

    def poll(self, backoff_s: float, start: Callable[[], grpc.Future],
             check_open: Callable[[], None]) -> pb.AttachResponse | str:
        """Not attached: collects a finished background re-attach (the AttachResponse it was
        granted) or starts one when the backoff allows. Never waits. Returns why the step must
        fall back otherwise; a failed re-attach starts a backoff of ``backoff_s``. Raises
        ``check_open``'s EpsError when close() cancelled it or ran while one was starting."""
        # close() on another thread clears the field (and cancels the call) at any moment:
        # one read of it, then only the local.
        if (pending := self._pending_attach) is not None:
            if not pending.done():
                return "re-attach in progress"
            with self._lock:
                if self._pending_attach is pending:
                    self._pending_attach = None
            try:
                return pending.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                failure: grpc.RpcError | grpc.FutureCancelledError = e
            # Out of the except: "client closed" carries no gRPC error as its context.
            check_open()  # cancelled by close(), its channel's or its own cancel
            self.back_off(backoff_s)
            if isinstance(failure, grpc.RpcError):
                return (f"not attached; re-attach failed: {failure.code().name}: "
                        f"{failure.details()}")
            return "not attached; re-attach cancelled"
        if time.monotonic() < self._next_attach_try:
            return "not attached; re-attach backing off"
        pending = start()
        with self._lock:
            self._pending_attach = pending
        try:
            check_open()
        except EpsError:
            pending.cancel()  # close() ran before the field was set: it never cancelled this one
            raise
        return "not attached; re-attach started"

    def take(self, deadline: float) -> pb.AttachResponse | None:
        """Waits for a background re-attach until `deadline` (time.monotonic()) and returns the
        AttachResponse it was granted; None when none was in flight, or it failed, or it did not
        finish by then (it is then cancelled)."""
        if (pending := self._pop_pending_attach()) is None:
            return None
        try:
            return pending.result(timeout=max(deadline - time.monotonic(), 0.0))
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
            pending.cancel()
            return None

    def cancel(self) -> None:
        """Cancels the background re-attach in flight, if any (close(), from any thread)."""
        if (pending := self._pop_pending_attach()) is not None:
            pending.cancel()

    def _pop_pending_attach(self) -> grpc.Future | None:
        """The background re-attach in flight, if any, now the caller's alone."""
        with self._lock:
            pending, self._pending_attach = self._pending_attach, None
        return pending

