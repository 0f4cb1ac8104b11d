// OTLP/gRPC: TraceService/Export on one channel, insecure for http://, TLS with
// the system roots for https://. Headers go as metadata.
#pragma once

#include <memory>

#include "opentelemetry/proto/collector/trace/v1/trace_service.grpc.pb.h"
#include "service/telemetry/otel_config.h"
#include "service/telemetry/span_exporter.h"

namespace eps::telemetry {

class OtlpGrpcExporter final : public SpanExporter {
 public:
  explicit OtlpGrpcExporter(const TraceConfig& config);
  ExportResult Export(
      const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
      std::chrono::steady_clock::time_point deadline, std::string* error) override;
  std::string Describe() const override;

 private:
  const TraceConfig config_;
  std::unique_ptr<opentelemetry::proto::collector::trace::v1::TraceService::Stub> stub_;
};

}  // namespace eps::telemetry
