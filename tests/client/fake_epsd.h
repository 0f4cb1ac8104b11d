// Fake epsd servers for the C++ client's tests (eps_client_test, eps_client_session_test):
// a unix target per test and process, a server on it, and the client's options for it.
#pragma once

#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>

#include "client/cpp/eps_client.h"
#include "eps/v1/page_selector.grpc.pb.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace eps::client::fake_epsd {

inline std::string FakeTarget(const std::string& name) {
  return "unix:///tmp/eps-fake-client-" + name + "-" + std::to_string(getpid()) + ".sock";
}

inline std::unique_ptr<grpc::Server> Serve(grpc::Service* service, const std::string& target) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(target, grpc::InsecureServerCredentials());
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

// A client of a fake server: `deadline` for a step, `attach_deadline` for an Attach.
inline ClientOptions FakeOptions(
    const std::string& target, bool use_stream,
    std::chrono::microseconds deadline = std::chrono::seconds(5),
    std::chrono::milliseconds attach_deadline = std::chrono::seconds(5)) {
  ClientOptions options;
  options.target = target;
  options.use_stream = use_stream;
  options.deadline = deadline;
  options.attach_deadline = attach_deadline;
  return options;
}

inline v1::AttachRequest Attach(const std::string& engine_id) {
  v1::AttachRequest attach;
  attach.set_engine_id(engine_id);
  return attach;
}

inline v1::BatchRow Row() {
  v1::BatchRow row;
  row.set_context_tokens(16);
  return row;
}
}  // namespace eps::client::fake_epsd
