"""A test OTLP trace receiver: OTLP/gRPC (TraceService/Export) and OTLP/HTTP
(POST /v1/traces, binary protobuf), both decoded with the official
opentelemetry-proto package, so the test checks epsd's bytes against the real
schema rather than against our own copy of it."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass
class Export:
    """One export call as received: its transport, request headers and decoded body."""

    transport: str  # "grpc" or "http"
    headers: dict[str, str]
    request: trace_service_pb2.ExportTraceServiceRequest


@dataclass
class ReceivedSpan:
    span: trace_pb2.Span
    resource: dict[str, str]
    scope: str
    export: Export


@dataclass
class OtlpReceiver:
    """Listens on 127.0.0.1 (ports picked by the kernel) until stop()."""

    exports: list[Export] = field(default_factory=list)
    # When set: every export is answered with an OTLP partial success that refuses all of its
    # spans, with this message (the spans are still recorded).
    reject_all: str | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def _reply(
        self, request: trace_service_pb2.ExportTraceServiceRequest
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        reply = trace_service_pb2.ExportTraceServiceResponse()
        if self.reject_all is not None:
            reply.partial_success.rejected_spans = sum(
                len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans
            )
            reply.partial_success.error_message = self.reject_all
        return reply

    def start(self) -> OtlpReceiver:
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(
                self,
                request: trace_service_pb2.ExportTraceServiceRequest,
                context: grpc.ServicerContext,
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                headers = {k: v for k, v in context.invocation_metadata()}
                receiver._add(Export("grpc", headers, request))
                return receiver._reply(request)

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(415)
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                headers = {k.lower(): v for k, v in self.headers.items()}
                receiver._add(Export("http", headers, request))
                reply = receiver._reply(request).SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self._grpc.stop(grace=None)
        self._http.shutdown()
        self._http.server_close()

    def _add(self, export: Export) -> None:
        with self._cond:
            self.exports.append(export)
            self._cond.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        out = []
        with self._cond:
            exports = list(self.exports)
        for export in exports:
            for rs in export.request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        out.append(ReceivedSpan(span, resource, ss.scope.name, export))
        return out

    def wait_for_spans(self, count: int, timeout_s: float) -> list[ReceivedSpan]:
        """Blocks until `count` spans arrived (or the timeout); returns all received."""
        with self._cond:
            self._cond.wait_for(lambda: self._count() >= count, timeout=timeout_s)
        return self.spans()

    def _count(self) -> int:
        return sum(
            len(ss.spans)
            for e in self.exports
            for rs in e.request.resource_spans
            for ss in rs.scope_spans
        )


def attributes(span: trace_pb2.Span) -> dict[str, object]:
    """The span's attributes as Python values."""
    out: dict[str, object] = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out
