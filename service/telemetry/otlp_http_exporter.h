// OTLP/HTTP with binary protobuf: POST <path> (default /v1/traces) with
// Content-Type application/x-protobuf, over a plain HTTP/1.1 socket, one
// connection per batch (batches leave every few seconds). No TLS: point it at
// a local collector, or use OTLP/gRPC for TLS (docs/observability-traces.md).
// A 2xx reply's body (an ExportTraceServiceResponse, up to 64 KiB, plain or
// chunked) gives the spans the receiver refused (partial success).
// Every wait of an attempt (the name lookup, connect, send, the reply) polls an
// eventfd beside its socket, so Cancel ends it at once.
#pragma once

#include <atomic>

#include "service/telemetry/otel_config.h"
#include "service/telemetry/span_exporter.h"

namespace eps::telemetry {

class OtlpHttpExporter final : public SpanExporter {
 public:
  explicit OtlpHttpExporter(const TraceConfig& config);
  ~OtlpHttpExporter() override;
  OtlpHttpExporter(const OtlpHttpExporter&) = delete;
  OtlpHttpExporter& operator=(const OtlpHttpExporter&) = delete;
  ExportOutcome Export(
      const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
      std::chrono::steady_clock::time_point deadline) override;
  void Cancel() override;
  std::string Describe() const override;

 private:
  ExportOutcome TryOnce(
      const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
      std::chrono::steady_clock::time_point deadline);

  const TraceConfig config_;
  // Readable once Cancel ran (never read from, so it stays readable). -1 when eventfd
  // failed: attempts then end at their deadlines only.
  const int cancel_fd_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace eps::telemetry
