// OTLP/gRPC: TraceService/Export on one channel, insecure for http://, TLS with
// the system roots for https://. Headers go as metadata. Cancel cancels the call in
// flight (ClientContext::TryCancel).
#pragma once

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/client_context.h"
#include "opentelemetry/proto/collector/trace/v1/trace_service.grpc.pb.h"
#include "service/telemetry/otel_config.h"
#include "service/telemetry/span_exporter.h"

namespace eps::telemetry {

class OtlpGrpcExporter final : public SpanExporter {
 public:
  explicit OtlpGrpcExporter(const TraceConfig& config);
  ExportOutcome Export(
      const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
      std::chrono::steady_clock::time_point deadline) override;
  void Cancel() override;
  std::string Describe() const override;

 private:
  const TraceConfig config_;
  std::unique_ptr<opentelemetry::proto::collector::trace::v1::TraceService::Stub> stub_;
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* in_flight_ ABSL_GUARDED_BY(mu_) = nullptr;  // Export's, while it calls
};

}  // namespace eps::telemetry
