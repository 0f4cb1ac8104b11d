// Builds and runs the epsd gRPC server: listen address policy (Unix socket by
// default, TCP on loopback unless allowed), health and reflection services,
// message-size limits, graceful drain; grpc.health.v1 alone on a TCP port for
// kubelet's native probes (--health-listen). Every listener is loopback unless
// --allow-remote (CheckListeners in config.h).
#pragma once

#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server.h"
#include "service/config.h"
#include "service/grpc_service.h"
#include "service/peer.h"
#include "service/session_service.h"
#include "service/step_executor.h"
#include "service/telemetry/telemetry.h"
#include "service/unix_socket.h"

namespace eps::service {

// What the process around the server decides.
struct ServerHooks {
  // Called once, from a call's thread, the lease reaper's or the session janitor's, when
  // epsd can no longer serve (a CUDA device lost, or one whose abandoned stream never
  // drains: SessionService::DeviceLostHandler); EpsServer::fatal() then says why. epsd's
  // main answers it with the drain and exit 1. May be empty.
  std::function<void()> on_fatal;
  // Session::Create's (tests pass stand-ins).
  BackendFactory make_backend = MakeSessionBackend;
  // The open --step-log file, which the server's telemetry then writes. RunEpsd opens it
  // before anything starts, so that a path it cannot open is a bad command line (exit 2);
  // null: Start opens ServerConfig::step_log itself, if set.
  std::unique_ptr<telemetry::StepLog> step_log;
};

class EpsServer {
 public:
  // HTTP/2 streams a connection may hold open at once (docs/security.md class 5).
  static constexpr int kMaxStreamsPerConnection = 100;

  static absl::StatusOr<std::unique_ptr<EpsServer>> Start(const ServerConfig& config,
                                                          ServerHooks hooks = {});
  ~EpsServer();

  // Stops accepting calls, lets in-flight ones finish for up to drain_ms, then cancels them.
  void Shutdown();
  void Wait();
  SessionService& sessions() { return *sessions_; }
  telemetry::Telemetry& telemetry() { return *telemetry_; }
  // The address clients dial: for TCP with port 0, the port the kernel chose.
  const std::string& bound_address() const { return bound_address_; }
  // host:port of the grpc.health.v1 TCP listener (--health-listen); empty when off.
  const std::string& health_address() const { return health_address_; }
  // OK, or why epsd cannot serve any more (see Start).
  absl::Status fatal() const {
    absl::MutexLock lock(&fatal_mu_);
    return fatal_;
  }

 private:
  EpsServer() = default;
  ServerConfig config_;
  // Before sessions_, which reports a lost device to them.
  std::function<void()> on_fatal_;
  mutable absl::Mutex fatal_mu_;
  absl::Status fatal_ ABSL_GUARDED_BY(fatal_mu_);
  // Runs every step, and the waits of Detach and replacing Attach calls for one
  // (service/step_executor.h), sized by --max-sessions. Before sessions_, which hands it
  // work; stopped by ~EpsServer once the gRPC server has shut down (a call in flight
  // during the drain is still answered), before sessions_ goes.
  std::unique_ptr<StepExecutor> executor_;
  std::unique_ptr<SessionService> sessions_;
  std::unique_ptr<telemetry::Telemetry> telemetry_;  // outlives the service that calls it
  std::unique_ptr<PageSelectorService> service_;
  PeerTable peers_;  // the Unix socket's connections: who is on the other end
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ListeningUnixSocket> socket_;  // --listen=unix://; outlives acceptor_
  std::unique_ptr<UnixAcceptor> acceptor_;       // stopped before server_ shuts down
  std::string bound_address_;
  std::unique_ptr<grpc::Server> health_server_;  // --health-listen; null when off
  std::string health_address_;

  absl::Status StartHealthListener();
};

}  // namespace eps::service
