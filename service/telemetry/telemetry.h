// epsd's telemetry, composed: Prometheus metrics, OTLP traces through the batch
// span processor, the JSONL step log. The gRPC layer calls it around every RPC
// and every SelectPages step; it knows nothing of selection itself, only the
// requests, replies and StepStats that pass by.
//
// Per step on the RPC thread: relaxed atomic counter adds, a sharded histogram
// observation, and — only when a span is sampled or the step log is on —
// building two SpanRecords / one JSON line and handing them off under a short
// lock. Export and disk writes happen on their own threads.
//
// Thread safety: every method may be called concurrently.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "eps/v1/page_selector.pb.h"
#include "grpcpp/server_context.h"
#include "service/telemetry/batch_span_processor.h"
#include "service/telemetry/metrics.h"
#include "service/telemetry/otel_config.h"
#include "service/telemetry/step_log.h"
#include "service/telemetry/trace_context.h"

namespace eps::telemetry {

struct TelemetryOptions {
  std::string metrics_listen;  // host:port, empty: no /metrics endpoint (metrics still counted)
  // The open --step-log file, which the telemetry then owns; null: no step log. Opened by
  // the caller, where a path that cannot be opened is a bad command line (epsd's exit 2).
  std::unique_ptr<StepLog> step_log;
};

// What traces, the step log and status messages show of a session id: its public part
// only (a session id is a capability, docs/security.md), at most kMaxSessionLabelBytes of
// valid UTF-8 (a longer id is cut on a character boundary and ends with "…").
inline constexpr size_t kMaxSessionLabelBytes = 64;
std::string SessionLabel(const std::string& session_id);

// Whether a failed call's status is the session service refusing the request
// (eps_validation_failures_total): INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION,
// RESOURCE_EXHAUSTED, PERMISSION_DENIED, ... A call the client gave up on (CANCELLED,
// DEADLINE_EXCEEDED), a transport failure (UNAVAILABLE) and epsd's own failure
// (INTERNAL, UNKNOWN, DATA_LOSS, ABORTED) are not refusals; OK is none.
bool IsRefusal(absl::StatusCode code);

// The most of a failed step's status message a span (its status message) and the step log
// (its "error") keep: a message can quote a request, whose strings are the caller's bytes.
inline constexpr size_t kMaxStatusMessageBytes = 256;

class Telemetry {
 public:
  using Clock = std::chrono::steady_clock;

  // Reads the OTEL_* variables through `env`. `sessions` reports the session service's session
  // counts. `exporter`, when given, takes the spans instead of the OTLP exporter the variables
  // name, and turns traces on (tests).
  static absl::StatusOr<std::unique_ptr<Telemetry>> Create(
      TelemetryOptions options, const EnvLookup& env,
      std::function<ScrapeSources::Sessions()> sessions,
      std::unique_ptr<SpanExporter> exporter = nullptr);
  ~Telemetry();  // Shutdown(2 s) if not done
  Telemetry(const Telemetry&) = delete;
  Telemetry& operator=(const Telemetry&) = delete;

  // One RPC (a whole stream for StreamSelectPages).
  struct Call {
    RpcMethod method;
    Clock::time_point start;
    std::optional<TraceContext> parent;  // from traceparent / tracestate metadata
  };
  Call BeginCall(RpcMethod method, const grpc::ServerContextBase& context);
  // `refused`: the status came from the session service (counted as a validation failure
  // when IsRefusal).
  void EndCall(const Call& call, const absl::Status& status, bool refused);

  // One SelectPages step, unary or one message of a stream.
  struct Step {
    Clock::time_point start;
    int64_t start_unix_ns;
  };
  Step BeginStep(const v1::SelectPagesRequest& request);  // counts the client's fallback report
  // `backend`: the kind of the session's backend (kCpu when no session was found). With
  // async replies, `response.earlier` carries earlier steps' statistics: they are counted,
  // and each gets a step-log line of its own kind ("late_stats", docs/observability-traces.md).
  void EndStep(const Call& call, const Step& step, const v1::SelectPagesRequest& request,
               const v1::SelectPagesResponse& response, const absl::Status& status,
               service::BackendKind backend);

  // Exports what is queued (within `budget`) and closes the step log.
  void Shutdown(std::chrono::milliseconds budget);

  ServerMetrics& metrics() { return *metrics_; }
  bool tracing() const { return processor_ != nullptr; }
  // A line for epsd's start-up log: where metrics, traces and steps go.
  std::string Describe() const;
  const std::vector<std::string>& warnings() const { return config_.warnings; }

 private:
  Telemetry() = default;
  void ExportSpans(const Call& call, const Step& step, Clock::time_point selected,
                   const v1::SelectPagesRequest& request, const v1::SelectPagesResponse& response,
                   const absl::Status& status, service::BackendKind backend, std::string* trace_id);
  void LogStep(const Step& step, Clock::time_point end, const v1::SelectPagesRequest& request,
               const v1::StepStats* stats, const absl::Status& status, service::BackendKind backend,
               const std::string& trace_id, RpcMethod method);
  // The statistics of an earlier async step, reported with the step `carrier`.
  void LogLateStats(const Step& carrier, const v1::SelectPagesRequest& carrier_request,
                    const v1::StepStats& stats, service::BackendKind backend, RpcMethod method);

  TraceConfig config_;
  std::string metrics_listen_;  // TelemetryOptions::metrics_listen
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<BatchSpanProcessor> processor_;
  std::unique_ptr<StepLog> step_log_;
};

}  // namespace eps::telemetry
