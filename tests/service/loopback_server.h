// epsd's gRPC server in the test's own process, its sessions built by the test's backend
// factory, and a client of it: for the in-process tests that drive the server through gRPC
// (step_admission_test.cc, busy_server_test.cc, slow_attach_test.cc, backend_fault_test.cc).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "eps/v1/page_selector.grpc.pb.h"
#include "service/config.h"
#include "service/server.h"
#include "service/session.h"
#include "tests/service/raw_calls.h"

namespace eps::service {

// The server and a stub on its bound address. The stub goes first, then the server
// (declared in that order), as a fixture's members would go.
struct LoopbackServer {
  std::unique_ptr<EpsServer> server;
  std::unique_ptr<v1::PageSelector::Stub> stub;
};

// Starts the server of `flags` (a whole command line: --listen included) with `hooks`.
inline absl::StatusOr<LoopbackServer> StartLoopbackServer(const std::vector<std::string>& flags,
                                                          ServerHooks hooks) {
  absl::StatusOr<ServerConfig> config = ParseFlags(flags);
  if (!config.ok()) return config.status();
  absl::StatusOr<std::unique_ptr<EpsServer>> server = EpsServer::Start(*config, std::move(hooks));
  if (!server.ok()) return server.status();
  LoopbackServer started{.server = *std::move(server), .stub = nullptr};
  started.stub = eps::testing::RawStub(started.server->bound_address());
  return started;
}

// The same on a port of 127.0.0.1 that the system picks, with no metrics listener, its
// sessions built by `make_backend`; `more_flags` follow those.
inline absl::StatusOr<LoopbackServer> StartLoopbackServer(
    BackendFactory make_backend, std::vector<std::string> more_flags = {}) {
  std::vector<std::string> flags = {"--listen=127.0.0.1:0", "--metrics-listen=off"};
  flags.insert(flags.end(), more_flags.begin(), more_flags.end());
  ServerHooks hooks;
  hooks.make_backend = std::move(make_backend);
  return StartLoopbackServer(flags, std::move(hooks));
}

}  // namespace eps::service
