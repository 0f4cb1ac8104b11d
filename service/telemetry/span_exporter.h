// Sends one encoded batch of spans somewhere. Implementations: OTLP/gRPC and
// OTLP/HTTP. The batch span processor owns retries; an exporter makes one
// attempt, bounded by `deadline`, and says whether a retry may help.
//
// Thread safety: Export is called from one thread (the processor's worker).
#pragma once

#include <chrono>
#include <string>

#include "opentelemetry/proto/collector/trace/v1/trace_service.pb.h"

namespace eps::telemetry {

enum class ExportResult {
  kSuccess,
  kRetryable,  // the receiver is unavailable or overloaded: try again later
  kFailed,     // the receiver rejected the batch: retrying cannot help
};

class SpanExporter {
 public:
  virtual ~SpanExporter() = default;
  virtual ExportResult Export(
      const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
      std::chrono::steady_clock::time_point deadline, std::string* error) = 0;
  virtual std::string Describe() const = 0;  // e.g. "otlp/grpc localhost:4317"
};

}  // namespace eps::telemetry
