// Builds and runs the epsd gRPC server: listen address policy (Unix socket by
// default, TCP on loopback unless allowed), health and reflection services,
// message-size limits, graceful drain.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "service/config.h"
#include "service/grpc_service.h"
#include "service/session_service.h"
#include "service/telemetry/telemetry.h"

namespace eps::service {

// Rejects a TCP address that is not loopback unless allow_remote.
absl::Status CheckListenAddress(const std::string& listen, bool allow_remote);

class EpsServer {
 public:
  static absl::StatusOr<std::unique_ptr<EpsServer>> Start(const ServerConfig& config);
  ~EpsServer();

  // Stops accepting calls, lets in-flight ones finish for up to drain_ms, then cancels them.
  void Shutdown();
  void Wait();
  SessionService& sessions() { return *sessions_; }
  telemetry::Telemetry& telemetry() { return *telemetry_; }
  // The address clients dial: for TCP with port 0, the port the kernel chose.
  const std::string& bound_address() const { return bound_address_; }

 private:
  EpsServer() = default;
  ServerConfig config_;
  std::unique_ptr<SessionService> sessions_;
  std::unique_ptr<telemetry::Telemetry> telemetry_;  // outlives the service that calls it
  std::unique_ptr<PageSelectorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string bound_address_;
};

}  // namespace eps::service
