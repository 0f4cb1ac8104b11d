#include "service/telemetry/telemetry.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "service/telemetry/otlp_grpc_exporter.h"
#include "service/telemetry/otlp_http_exporter.h"
#include "service/telemetry/utf8.h"

namespace eps::telemetry {

std::string SessionLabel(const std::string& session_id) {
  // "s-<counter>-<32 hex digits of randomness>": the part before the last '-' names the
  // session in traces and logs; the random part is the capability and stays out of them.
  // Whatever a caller sent, the label is bounded and valid UTF-8 (it is an OTLP string):
  // a plain cut at 64 bytes could split a character, and a strict receiver then refused
  // the whole batch.
  const size_t dash = session_id.rfind('-');
  if (dash != std::string::npos && session_id.size() - dash - 1 == 32 &&
      session_id.find_first_not_of("0123456789abcdef", dash + 1) == std::string::npos) {
    return BoundedUtf8(std::string_view(session_id).substr(0, dash), kMaxSessionLabelBytes);
  }
  return BoundedUtf8(session_id, kMaxSessionLabelBytes);  // not one of ours: no capability
}

bool IsRefusal(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kAborted:
      return false;
    default:
      return true;
  }
}

namespace {

int64_t Micros(Telemetry::Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}
int64_t Nanos(Telemetry::Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

// A failed step's message as spans and the step log keep it (kMaxStatusMessageBytes).
std::string BoundedMessage(const absl::Status& status) {
  return BoundedUtf8(std::string_view(status.message().data(), status.message().size()),
                     kMaxStatusMessageBytes);
}

const char* ReplyModeName(v1::ReplyMode mode) {
  return mode == v1::REPLY_MODE_ASYNC ? "async" : "sync";
}

std::optional<TraceContext> ParentFromMetadata(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  const auto parent = metadata.find("traceparent");
  if (parent == metadata.end()) return std::nullopt;
  // Several tracestate headers are one list, joined with commas in their order (W3C Trace
  // Context, "Combining tracestate headers"); only the first was read before.
  std::string state;
  const auto [first, last] = metadata.equal_range("tracestate");
  for (auto it = first; it != last; ++it) {
    if (it != first) state.push_back(',');
    state.append(it->second.data(), it->second.size());
  }
  return ParseTraceparent(std::string_view(parent->second.data(), parent->second.size()), state);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Telemetry>> Telemetry::Create(
    TelemetryOptions options, const EnvLookup& env,
    std::function<ScrapeSources::Sessions()> sessions, std::unique_ptr<SpanExporter> exporter) {
  auto t = std::unique_ptr<Telemetry>(new Telemetry());
  t->metrics_listen_ = options.metrics_listen;
  t->step_log_ = std::move(options.step_log);
  absl::StatusOr<TraceConfig> config = TraceConfigFromEnv(env);
  if (!config.ok()) return config.status();
  t->config_ = *std::move(config);
  if (exporter == nullptr && t->config_.enabled) {
    if (t->config_.protocol == OtlpProtocol::kGrpc) {
      exporter = std::make_unique<OtlpGrpcExporter>(t->config_);
    } else {
      exporter = std::make_unique<OtlpHttpExporter>(t->config_);
    }
  }
  if (exporter != nullptr) {  // the variables asked for traces, or a test gave an exporter
    t->config_.enabled = true;
    t->processor_ = std::make_unique<BatchSpanProcessor>(std::move(exporter), t->config_.batch,
                                                         t->config_.timeout, t->config_.resource);
  }
  ScrapeSources sources;
  sources.sessions = std::move(sessions);
  Telemetry* raw = t.get();
  sources.traces = [raw]() {
    ScrapeSources::Traces out;
    if (raw->processor_ == nullptr) return out;
    const BatchSpanProcessor::Counts c = raw->processor_->counts();
    out.exported = c.exported;
    out.dropped = c.dropped;
    out.export_failures = c.export_failures;
    return out;
  };
  sources.step_log_dropped = [raw]() -> uint64_t {
    return raw->step_log_ == nullptr ? 0 : raw->step_log_->dropped();
  };
  t->metrics_ = std::make_unique<ServerMetrics>(std::move(sources));
  if (!options.metrics_listen.empty()) {
    if (absl::Status s = t->metrics_->Serve(options.metrics_listen); !s.ok()) return s;
  }
  return t;
}

Telemetry::~Telemetry() {
  Shutdown(std::chrono::milliseconds(2000));
  // The exposer's scrape thread reads processor_ and step_log_ through the sources: stop it first.
  metrics_.reset();
}

void Telemetry::Shutdown(std::chrono::milliseconds budget) {
  if (processor_ != nullptr) processor_->Shutdown(budget);
  // The step log stays open until destruction so late steps still land; its destructor flushes.
}

std::string Telemetry::Describe() const {
  std::string out = metrics_->port() > 0
                        ? absl::StrCat("metrics on http://",
                                       metrics_listen_.substr(0, metrics_listen_.rfind(':')), ":",
                                       metrics_->port(), "/metrics")
                        : std::string("metrics not served");
  absl::StrAppend(&out, "; traces ",
                  processor_ != nullptr
                      ? absl::StrCat("to ", processor_->exporter().Describe(), " (sampler ",
                                     config_.sampler.Describe(), ")")
                      : std::string("off"));
  absl::StrAppend(&out, "; step log ", step_log_ == nullptr ? "off" : step_log_->path());
  return out;
}

Telemetry::Call Telemetry::BeginCall(RpcMethod method, const grpc::ServerContextBase& context) {
  metrics_->RpcStarted(method);
  Call call{method, Clock::now(), std::nullopt};
  if (processor_ != nullptr &&
      (method == RpcMethod::kSelectPages || method == RpcMethod::kStreamSelectPages)) {
    call.parent = ParentFromMetadata(context);
  }
  return call;
}

void Telemetry::EndCall(const Call& call, const absl::Status& status, bool refused) {
  const double seconds = std::chrono::duration<double>(Clock::now() - call.start).count();
  metrics_->RpcHandled(call.method, static_cast<grpc::StatusCode>(status.code()), seconds);
  if (refused && IsRefusal(status.code())) metrics_->ValidationFailure(status.code());
}

Telemetry::Step Telemetry::BeginStep(const v1::SelectPagesRequest& request) {
  if (request.has_fallbacks()) metrics_->ClientFallbacks(request.fallbacks());
  return Step{Clock::now(), absl::GetCurrentTimeNanos()};
}

void Telemetry::EndStep(const Call& call, const Step& step, const v1::SelectPagesRequest& request,
                        const v1::SelectPagesResponse& response, const absl::Status& status,
                        service::BackendKind backend) {
  const Clock::time_point selected = Clock::now();
  // A step the client gave up on (CANCELLED, DEADLINE_EXCEEDED) was not refused.
  if (IsRefusal(status.code())) metrics_->ValidationFailure(status.code());
  // Sync replies carry this step's stats; async ones carry earlier steps' as they finish.
  const bool has_stats = status.ok() && response.has_stats() && response.done();
  if (has_stats) metrics_->StepSelected(response.stats(), backend);
  // An earlier async step that failed (StepStats.error) was attended densely, not selected.
  for (const v1::StepStats& earlier : response.earlier()) {
    if (earlier.error().empty()) metrics_->StepSelected(earlier, backend);
  }
  std::string trace_id;
  if (processor_ != nullptr) {
    ExportSpans(call, step, selected, request, response, status, backend, &trace_id);
  }
  if (step_log_ != nullptr) {
    LogStep(step, selected, request, has_stats ? &response.stats() : nullptr, status, backend,
            trace_id, call.method);
    // An earlier step's line was written when it was replied to, without statistics; these
    // lines carry them, and nothing of the call that brought them (its batch and time).
    for (const v1::StepStats& earlier : response.earlier()) {
      LogLateStats(step, request, earlier, backend, call.method);
    }
  }
}

void Telemetry::ExportSpans(const Call& call, const Step& step, Clock::time_point selected,
                            const v1::SelectPagesRequest& request,
                            const v1::SelectPagesResponse& response, const absl::Status& status,
                            service::BackendKind backend, std::string* trace_id_hex) {
  const TraceId trace_id = call.parent ? call.parent->trace_id : NewTraceId();
  if (!config_.sampler.ShouldSample(call.parent, trace_id)) return;
  std::vector<SpanRecord> spans(1);
  SpanRecord& server = spans[0];
  server.trace_id = trace_id;
  server.span_id = NewSpanId();
  if (call.parent) {
    server.parent_span_id = call.parent->span_id;
    server.parent_is_remote = true;
    server.trace_state = call.parent->trace_state;
  }
  server.trace_flags = 1;
  server.name = "eps.v1.PageSelector/SelectPages";
  server.kind = SpanKind::kServer;
  server.start_unix_ns = step.start_unix_ns;
  server.end_unix_ns = step.start_unix_ns + Nanos(selected - step.start);
  auto& a = server.attributes;
  a.push_back({"rpc.system", std::string("grpc")});
  a.push_back({"rpc.service", std::string("eps.v1.PageSelector")});
  a.push_back(
      {"rpc.method", std::string(call.method == RpcMethod::kStreamSelectPages ? "StreamSelectPages"
                                                                              : "SelectPages")});
  a.push_back({"rpc.grpc.status_code", static_cast<int64_t>(status.code())});
  a.push_back({"eps.session_id", SessionLabel(request.session_id())});
  a.push_back({"eps.step", static_cast<int64_t>(request.step())});
  a.push_back({"eps.batch_size", static_cast<int64_t>(request.rows_size())});
  a.push_back({"eps.backend", std::string(service::BackendKindName(backend))});
  a.push_back({"eps.reply_mode", std::string(ReplyModeName(request.reply_mode()))});
  const bool has_stats = status.ok() && response.has_stats() && response.done();
  if (has_stats) {
    const v1::StepStats& s = response.stats();
    a.push_back({"eps.groups_total", s.groups_total()});
    a.push_back({"eps.groups_visited", s.groups_visited()});
    a.push_back({"eps.pages_total", s.pages_total()});
    a.push_back({"eps.pages_visited", s.pages_visited()});
    a.push_back({"eps.bytes_kv_dense", s.bytes_kv_dense()});
    a.push_back({"eps.bytes_kv_read_est", s.bytes_kv_read_est()});
    a.push_back({"eps.bytes_summary_read", s.bytes_summary_read()});
    a.push_back({"eps.prepass_us", s.prepass_us()});
  }
  if (!status.ok()) {
    server.error = true;
    server.status_message = BoundedMessage(status);
  }
  if (has_stats) {
    // The pre-pass as measured by the backend (CUDA events on the GPU), placed so it ends
    // when the session service returned, and never before the server span starts.
    SpanRecord prepass;
    prepass.trace_id = trace_id;
    prepass.span_id = NewSpanId();
    prepass.parent_span_id = server.span_id;
    prepass.trace_state = server.trace_state;
    prepass.name = "eps.prepass";
    prepass.kind = SpanKind::kInternal;
    prepass.end_unix_ns = server.end_unix_ns;
    const auto length = static_cast<uint64_t>(std::max(0.0, response.stats().prepass_us()) * 1e3);
    prepass.start_unix_ns =
        std::max(server.start_unix_ns, prepass.end_unix_ns - std::min(length, prepass.end_unix_ns));
    prepass.attributes.push_back({"eps.backend", std::string(service::BackendKindName(backend))});
    prepass.attributes.push_back(
        {"eps.timing",
         std::string(backend == service::BackendKind::kCuda ? "cuda_events" : "cpu_wall")});
    prepass.attributes.push_back({"eps.prepass_us", response.stats().prepass_us()});
    spans.push_back(std::move(prepass));
  }
  *trace_id_hex = Hex(trace_id);
  processor_->OnEnd(spans);
}

namespace {

// StepStats as step-log fields, the same in a step's line and a late_stats line.
void AddStats(const v1::StepStats& s, nlohmann::ordered_json& line) {
  line["groups_total"] = s.groups_total();
  line["groups_visited"] = s.groups_visited();
  line["groups_skipped"] = s.groups_total() - s.groups_visited();
  line["pages_total"] = s.pages_total();
  line["pages_visited"] = s.pages_visited();
  line["pages_skipped"] = s.pages_total() - s.pages_visited();
  line["bytes_kv_dense"] = s.bytes_kv_dense();
  line["bytes_kv_read_est"] = s.bytes_kv_read_est();
  line["bytes_kv_saved_est"] = s.bytes_kv_dense() - s.bytes_kv_read_est();
  line["bytes_summary_read"] = s.bytes_summary_read();
  line["prepass_us"] = std::round(s.prepass_us() * 1000) / 1000;
}

std::string FormatUnixNanos(int64_t unix_ns) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::FromUnixNanos(unix_ns),
                          absl::UTCTimeZone());
}

}  // namespace

void Telemetry::LogLateStats(const Step& carrier, const v1::SelectPagesRequest& carrier_request,
                             const v1::StepStats& stats, service::BackendKind backend,
                             RpcMethod method) {
  // batch and server_us belong to the step's own line (written at its reply); null here
  // rather than the carrying call's.
  nlohmann::ordered_json line = {
      {"time", FormatUnixNanos(carrier.start_unix_ns)},
      {"kind", "late_stats"},
      {"session", SessionLabel(carrier_request.session_id())},
      {"step", stats.step()},
      {"batch", nullptr},
      {"backend", service::BackendKindName(backend)},
      {"reply_mode", ReplyModeName(v1::REPLY_MODE_ASYNC)},
      {"transport", method == RpcMethod::kStreamSelectPages ? "stream" : "unary"},
      // A failed async step's error comes without a code: UNKNOWN, the message in "error".
      {"status", stats.error().empty() ? "OK" : "UNKNOWN"},
      {"server_us", nullptr},
      {"reported_with_step", carrier_request.step()}};
  if (stats.error().empty()) {
    AddStats(stats, line);
  } else {
    line["error"] = BoundedUtf8(stats.error(), kMaxStatusMessageBytes);
  }
  step_log_->Append(line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
}

void Telemetry::LogStep(const Step& step, Clock::time_point end,
                        const v1::SelectPagesRequest& request, const v1::StepStats* s,
                        const absl::Status& status, service::BackendKind backend,
                        const std::string& trace_id, RpcMethod method) {
  // One object per line; invalid UTF-8 (a session id is bytes) is replaced, not thrown on.
  nlohmann::ordered_json line = {
      {"time", FormatUnixNanos(step.start_unix_ns)},
      {"session", SessionLabel(request.session_id())},
      {"step", request.step()},
      {"batch", request.rows_size()},
      {"backend", service::BackendKindName(backend)},
      {"reply_mode", ReplyModeName(request.reply_mode())},
      {"transport", method == RpcMethod::kStreamSelectPages ? "stream" : "unary"},
      {"status", absl::StatusCodeToString(status.code())},
      {"server_us", Micros(end - step.start)}};
  if (s != nullptr) AddStats(*s, line);
  if (!status.ok()) line["error"] = BoundedMessage(status);
  if (!trace_id.empty()) line["trace_id"] = trace_id;
  step_log_->Append(line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
}

}  // namespace eps::telemetry
