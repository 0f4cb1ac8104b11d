// What the tests that run epsd's whole process (RunEpsd, what main runs) in a death test's
// child share (busy_server_test.cc,
// backend_fault_exit_test.cc): the process set up as
// RunEpsd requires, and a client of the epsd about to listen on a Unix socket.
#pragma once

#include <pthread.h>

#include <chrono>
#include <csignal>
#include <memory>
#include <string>

#include "eps/v1/page_selector.grpc.pb.h"
#include "tests/service/raw_calls.h"

namespace eps::service {

// What RunEpsd requires of its process: SIGTERM and SIGINT blocked, before any other
// thread exists.
inline void BlockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
}

// A client of the epsd listening (or about to) on the Unix socket at `path`.
inline std::unique_ptr<v1::PageSelector::Stub> StubFor(const std::string& path) {
  return eps::testing::RawStub("unix://" + path);
}

// Sends `request` to the epsd about to listen behind `stub`, waiting up to 20 s for it.
inline grpc::Status AttachOnceListening(v1::PageSelector::Stub& stub,
                                        const v1::AttachRequest& request,
                                        v1::AttachResponse* attached) {
  grpc::ClientContext context;
  eps::testing::SetDeadline(context, std::chrono::seconds(20));
  context.set_wait_for_ready(true);  // until epsd listens
  return stub.Attach(&context, request, attached);
}

}  // namespace eps::service
