"""One open StreamSelectPages call of EpsClient (docs/api-failures.md §5.7).

Requests go through a queue, replies are read by a thread into another queue, the first
of them the step's; a step that misses its deadline cancels the call without waiting for it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc

from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc
from eps_client.types import EpsError


class SelectStream:
    """One open StreamSelectPages call: requests go through a queue, replies are
    read by a thread into another queue; EpsClient checks each reply's step."""

    _END = object()

    def __init__(self, stub: pb_grpc.PageSelectorStub, metadata: list[tuple[str, str]]) -> None:
        # SimpleQueue: its put may run in a finalizer (a dropped EpsClient cancels its stream
        # from __del__, on whatever thread collects it), which Queue's lock would not allow.
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
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
            # The first reply is the answer: a live stream holds only the step asked (a
            # step that fails gives its stream up), so one for another step is the caller's
            # error at once (epsd answered step … for step …), not a wait for one that
            # will not come.
            return reply

    def cancel(self) -> None:
        """Ends the call without waiting: epsd sees it cancelled and runs none of the
        requests it has not read; the reader thread, and gRPC's thread that reads the
        requests, end on their own. Safe in a finalizer."""
        self._requests.put(self._END)
        self._call.cancel()

    def close(self) -> None:
        self.cancel()
        self._reader.join(timeout=5)
