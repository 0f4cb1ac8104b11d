// epsd's Prometheus metrics (docs/observability.md lists every one): gRPC
// server metrics under the go-grpc-prometheus names, and eps_* step counters.
//
// Hot path: every Record* call is a handful of relaxed atomic adds. Counters
// for every (method, code) pair are created up front, so no call looks up a
// label set (prometheus-cpp's Family::Add takes a mutex); histograms are
// ShardedHistogram (no lock). Values owned by others (sessions, trace export)
// are read from callbacks at scrape time.
//
// Thread safety: all methods may be called concurrently.
#pragma once

#include <netinet/in.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "eps/v1/page_selector.pb.h"
#include "grpcpp/support/status.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "service/backend_kind.h"
#include "service/telemetry/fallback_reports.h"
#include "service/telemetry/sharded_histogram.h"

namespace prometheus {
class Exposer;
}

namespace eps::telemetry {

enum class RpcMethod : int {
  kAttach,
  kDetach,
  kSelectPages,
  kStreamSelectPages,
  kHeartbeat,
  kPing,
  kGetStats,
};
inline constexpr int kRpcMethods = 7;
inline constexpr int kGrpcCodes = 17;  // OK .. UNAUTHENTICATED
const char* RpcMethodName(RpcMethod method);

// Values read at scrape time from their owners.
struct ScrapeSources {
  struct Sessions {
    uint64_t active = 0, attached_total = 0, expired_total = 0;
    uint64_t charged_bytes = 0;  // charged to --max-server-bytes by the live sessions
    uint64_t ending = 0;         // ended cuda sessions not yet freed (janitor)
  };
  struct Traces {
    uint64_t exported = 0, dropped = 0, export_failures = 0;
  };
  std::function<Sessions()> sessions;          // may be empty
  std::function<Traces()> traces;              // may be empty
  std::function<uint64_t()> step_log_dropped;  // may be empty
};

class ServerMetrics {
 public:
  explicit ServerMetrics(ScrapeSources sources);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // grpc_server_started_total, _handled_total, _handling_seconds, _msg_*_total.
  void RpcStarted(RpcMethod method);
  void RpcHandled(RpcMethod method, grpc::StatusCode code, double seconds);
  void StreamMessageReceived();
  void StreamMessageSent();

  // eps_* counters of one finished step, and its pre-pass time.
  void StepSelected(const v1::StepStats& stats, service::BackendKind backend);
  void ClientFallbacks(const v1::ClientFallbacks& fallbacks);
  // A request the session service refused, by canonical code
  // (eps_validation_failures_total{reason}).
  void ValidationFailure(absl::StatusCode code);

  // The /metrics listener (civetweb): worker threads, and how long one connection may take
  // to send its request head (or take one write of the reply) before it is dropped. A
  // connection holds a thread from its accept until then, so N idle connections delay a
  // scrape by about floor(N / kHttpThreads) request timeouts (docs/observability.md).
  static constexpr int kHttpThreads = 32;
  static constexpr int kHttpRequestTimeoutMs = 500;

  // Serves /metrics on `listen` (host:port; port 0 picks one). Call once.
  absl::Status Serve(const std::string& listen);
  // The port /metrics is served on, 0 when not serving.
  int port() const { return port_; }
  // The text exposition a scrape returns (also for tests and benchmarks).
  std::string Render() const;

 private:
  class HistogramCollectable;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<HistogramCollectable> histograms_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::optional<sockaddr_in> wake_address_;  // the listener the stop wakes (listener_wake.h)
  int port_ = 0;

  std::array<prometheus::Counter*, kRpcMethods> started_{};
  std::array<std::array<prometheus::Counter*, kGrpcCodes>, kRpcMethods> handled_{};
  prometheus::Counter* msg_received_ = nullptr;
  prometheus::Counter* msg_sent_ = nullptr;
  std::array<prometheus::Counter*, service::kSessionBackendKinds> steps_{};
  prometheus::Counter *groups_total_, *groups_visited_, *groups_skipped_, *pages_total_,
      *pages_visited_, *pages_skipped_, *bytes_dense_, *bytes_read_, *bytes_saved_, *bytes_summary_;
  std::array<prometheus::Counter*, 4> fallbacks_{};
  FallbackReports reports_;  // client totals -> increments
  std::array<prometheus::Counter*, kGrpcCodes> validation_{};
};

}  // namespace eps::telemetry
