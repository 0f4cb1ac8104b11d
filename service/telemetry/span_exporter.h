// Sends one encoded batch of spans somewhere. Implementations: OTLP/gRPC and
// OTLP/HTTP. The batch span processor owns retries; an exporter makes one
// attempt, bounded by `deadline`, and says whether a retry may help and, when the
// receiver answered, how many of the spans it took (OTLP partial success).
//
// Thread safety: Export is called from one thread (the processor's worker); Cancel from
// any thread, at any time.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

#include "opentelemetry/proto/collector/trace/v1/trace_service.pb.h"

namespace eps::telemetry {

enum class ExportResult {
  kSuccess,
  kRetryable,  // the receiver is unavailable or overloaded: try again later
  kFailed,     // the receiver rejected the batch: retrying cannot help
};

// What one export attempt came to.
struct ExportOutcome {
  ExportResult result = ExportResult::kFailed;
  // kSuccess only: of the request's spans, those the receiver took and those it refused
  // (OTLP partial_success.rejected_spans); the two add up to the request's spans.
  uint64_t accepted = 0;
  uint64_t rejected = 0;
  // Why the attempt failed, or the receiver's word on the spans it refused.
  std::string message;

  static ExportOutcome Failure(ExportResult result, std::string message) {
    return {result, 0, 0, std::move(message)};
  }
  // The receiver answered: `spans` were sent, and it says it refused `rejected` of them
  // (clamped to [0, spans]: the number is the receiver's).
  static ExportOutcome Success(uint64_t spans, int64_t rejected, std::string message) {
    const uint64_t refused = std::min<uint64_t>(spans, rejected > 0 ? rejected : 0);
    return {ExportResult::kSuccess, spans - refused, refused, std::move(message)};
  }
};

// The spans in a request.
inline uint64_t CountSpans(
    const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request) {
  uint64_t n = 0;
  for (const auto& rs : request.resource_spans()) {
    for (const auto& ss : rs.scope_spans()) n += static_cast<uint64_t>(ss.spans_size());
  }
  return n;
}

class SpanExporter {
 public:
  virtual ~SpanExporter() = default;
  virtual ExportOutcome Export(
      const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
      std::chrono::steady_clock::time_point deadline) = 0;
  // Ends the attempt in flight, if any, at once (it returns kFailed), and makes every later
  // Export return kFailed without trying. The processor's Shutdown calls it once its budget
  // is spent: an attempt begun before the shutdown has a deadline of its own
  // (OTEL_EXPORTER_OTLP_TIMEOUT, 10 s by default) that would otherwise hold epsd's exit.
  virtual void Cancel() = 0;
  virtual std::string Describe() const = 0;  // e.g. "otlp/grpc localhost:4317"
};

}  // namespace eps::telemetry
