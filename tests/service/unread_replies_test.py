"""Replies a client never reads, end to end against the real epsd: a client that never opens
its HTTP/2 window (a raw socket speaking just enough HTTP/2) makes epsd hold its replies; a
session holds at most eight (four handed to gRPC, four parked), unary and stream replies
alike, and its end ends them (docs/api-failures.md §5.7, docs/security.md, "replies never
read"). The start_epsd fixture is in conftest.py.

Run by ctest with EPSD_BIN set and client/python/src on PYTHONPATH."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc
from observability_test import Epsd


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: str, value: str) -> bytes:  # HPACK: literal, not indexed, no Huffman
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


class _UnreadingClient:
    """HTTP/2 on epsd's socket, by hand: a zero initial window that is never opened, so no
    reply message can reach it, while headers (not flow-controlled) still do. Acknowledges
    SETTINGS and PING; records which streams got headers, which ended (END_STREAM), and which
    epsd reset (RST_STREAM)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.headers: set[int] = set()
        self.ended: set[int] = set()
        self.reset: set[int] = set()
        self._cond = threading.Condition()
        settings = _frame(4, 0, 0, (4).to_bytes(2, "big") + (0).to_bytes(4, "big"))
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # the test closes the socket
            self._frames()

    def _frames(self) -> None:
        buf = b""
        while data := self.sock.recv(65536):
            buf += data
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                size = int.from_bytes(buf[:3], "big")
                kind, flags = buf[3], buf[4]
                stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9 : 9 + size], buf[9 + size :]
                if kind == 4 and not flags & 1:
                    self.sock.sendall(_frame(4, 1, 0, b""))
                elif kind == 6 and not flags & 1:
                    self.sock.sendall(_frame(6, 1, 0, payload))
                elif kind == 1:
                    with self._cond:
                        self.headers.add(stream)
                        if flags & 1:
                            self.ended.add(stream)
                        self._cond.notify_all()
                elif kind == 3:
                    with self._cond:
                        self.reset.add(stream)
                        self._cond.notify_all()

    def close(self) -> None:
        """Closes the connection. close() alone does not while the reader thread waits in
        recv() (Linux keeps the socket open until that call returns): epsd saw it closed only
        if the reader happened to be out of recv() at that moment, or once epsd next sent
        something. shutdown() ends the connection, and the recv(), at once."""
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def wait(self, done: Callable[[], bool]) -> None:
        with self._cond:
            assert self._cond.wait_for(done, timeout=30)

    def open_window(self, streams: list[int]) -> None:
        """Lets those streams' replies in (a WINDOW_UPDATE each, and the connection's)."""
        grow = (1 << 24).to_bytes(4, "big")
        self.sock.sendall(b"".join(_frame(8, 0, s, grow) for s in [0, *streams]))

    def call(self, stream: int, method: str, message: bytes, wait: bool = True,
             timeout: str = "") -> None:
        """Sends one unary call and (``wait``) waits until epsd has answered it with headers.
        ``timeout``: a grpc-timeout header's value ("200m": 200 ms), none when empty."""
        fields = [(":method", "POST"), (":scheme", "http"), (":path", method),
                  (":authority", "localhost"), ("content-type", "application/grpc"),
                  ("te", "trailers")] + ([("grpc-timeout", timeout)] if timeout else [])
        headers = b"".join(_literal(n, v) for n, v in fields)
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        self.sock.sendall(_frame(1, 4, stream, headers) + _frame(0, 1, stream, body))
        if wait:
            with self._cond:
                assert self._cond.wait_for(lambda: stream in self.headers, timeout=30), stream


    def cancel(self, streams: list[int]) -> None:
        """Cancels those calls (RST_STREAM, CANCEL), as a client that gives up does."""
        self.sock.sendall(b"".join(_frame(3, 0, s, (8).to_bytes(4, "big")) for s in streams))


_UNREAD_BLOCKS, _UNREAD_BATCH = 64, 2
_UNREAD_ROWS = [pb.BatchRow(table_row=0, context_tokens=_UNREAD_BLOCKS * 16)] * _UNREAD_BATCH


def _attach_unread(stub: pb_grpc.PageSelectorStub, engine: str = "unread") -> str:
    """Attaches a small inline cpu session of `engine` (replacing its live one); its id."""
    blocks, batch = _UNREAD_BLOCKS, _UNREAD_BATCH

    def inline(shape: list[int], dtype: int, data: bytes = b"") -> pb.MemoryDescriptor:
        return pb.MemoryDescriptor(
            inline_bytes=pb.InlineBytes(data=data), shape=shape, dtype=dtype)

    def attach(words: int) -> pb.AttachRequest:
        layout = pb.ModelLayout(num_layers=2, num_q_heads=1, num_kv_heads=1, head_dim=4,
                                block_size=16, group_blocks=1, sketch_dim=1)
        table = b"".join(i.to_bytes(4, "little") for i in range(blocks))
        return pb.AttachRequest(
            engine_id=engine, layout=layout, max_batch=batch,
            options=pb.SelectOptions(method=pb.METHOD_OFF),
            buffers=pb.SharedBuffers(
                summary_pool=inline([1, 2, 1, words], pb.DTYPE_FLOAT32),
                group_table=inline([1, blocks], pb.DTYPE_INT32),
                block_table=inline([1, blocks], pb.DTYPE_INT32, table),
                queries=inline([2, batch, 1, 4], pb.DTYPE_FLOAT32),
                visit_blocks=inline([2, batch, blocks], pb.DTYPE_INT32),
                visit_count=inline([2, batch], pb.DTYPE_INT32)))

    try:
        return stub.Attach(attach(1), timeout=30).session_id
    except grpc.RpcError as refused:  # the record's size, as epsd names it
        words = int(re.search(r"record_words=(\d+)", refused.details()).group(1))
        return stub.Attach(attach(words), timeout=30).session_id


@contextlib.contextmanager
def _unread_session(
        epsd: Epsd) -> Iterator[tuple[pb_grpc.PageSelectorStub, str, _UnreadingClient]]:
    """A channel's stub to `epsd`, a session attached through it, and a client on epsd's
    socket that never reads (each test's steps go out on it)."""
    with grpc.insecure_channel(epsd.target) as channel:
        stub = pb_grpc.PageSelectorStub(channel)
        session = _attach_unread(stub)
        yield stub, session, _UnreadingClient(epsd.target.removeprefix("unix://"))


def _last_step(stub: pb_grpc.PageSelectorStub, session: str) -> int:
    return stub.GetStats(pb.GetStatsRequest(session_id=session), timeout=30).sessions[0].last_step


def _wait_for_step(stub: pb_grpc.PageSelectorStub, session: str, step: int) -> None:
    """Waits until `session` has run `step` (a parked reply sends nothing to wait for)."""
    deadline = time.monotonic() + 30
    while _last_step(stub, session) < step:
        assert time.monotonic() < deadline, f"step {step} did not run"
        time.sleep(0.01)


def _step_unread(stub: pb_grpc.PageSelectorStub, client: _UnreadingClient, session: str,
                 step: int, timeout: str = "", method: str = "SelectPages") -> int:
    """Sends `session`'s `step` on `client` (stream 2 * step - 1), waits until it has run, and
    returns the stream. `method`: SelectPages, or StreamSelectPages (one request, then the
    client's half-close)."""
    stream = 2 * step - 1
    request = pb.SelectPagesRequest(session_id=session, step=step, rows=_UNREAD_ROWS)
    client.call(stream, f"/eps.v1.PageSelector/{method}", request.SerializeToString(),
                wait=False, timeout=timeout)
    _wait_for_step(stub, session, step)
    return stream


def _steps_all_answered(stub: pb_grpc.PageSelectorStub, session: str, first: int) -> None:
    """A reading client's 20 steps of `session` from `first` on are all answered OK: the
    session holds no place of a call that has ended."""
    for step in range(first, first + 20):
        stub.SelectPages(pb.SelectPagesRequest(session_id=session, step=step, rows=_UNREAD_ROWS),
                         timeout=30)


def test_replies_a_client_never_reads_wait_at_most_eight_per_session(
    tmp_path: Path, start_epsd: Callable[..., Epsd]
) -> None:
    # A step's reply waits in epsd until the client's window lets it out. Every reply of a
    # client that never read waited: 200 calls of 6.3 MB replies grew epsd from 41 MB to
    # 2.84 GB, past --max-server-bytes. Now a session has at most four replies handed to
    # gRPC and four parked behind them; a later step answers RESOURCE_EXHAUSTED, a status
    # alone, which reaches the client with its window still closed (before, no call of
    # this test ended). A parked reply goes out once an earlier one is done: a client that
    # reads late (or whose earlier calls' OnDone runs late, on a loaded host) is answered,
    # never refused (before, the fifth unread reply was refused at once).
    epsd = start_epsd(tmp_path, {}, [])
    rows = _UNREAD_ROWS
    with _unread_session(epsd) as (stub, session, client):
        calls = 10
        for i in range(calls):
            step = pb.SelectPagesRequest(session_id=session, step=i + 1, rows=rows)
            parked = 4 <= i < 8  # no headers until a place frees: wait for its step instead
            client.call(2 * i + 1, "/eps.v1.PageSelector/SelectPages", step.SerializeToString(),
                        wait=not parked)
            if parked:
                _wait_for_step(stub, session, i + 1)
        # Four replies wait for the window (headers sent), four are parked (nothing sent),
        # the last two ended with their status.
        stream = [2 * i + 1 for i in range(calls)]
        assert client.ended == set(stream[8:])
        assert client.headers == set(stream[:4]) | set(stream[8:])
        # The client reads its first two replies: the two oldest parked ones take their
        # places and send their headers (their messages then wait for the window in turn).
        client.open_window(stream[:2])
        client.wait(lambda: {stream[0], stream[1]} <= client.ended
                    and {stream[4], stream[5]} <= client.headers)
        assert stream[6] not in client.headers and stream[7] not in client.headers
        # Dropping the connection drops its replies: the session steps again.
        client.close()
        for attempt in range(100):
            try:
                stub.SelectPages(pb.SelectPagesRequest(session_id=session, step=calls + 1 + attempt,
                                                       rows=rows), timeout=30)
                break
            except grpc.RpcError as refused:
                assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
                time.sleep(0.05)
        else:
            pytest.fail("the session's replies stayed counted after their connection closed")


@pytest.mark.parametrize("end", ["detach", "replace"])
def test_the_replies_a_session_left_unread_end_with_it(
    tmp_path: Path, end: str, start_epsd: Callable[..., Epsd]
) -> None:
    # The eight replies were counted per session, and kept when the session ended: with
    # --max-sessions=1, five rounds of Attach, eight steps never read and Detach (or a
    # replacing Attach) left 20 replies handed to gRPC and 20 parked on their open
    # connections, five times what the one session allowed may hold, and more each round.
    # A session's end now cancels the replies it holds (RST_STREAM: gRPC drops what it
    # kept for them) and answers its parked ones NOT_FOUND.
    epsd = start_epsd(tmp_path, {}, ["--max-sessions=1"])
    step = pb.SelectPagesRequest(rows=_UNREAD_ROWS)
    with _unread_session(epsd) as (stub, session, client):
        streams = [2 * i + 1 for i in range(7)]  # four held, three parked
        for i, stream in enumerate(streams):
            step.session_id, step.step = session, i + 1
            client.call(stream, "/eps.v1.PageSelector/SelectPages", step.SerializeToString(),
                        wait=False)
            _wait_for_step(stub, session, i + 1)
        # A client that reads, on another connection, parks behind them.
        step.step = len(streams) + 1
        reader = stub.SelectPages.future(step, timeout=30)
        _wait_for_step(stub, session, step.step)
        client.wait(lambda: set(streams[:4]) <= client.headers)
        assert not client.headers & set(streams[4:]) and not reader.done()
        if end == "detach":
            stub.Detach(pb.DetachRequest(session_id=session), timeout=30)
        else:
            assert _attach_unread(stub) != session
        client.wait(lambda: set(streams[:4]) <= client.reset and set(streams[4:]) <= client.ended)
        assert reader.exception().code() == grpc.StatusCode.NOT_FOUND, reader.exception()
        assert "before this step's reply was sent" in reader.exception().details()
        assert not client.reset & set(streams[4:])
        client.close()


def test_a_parked_call_its_client_cancels_or_lets_expire_leaves_the_line(
    tmp_path: Path, start_epsd: Callable[..., Epsd]
) -> None:
    # A parked reply is not in gRPC's hands: only epsd can end its call, and take it out of
    # the line, when the client cancels it (RST_STREAM) or its grpc-timeout passes.
    epsd = start_epsd(tmp_path, {}, [])
    with _unread_session(epsd) as (stub, session, client):
        held = [_step_unread(stub, client, session, step) for step in range(1, 5)]
        client.wait(lambda: set(held) <= client.headers)
        cancelled = [_step_unread(stub, client, session, step) for step in (5, 6)]
        expiring = _step_unread(stub, client, session, 7, timeout="200m")
        waiting = _step_unread(stub, client, session, 8)
        client.cancel(cancelled)
        client.wait(lambda: expiring in client.ended)  # its deadline ended it
        # Three places in line are free again: three more park, a fourth is refused.
        parked = [_step_unread(stub, client, session, step) for step in (9, 10, 11)]
        refused = _step_unread(stub, client, session, 12)
        client.wait(lambda: refused in client.ended)
        assert not client.ended & {waiting, *parked}
        # The first held reply read: the oldest parked one still waiting takes its place.
        client.open_window(held[:1])
        client.wait(lambda: held[0] in client.ended and waiting in client.headers)
        assert not client.headers & set(parked)
        client.close()
        _steps_all_answered(stub, session, 13)


def test_a_reading_client_behind_a_connection_that_never_reads_is_answered_once_it_closes(
    tmp_path: Path, start_epsd: Callable[..., Epsd]
) -> None:
    # Two connections of one session: the replies one never reads hold the session's places,
    # and the other's step parks behind them; the first closing hands it a place.
    epsd = start_epsd(tmp_path, {}, [])
    with _unread_session(epsd) as (stub, session, client):
        for step in range(1, 7):  # four held, two parked
            _step_unread(stub, client, session, step)
        reader = stub.SelectPages.future(
            pb.SelectPagesRequest(session_id=session, step=7, rows=_UNREAD_ROWS), timeout=30)
        _wait_for_step(stub, session, 7)
        assert not reader.done()
        client.close()
        assert reader.result().step == 7
        _steps_all_answered(stub, session, 8)


def test_stream_replies_a_client_never_reads_take_the_sessions_places(
    tmp_path: Path, start_epsd: Callable[..., Epsd]
) -> None:
    # A stream reads its next request only once its last reply is written, so one stream
    # holds one reply; but a client opens as many streams as it likes (100 at once per
    # connection, on any number of connections), one step each. Their replies were counted
    # nowhere: 60 streams of one session, 4.2 MB replies never read, grew epsd from 21 MB to
    # 272 MB (developer machine, 2026-11-28), and Detach left them all. A stream's reply now
    # takes a place among its session's unsent replies as a unary one does: four held, four
    # parked, the rest refused with a status alone; a connection that closes gives its
    # places back.
    epsd = start_epsd(tmp_path, {}, [])
    with _unread_session(epsd) as (stub, session, client):
        streams = [_step_unread(stub, client, session, step, method="StreamSelectPages")
                   for step in range(1, 11)]
        client.wait(lambda: set(streams[:4]) <= client.headers
                    and set(streams[8:]) <= client.ended)
        assert client.headers == set(streams[:4]) | set(streams[8:])
        # Unary replies share the places: this one is refused too.
        with pytest.raises(grpc.RpcError) as refused:
            stub.SelectPages(pb.SelectPagesRequest(session_id=session, step=11,
                                                   rows=_UNREAD_ROWS), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        # The first held reply read: the oldest parked stream takes its place.
        client.open_window(streams[:1])
        client.wait(lambda: streams[0] in client.ended and streams[4] in client.headers)
        assert not client.headers & set(streams[5:8])
        client.close()
        _steps_all_answered(stub, session, 12)


def test_stream_replies_a_session_left_unread_end_with_it(
    tmp_path: Path, start_epsd: Callable[..., Epsd]
) -> None:
    # The session's end cancels the stream replies it holds (RST_STREAM) and ends its
    # parked streams with NOT_FOUND, as for unary replies; before, Detach left every one.
    epsd = start_epsd(tmp_path, {}, [])
    with _unread_session(epsd) as (stub, session, client):
        streams = [_step_unread(stub, client, session, step, method="StreamSelectPages")
                   for step in range(1, 8)]  # four held, three parked
        client.wait(lambda: set(streams[:4]) <= client.headers)
        assert not client.headers & set(streams[4:])
        stub.Detach(pb.DetachRequest(session_id=session), timeout=30)
        client.wait(lambda: set(streams[:4]) <= client.reset and set(streams[4:]) <= client.ended)
        assert not client.reset & set(streams[4:])
        client.close()


def test_sigterm_ends_epsd_with_replies_held_and_parked(
    tmp_path: Path, start_epsd: Callable[..., Epsd]
) -> None:
    # gRPC cancels the calls left at --drain-ms; the parked replies' calls, which gRPC was
    # never handed, must then end too (cancelled, or handed the places the held ones free),
    # or the drain would wait for them until the backstop (exit 1, "drain timed out").
    epsd = start_epsd(tmp_path, {}, ["--drain-ms=200"])
    with _unread_session(epsd) as (stub, session, client):
        for step in range(1, 9):  # four held, four parked
            _step_unread(stub, client, session, step)
    epsd.stop()  # asserts exit status 0
    assert "drain timed out" not in epsd.log()
