"""Observability against callers and collectors that misbehave, end to end: the real epsd
with its OTLP exporter pointed at the test receiver (the official opentelemetry-proto
package, which refuses ill-formed UTF-8 as the Collector does). Requests are sent with the
Python stubs so that they can carry what the C++ client never sends: repeated and invalid
tracestate headers, session ids of megabytes. Replies a client never reads are in
unread_replies_test.py; the start_epsd fixture in conftest.py.

Run by ctest with EPSD_BIN set and client/python/src on PYTHONPATH."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc
from observability_test import SERVER_SPAN, Epsd, metric, wait_for_metric
from otlp_receiver import OtlpReceiver, attributes


@pytest.fixture
def collector() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def select_pages(
    target: str, session_id: str, metadata: list[tuple[str, str]] | None = None
) -> grpc.RpcError:
    """One SelectPages that epsd must refuse; returns its error."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.PageSelectorStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.SelectPages(
                pb.SelectPagesRequest(session_id=session_id, step=1),
                metadata=metadata or [],
                timeout=30,
            )
    return refused.value


def test_tracestate_headers_are_joined_and_an_invalid_one_is_dropped(
    tmp_path: Path, collector: OtlpReceiver, start_epsd: Callable[..., Epsd]
) -> None:
    epsd = start_epsd(
        tmp_path,
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{collector.grpc_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "10",
        },
        [],
    )
    parent = "00f067aa0ba902b7"
    cases = {
        # W3C: several tracestate headers are one list, in order (only the first was read).
        "1" * 32: ([("tracestate", "a=1"), ("tracestate", " b=2 ,")], "a=1,b=2"),
        # Upper case is not a key: the whole header is dropped, the traceparent still used.
        "2" * 32: ([("tracestate", "a=1"), ("tracestate", "B=2")], ""),
    }
    for trace_id, (headers, _) in cases.items():
        error = select_pages(
            epsd.target, "s-none", [("traceparent", f"00-{trace_id}-{parent}-01"), *headers]
        )
        assert error.code() == grpc.StatusCode.NOT_FOUND
    spans = collector.wait_for_spans(len(cases), timeout_s=30)
    epsd.stop()
    servers = {s.span.trace_id.hex(): s.span for s in spans if s.span.name == SERVER_SPAN}
    assert set(servers) == set(cases)
    for trace_id, (_, want) in cases.items():
        assert servers[trace_id].trace_state == want
        assert servers[trace_id].parent_span_id.hex() == parent


def test_a_huge_session_id_reaches_no_reply_span_or_log_line_unbounded(
    tmp_path: Path, collector: OtlpReceiver, start_epsd: Callable[..., Epsd]
) -> None:
    # NOT_FOUND quoted the whole id: 60 calls with 8 MB ids grew epsd from 18 MB to 1.39 GB
    # and wrote 480 MB of step log, and one 5 MB id made a batch larger than the receiver's
    # 4 MiB limit (this receiver's too: grpcio's default), losing every span in it.
    step_log = tmp_path / "steps.jsonl"
    epsd = start_epsd(
        tmp_path,
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{collector.grpc_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "10",
        },
        [f"--step-log={step_log}"],
    )
    calls = 3
    for i in range(calls):
        error = select_pages(epsd.target, chr(ord("a") + i) * (5 << 20))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert len(error.details()) <= 200, error.details()[:300]
    spans = collector.wait_for_spans(calls, timeout_s=30)
    epsd.stop()
    servers = [s.span for s in spans if s.span.name == SERVER_SPAN]
    assert len(servers) == calls
    for span in servers:
        assert len(span.status.message) <= 256
        assert len(str(attributes(span)["eps.session_id"]).encode()) <= 64
    lines = step_log.read_bytes().splitlines()
    assert len(lines) == calls
    for line in lines:
        assert len(line) <= 1024, line[:300]
        assert json.loads(line)["status"] == "NOT_FOUND"


@contextlib.contextmanager
def silent_grpc_collector() -> Iterator[tuple[int, threading.Event]]:
    """An OTLP/gRPC server whose Export takes the call and never answers (until the block
    ends); yields its port and an event set once a call arrived."""
    called, release = threading.Event(), threading.Event()

    def export(request: bytes, context: grpc.ServicerContext) -> bytes:
        called.set()
        release.wait()
        return b""

    class Handler(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if details.method.endswith("TraceService/Export"):
                return grpc.unary_unary_rpc_method_handler(export)
            return None

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((Handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, called
    finally:
        release.set()
        server.stop(grace=None)


@contextlib.contextmanager
def silent_http_collector() -> Iterator[tuple[int, threading.Event]]:
    """A TCP listener that accepts, reads what comes and never answers; yields its port and an
    event set once request bytes arrived."""
    called = threading.Event()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        held: list[socket.socket] = []

        def serve() -> None:
            with contextlib.suppress(OSError):
                while True:
                    connection, _ = listener.accept()
                    held.append(connection)
                    if connection.recv(65536):
                        called.set()

        threading.Thread(target=serve, daemon=True).start()
        try:
            yield listener.getsockname()[1], called
        finally:
            for connection in held:
                connection.close()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_sigterm_cancels_an_export_the_collector_never_answers(
    tmp_path: Path, protocol: str, start_epsd: Callable[..., Epsd]
) -> None:
    # An attempt in flight at SIGTERM ran to OTEL_EXPORTER_OTLP_TIMEOUT (10 s by default):
    # past the 2 s flush the docs promise and past the drain's backstop, so epsd exited 1
    # ("drain timed out"). Shutdown now cancels it once the 2 s are spent.
    silent = silent_grpc_collector() if protocol == "grpc" else silent_http_collector()
    with silent as (port, called):
        epsd = start_epsd(
            tmp_path,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                "OTEL_BSP_SCHEDULE_DELAY": "10",
            },
            ["--drain-ms=200"],
        )
        select_pages(epsd.target, "s-none")
        assert called.wait(timeout=30), "no export reached the collector"
        select_pages(epsd.target, "s-none")  # queued behind the attempt in flight
        seconds = epsd.stop()  # asserts exit status 0
    assert "drain timed out" not in epsd.log()
    # The drain (200 ms) and the 2 s flush budget; the backstop would end it at 6.2 s.
    assert seconds < 5, epsd.log()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_the_receiver_refuses_are_dropped_and_logged_not_exported(
    tmp_path: Path, collector: OtlpReceiver, protocol: str, start_epsd: Callable[..., Epsd]
) -> None:
    # An OTLP partial success (the receiver took the request and refused spans in it) was
    # counted as exported: the gRPC exporter built a message and dropped it, the HTTP
    # exporter never read the body.
    collector.reject_all = "over quota"
    port = collector.grpc_port if protocol == "grpc" else collector.http_port
    epsd = start_epsd(
        tmp_path,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_BSP_SCHEDULE_DELAY": "10",
        },
        [],
    )
    calls = 3
    for _ in range(calls):
        select_pages(epsd.target, "s-none")
    assert wait_for_metric(epsd, "eps_trace_spans_dropped_total", calls) == calls
    m = epsd.scrape()
    assert metric(m, "eps_trace_spans_exported_total") == 0
    assert metric(m, "eps_trace_export_failures_total") == 0  # answered: nothing to retry
    epsd.stop()
    assert "rejected" in epsd.log() and "over quota" in epsd.log()
