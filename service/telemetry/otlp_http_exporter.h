// OTLP/HTTP with binary protobuf: POST <path> (default /v1/traces) with
// Content-Type application/x-protobuf, over a plain HTTP/1.1 socket, one
// connection per batch (batches leave every few seconds). No TLS: point it at
// a local collector, or use OTLP/gRPC for TLS (docs/observability-traces.md).
#pragma once

#include "service/telemetry/otel_config.h"
#include "service/telemetry/span_exporter.h"

namespace eps::telemetry {

class OtlpHttpExporter final : public SpanExporter {
 public:
  explicit OtlpHttpExporter(const TraceConfig& config) : config_(config) {}
  ExportResult Export(
      const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
      std::chrono::steady_clock::time_point deadline, std::string* error) override;
  std::string Describe() const override;

 private:
  const TraceConfig config_;
};

}  // namespace eps::telemetry
