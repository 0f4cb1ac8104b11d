#include "service/telemetry/telemetry.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "service/telemetry/otlp_grpc_exporter.h"
#include "service/telemetry/otlp_http_exporter.h"

namespace eps::telemetry {
namespace {

int64_t Micros(Telemetry::Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}
int64_t Nanos(Telemetry::Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

const char* ReplyModeName(v1::ReplyMode mode) {
  return mode == v1::REPLY_MODE_ASYNC ? "async" : "sync";
}

std::optional<TraceContext> ParentFromMetadata(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  const auto parent = metadata.find("traceparent");
  if (parent == metadata.end()) return std::nullopt;
  const auto state = metadata.find("tracestate");
  return ParseTraceparent(std::string_view(parent->second.data(), parent->second.size()),
                          state == metadata.end()
                              ? std::string_view()
                              : std::string_view(state->second.data(), state->second.size()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Telemetry>> Telemetry::Create(
    const TelemetryOptions& options, const EnvLookup& env,
    std::function<ScrapeSources::Sessions()> sessions) {
  auto t = std::unique_ptr<Telemetry>(new Telemetry());
  t->options_ = options;
  absl::StatusOr<TraceConfig> config = TraceConfigFromEnv(env);
  if (!config.ok()) return config.status();
  t->config_ = *std::move(config);
  if (!options.step_log_path.empty()) {
    absl::StatusOr<std::unique_ptr<StepLog>> log = StepLog::Open(options.step_log_path);
    if (!log.ok()) return log.status();
    t->step_log_ = *std::move(log);
  }
  if (t->config_.enabled) {
    std::unique_ptr<SpanExporter> exporter;
    if (t->config_.protocol == OtlpProtocol::kGrpc) {
      exporter = std::make_unique<OtlpGrpcExporter>(t->config_);
    } else {
      exporter = std::make_unique<OtlpHttpExporter>(t->config_);
    }
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
  std::string out =
      metrics_->port() > 0
          ? absl::StrCat("metrics on http://",
                         options_.metrics_listen.substr(0, options_.metrics_listen.rfind(':')), ":",
                         metrics_->port(), "/metrics")
          : std::string("metrics not served");
  absl::StrAppend(&out, "; traces ",
                  processor_ != nullptr
                      ? absl::StrCat("to ", processor_->exporter().Describe(), " (sampler ",
                                     config_.sampler.Describe(), ")")
                      : std::string("off"));
  absl::StrAppend(&out, "; step log ",
                  options_.step_log_path.empty() ? "off" : options_.step_log_path);
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
  if (refused && !status.ok()) metrics_->ValidationFailure(status.code());
}

Telemetry::Step Telemetry::BeginStep(const v1::SelectPagesRequest& request) {
  if (request.has_fallbacks()) metrics_->ClientFallbacks(request.fallbacks());
  return Step{Clock::now(), absl::GetCurrentTimeNanos()};
}

void Telemetry::EndStep(const Call& call, const Step& step, const v1::SelectPagesRequest& request,
                        const v1::SelectPagesResponse& response, const absl::Status& status,
                        service::BackendKind backend) {
  const Clock::time_point selected = Clock::now();
  if (!status.ok()) metrics_->ValidationFailure(status.code());
  // Sync replies carry this step's stats; async ones carry earlier steps' as they finish.
  const bool has_stats = status.ok() && response.has_stats() && response.done();
  if (has_stats) metrics_->StepSelected(response.stats(), backend);
  for (const v1::StepStats& earlier : response.earlier()) metrics_->StepSelected(earlier, backend);
  std::string trace_id;
  if (processor_ != nullptr) {
    ExportSpans(call, step, selected, request, response, status, backend, &trace_id);
  }
  if (step_log_ != nullptr) {
    LogStep(step, selected, request, has_stats ? &response.stats() : nullptr, status, backend,
            trace_id, call.method);
    for (const v1::StepStats& earlier : response.earlier()) {
      v1::SelectPagesRequest late;
      late.set_session_id(request.session_id());
      late.set_step(earlier.step());
      late.set_reply_mode(v1::REPLY_MODE_ASYNC);
      LogStep(step, selected, late, &earlier, absl::OkStatus(), backend, trace_id, call.method);
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
  a.push_back({"eps.session_id", request.session_id()});
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
    server.status_message = std::string(status.message());
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

void Telemetry::LogStep(const Step& step, Clock::time_point end,
                        const v1::SelectPagesRequest& request, const v1::StepStats* s,
                        const absl::Status& status, service::BackendKind backend,
                        const std::string& trace_id, RpcMethod method) {
  // One object per line; invalid UTF-8 (a session id is bytes) is replaced, not thrown on.
  nlohmann::ordered_json line = {
      {"time", absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::FromUnixNanos(step.start_unix_ns),
                                absl::UTCTimeZone())},
      {"session", request.session_id()},
      {"step", request.step()},
      {"batch", request.rows_size()},
      {"backend", service::BackendKindName(backend)},
      {"reply_mode", ReplyModeName(request.reply_mode())},
      {"transport", method == RpcMethod::kStreamSelectPages ? "stream" : "unary"},
      {"status", absl::StatusCodeToString(status.code())},
      {"server_us", Micros(end - step.start)}};
  if (s != nullptr) {
    line["groups_total"] = s->groups_total();
    line["groups_visited"] = s->groups_visited();
    line["groups_skipped"] = s->groups_total() - s->groups_visited();
    line["pages_total"] = s->pages_total();
    line["pages_visited"] = s->pages_visited();
    line["pages_skipped"] = s->pages_total() - s->pages_visited();
    line["bytes_kv_dense"] = s->bytes_kv_dense();
    line["bytes_kv_read_est"] = s->bytes_kv_read_est();
    line["bytes_kv_saved_est"] = s->bytes_kv_dense() - s->bytes_kv_read_est();
    line["bytes_summary_read"] = s->bytes_summary_read();
    line["prepass_us"] = std::round(s->prepass_us() * 1000) / 1000;
  }
  if (!status.ok()) line["error"] = std::string(status.message());
  if (!trace_id.empty()) line["trace_id"] = trace_id;
  step_log_->Append(line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
}

}  // namespace eps::telemetry
