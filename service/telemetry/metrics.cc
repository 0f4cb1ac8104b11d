#include "service/telemetry/metrics.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/text_serializer.h"
#include "service/telemetry/listener_wake.h"

namespace eps::telemetry {
namespace {

constexpr const char* kService = "eps.v1.PageSelector";

// The spelling of grpc-go's codes.Code.String(), which go-grpc-prometheus puts in grpc_code.
constexpr std::array<const char*, kGrpcCodes> kGoCodeNames = {
    "OK",       "Canceled",       "Unknown",          "InvalidArgument",   "DeadlineExceeded",
    "NotFound", "AlreadyExists",  "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
    "Aborted",  "OutOfRange",     "Unimplemented",    "Internal",          "Unavailable",
    "DataLoss", "Unauthenticated"};

const char* GrpcType(RpcMethod method) {
  return method == RpcMethod::kStreamSelectPages ? "bidi_stream" : "unary";
}

int CodeIndex(int code) { return code >= 0 && code < kGrpcCodes ? code : 2 /* Unknown */; }

void Add(prometheus::Counter* counter, int64_t value) {
  if (value > 0) counter->Increment(static_cast<double>(value));
}

prometheus::MetricFamily Scalar(const std::string& name, const std::string& help,
                                prometheus::MetricType type, double value) {
  prometheus::MetricFamily f{name, help, type, {}};
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(m);
  return f;
}

}  // namespace

const char* RpcMethodName(RpcMethod method) {
  static constexpr const char* kNames[kRpcMethods] = {
      "Attach", "Detach", "SelectPages", "StreamSelectPages", "Heartbeat", "Ping", "GetStats"};
  return kNames[static_cast<int>(method)];
}

// The histograms (per-method handling time, per-backend pre-pass time) and the
// values read from callbacks, rendered at scrape time.
class ServerMetrics::HistogramCollectable final : public prometheus::Collectable {
 public:
  explicit HistogramCollectable(ScrapeSources sources) : sources_(std::move(sources)) {
    for (auto& h : handling_) h = std::make_unique<ShardedHistogram>(LatencyBucketsSeconds());
    for (auto& h : prepass_) h = std::make_unique<ShardedHistogram>(LatencyBucketsSeconds());
  }
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    prometheus::MetricFamily handling{
        "grpc_server_handling_seconds",
        "Histogram of response latency (seconds) of gRPC that had been application-level "
        "handled by the server.",
        prometheus::MetricType::Histogram,
        {}};
    for (int m = 0; m < kRpcMethods; ++m) {
      const auto method = static_cast<RpcMethod>(m);
      prometheus::ClientMetric metric;
      metric.label = {{"grpc_method", RpcMethodName(method)},
                      {"grpc_service", kService},
                      {"grpc_type", GrpcType(method)}};
      metric.histogram = handling_[m]->Snapshot();
      handling.metric.push_back(std::move(metric));
    }
    out.push_back(std::move(handling));
    prometheus::MetricFamily prepass{
        "eps_prepass_seconds",
        "Pre-pass time per step: GPU event time on the cuda backend, wall time on the cpu backend.",
        prometheus::MetricType::Histogram,
        {}};
    for (int b = 0; b < service::kSessionBackendKinds; ++b) {
      prometheus::ClientMetric metric;
      metric.label = {{"backend", service::BackendKindName(static_cast<service::BackendKind>(b))}};
      metric.histogram = prepass_[b]->Snapshot();
      prepass.metric.push_back(std::move(metric));
    }
    out.push_back(std::move(prepass));
    if (sources_.sessions) {
      const ScrapeSources::Sessions s = sources_.sessions();
      out.push_back(Scalar("eps_sessions", "Sessions attached now.", prometheus::MetricType::Gauge,
                           static_cast<double>(s.active)));
      out.push_back(Scalar("eps_sessions_attached_total", "Sessions attached since start.",
                           prometheus::MetricType::Counter, static_cast<double>(s.attached_total)));
      out.push_back(Scalar("eps_sessions_expired_total",
                           "Sessions whose lease ran out (their engine stopped calling).",
                           prometheus::MetricType::Counter, static_cast<double>(s.expired_total)));
      out.push_back(Scalar("eps_session_memory_bytes",
                           "Bytes the live sessions hold against --max-server-bytes: inline "
                           "buffers and backend allocations (mapped engine buffers are not "
                           "charged).",
                           prometheus::MetricType::Gauge, static_cast<double>(s.charged_bytes)));
      out.push_back(Scalar("eps_sessions_ending",
                           "Ended cuda sessions (and failed cuda Attaches' allocations) not freed "
                           "yet: freeing waits until it cannot wait "
                           "for another engine; their bytes are still in "
                           "eps_session_memory_bytes.",
                           prometheus::MetricType::Gauge, static_cast<double>(s.ending)));
    }
    if (sources_.traces) {
      const ScrapeSources::Traces t = sources_.traces();
      out.push_back(Scalar("eps_trace_spans_exported_total", "Spans the OTLP receiver accepted.",
                           prometheus::MetricType::Counter, static_cast<double>(t.exported)));
      out.push_back(
          Scalar("eps_trace_spans_dropped_total",
                 "Spans dropped: the export queue was full, a span was too large to export, the "
                 "receiver refused them, or an export failed for good.",
                 prometheus::MetricType::Counter, static_cast<double>(t.dropped)));
      out.push_back(Scalar("eps_trace_export_failures_total",
                           "OTLP export attempts that failed (each retry counts).",
                           prometheus::MetricType::Counter,
                           static_cast<double>(t.export_failures)));
    }
    if (sources_.step_log_dropped) {
      out.push_back(Scalar("eps_step_log_lines_dropped_total",
                           "Step-log lines dropped because the writer fell behind.",
                           prometheus::MetricType::Counter,
                           static_cast<double>(sources_.step_log_dropped())));
    }
    return out;
  }

  std::array<std::unique_ptr<ShardedHistogram>, kRpcMethods> handling_;
  std::array<std::unique_ptr<ShardedHistogram>, service::kSessionBackendKinds> prepass_;

 private:
  ScrapeSources sources_;
};

ServerMetrics::ServerMetrics(ScrapeSources sources)
    : registry_(std::make_shared<prometheus::Registry>()),
      histograms_(std::make_shared<HistogramCollectable>(std::move(sources))) {
  auto& started = prometheus::BuildCounter()
                      .Name("grpc_server_started_total")
                      .Help("Total number of RPCs started on the server.")
                      .Register(*registry_);
  auto& handled = prometheus::BuildCounter()
                      .Name("grpc_server_handled_total")
                      .Help(
                          "Total number of RPCs completed on the server, regardless of success "
                          "or failure.")
                      .Register(*registry_);
  for (int m = 0; m < kRpcMethods; ++m) {
    const auto method = static_cast<RpcMethod>(m);
    const prometheus::Labels labels = {{"grpc_service", kService},
                                       {"grpc_method", RpcMethodName(method)},
                                       {"grpc_type", GrpcType(method)}};
    started_[m] = &started.Add(labels);
    for (int c = 0; c < kGrpcCodes; ++c) {
      prometheus::Labels with_code = labels;
      with_code["grpc_code"] = kGoCodeNames[c];
      handled_[m][c] = &handled.Add(with_code);
    }
  }
  const prometheus::Labels stream = {{"grpc_service", kService},
                                     {"grpc_method", "StreamSelectPages"},
                                     {"grpc_type", "bidi_stream"}};
  msg_received_ = &prometheus::BuildCounter()
                       .Name("grpc_server_msg_received_total")
                       .Help("Total number of RPC stream messages received on the server.")
                       .Register(*registry_)
                       .Add(stream);
  msg_sent_ = &prometheus::BuildCounter()
                   .Name("grpc_server_msg_sent_total")
                   .Help("Total number of gRPC stream messages sent by the server.")
                   .Register(*registry_)
                   .Add(stream);

  auto counter = [&](const std::string& name, const std::string& help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_).Add({});
  };
  auto& steps = prometheus::BuildCounter()
                    .Name("eps_steps_total")
                    .Help("SelectPages steps selected (unary and stream), by backend.")
                    .Register(*registry_);
  for (int b = 0; b < service::kSessionBackendKinds; ++b) {
    steps_[b] =
        &steps.Add({{"backend", service::BackendKindName(static_cast<service::BackendKind>(b))}});
  }
  groups_total_ = counter("eps_groups_total",
                          "Page-groups considered: (sequence, layer, list) x groups in context.");
  groups_visited_ = counter("eps_groups_visited_total", "Page-groups selected for attention.");
  groups_skipped_ = counter("eps_groups_skipped_total", "Page-groups attention may skip.");
  pages_total_ = counter("eps_pages_total", "KV blocks considered (pages_total per step).");
  pages_visited_ = counter("eps_pages_visited_total", "KV blocks selected (pages_visited).");
  pages_skipped_ = counter("eps_pages_skipped_total", "KV blocks skipped (pages_skipped).");
  bytes_dense_ = counter("eps_kv_bytes_dense_total", "K and V bytes dense attention would read.");
  bytes_read_ = counter("eps_kv_bytes_read_estimated_total",
                        "K and V bytes of the visited blocks (estimated read).");
  bytes_saved_ = counter("eps_kv_bytes_saved_estimated_total",
                         "K and V bytes of the skipped blocks (dense minus estimated read).");
  bytes_summary_ = counter("eps_summaries_bytes_read_total", "Summary bytes the pre-pass read.");
  auto& fallbacks = prometheus::BuildCounter()
                        .Name("eps_client_fallbacks_total")
                        .Help(
                            "Steps clients attended densely without a selection, as they "
                            "reported them (SelectPagesRequest.fallbacks), by reason.")
                        .Register(*registry_);
  fallbacks_ = {
      &fallbacks.Add({{"reason", "deadline"}}), &fallbacks.Add({{"reason", "unavailable"}}),
      &fallbacks.Add({{"reason", "not_attached"}}), &fallbacks.Add({{"reason", "error"}})};
  auto& validation = prometheus::BuildCounter()
                         .Name("eps_validation_failures_total")
                         .Help("Requests the session service refused, by canonical status code.")
                         .Register(*registry_);
  for (int c = 1; c < kGrpcCodes; ++c) {
    validation_[c] = &validation.Add({{"reason", absl::AsciiStrToLower(absl::StatusCodeToString(
                                                     static_cast<absl::StatusCode>(c)))}});
  }
}

ServerMetrics::~ServerMetrics() {
  if (exposer_ == nullptr) return;
  // Stopped with its listener woken: about 15 ms instead of civetweb's 0.8-2 s.
  StopWhileWaking(wake_address_, [&] { exposer_.reset(); });
}

void ServerMetrics::RpcStarted(RpcMethod method) {
  started_[static_cast<int>(method)]->Increment();
}

void ServerMetrics::RpcHandled(RpcMethod method, grpc::StatusCode code, double seconds) {
  handled_[static_cast<int>(method)][CodeIndex(code)]->Increment();
  histograms_->handling_[static_cast<int>(method)]->Observe(seconds);
}

void ServerMetrics::StreamMessageReceived() { msg_received_->Increment(); }
void ServerMetrics::StreamMessageSent() { msg_sent_->Increment(); }

void ServerMetrics::StepSelected(const v1::StepStats& s, service::BackendKind backend) {
  steps_[static_cast<int>(backend)]->Increment();
  Add(groups_total_, s.groups_total());
  Add(groups_visited_, s.groups_visited());
  Add(groups_skipped_, s.groups_total() - s.groups_visited());
  Add(pages_total_, s.pages_total());
  Add(pages_visited_, s.pages_visited());
  Add(pages_skipped_, s.pages_total() - s.pages_visited());
  Add(bytes_dense_, s.bytes_kv_dense());
  Add(bytes_read_, s.bytes_kv_read_est());
  Add(bytes_saved_, s.bytes_kv_dense() - s.bytes_kv_read_est());
  Add(bytes_summary_, s.bytes_summary_read());
  histograms_->prepass_[static_cast<int>(backend)]->Observe(s.prepass_us() * 1e-6);
}

void ServerMetrics::ClientFallbacks(const v1::ClientFallbacks& f) {
  // Totals become increments once per client (FallbackReports); an absurd increment (a client
  // bug) must not wreck the counter's rate.
  constexpr uint64_t kMaxPerReport = uint64_t{1} << 40;
  const FallbackReports::Counts values = reports_.Increase(f);
  for (int i = 0; i < 4; ++i) {
    if (values[i] > 0 && values[i] < kMaxPerReport) {
      fallbacks_[i]->Increment(static_cast<double>(values[i]));
    }
  }
}

void ServerMetrics::ValidationFailure(absl::StatusCode code) {
  const int c = CodeIndex(static_cast<int>(code));
  if (c != 0) validation_[c]->Increment();
}

namespace {

// Why `listen` (host:port) cannot be bound, found by resolving and binding it as civetweb
// does (IPv4, SO_REUSEADDR): civetweb says only "null context", and "is the port in use?"
// sent an operator after a port when the address was not this host's or the name did not
// resolve. Empty when the bind works now (a port freed meanwhile): the cause is unknown.
std::string BindFailure(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  const std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::StrCat("cannot resolve ", host, " to an IPv4 address: ", gai_strerror(rc));
  }
  const int fd = socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    return absl::StrCat("socket: ", std::strerror(errno));
  }
  const int on = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  std::string why;
  if (bind(fd, found->ai_addr, found->ai_addrlen) != 0) {
    why = absl::StrCat("bind: ", std::strerror(errno));
  }
  close(fd);
  freeaddrinfo(found);
  return why;
}

}  // namespace

absl::Status ServerMetrics::Serve(const std::string& listen) {
  if (exposer_ != nullptr) return absl::FailedPreconditionError("/metrics is already served");
  try {
    // civetweb serves each connection on one of its worker threads until the request is
    // read: a client that connects and sends nothing (or half a request) holds a thread
    // for the request timeout, and civetweb 1.15 has no per-client connection limit. So
    // many threads and a short timeout: with 4 threads and 2 s, 64 such connections held
    // scrapes for 31 s; with 32 and 500 ms, 0.5-1 s (tests/service/telemetry/
    // metrics_http_test.cc, bench/metrics_hold.py).
    exposer_ = std::make_unique<prometheus::Exposer>(
        std::vector<std::string>{"listening_ports", listen,                    //
                                 "num_threads", std::to_string(kHttpThreads),  //
                                 "request_timeout_ms", std::to_string(kHttpRequestTimeoutMs)});
  } catch (const std::exception& e) {
    // civetweb throws "null context when constructing CivetServer", which says nothing
    // to an operator: the reason is found again here.
    const std::string why = BindFailure(listen);
    return absl::UnavailableError(
        why.empty() ? absl::StrCat("--metrics-listen=", listen,
                                   ": could not serve /metrics on it; civetweb: ", e.what())
                    : absl::StrCat("--metrics-listen=", listen, ": could not bind it: ", why));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(histograms_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  port_ = ports.empty() ? 0 : ports.front();
  // host:port, checked by the config; resolved now, not at exit
  wake_address_ = ListenerAddress(listen.substr(0, listen.rfind(':')), port_);
  return absl::OkStatus();
}

std::string ServerMetrics::Render() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (auto& f : histograms_->Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace eps::telemetry
