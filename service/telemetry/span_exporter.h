// Sends one encoded batch of spans somewhere. Implementations: OTLP/gRPC and
// OTLP/HTTP. The batch span processor owns retries; an exporter makes one
// attempt, bounded by `deadline`, and says whether a retry may help.
//
// Thread safety: Export is called from one thread (the processor's worker); Cancel from
// any thread, at any time.
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
  // Ends the attempt in flight, if any, at once (it returns kFailed), and makes every later
  // Export return kFailed without trying. The processor's Shutdown calls it once its budget
  // is spent: an attempt begun before the shutdown has a deadline of its own
  // (OTEL_EXPORTER_OTLP_TIMEOUT, 10 s by default) that would otherwise hold epsd's exit.
  virtual void Cancel() = 0;
  virtual std::string Describe() const = 0;  // e.g. "otlp/grpc localhost:4317"
};

}  // namespace eps::telemetry
