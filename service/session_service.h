// The service-side session manager, without its transport: attach, detach,
// select, heartbeat, stats and lease expiry over the eps.v1 messages. The gRPC
// layer (service/grpc_service.h) only forwards to it, so everything here is
// testable in-process and every error is an absl::Status with a canonical code.
//
// Thread safety: all methods may be called concurrently. Steps of one session
// are serialised; steps of different sessions run in parallel.
#pragma once

#include <atomic>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "eps/v1/page_selector.pb.h"
#include "service/backend_kind.h"
#include "service/config.h"
#include "service/session_registry.h"

namespace eps::service {

class SessionService {
 public:
  explicit SessionService(const ServerConfig& config);
  ~SessionService();  // stops the lease reaper
  SessionService(const SessionService&) = delete;
  SessionService& operator=(const SessionService&) = delete;

  absl::Status Attach(const v1::AttachRequest& request, v1::AttachResponse* response);
  absl::Status Detach(const v1::DetachRequest& request);
  // `backend` (may be null): set to the session's backend kind once the session is found.
  absl::Status SelectPages(const v1::SelectPagesRequest& request, v1::SelectPagesResponse* response,
                           BackendKind* backend = nullptr);
  absl::Status Heartbeat(const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response);
  absl::Status GetStats(const v1::GetStatsRequest& request, v1::GetStatsResponse* response);

  // Expires sessions whose lease ran out; the reaper thread calls this.
  void ExpireSessions();
  size_t session_count() const { return sessions_.size(); }

 private:
  absl::Status CountFailure(absl::Status status);
  // Runs one validated step under the session's step lock.
  absl::Status RunStep(Session& session, const v1::SelectPagesRequest& request,
                       std::span<const StepRow> rows, const SelectPolicy& policy,
                       v1::SelectPagesResponse* response);

  const ServerConfig config_;
  SessionRegistry sessions_;
  std::atomic<uint64_t> next_session_{1};
  std::atomic<uint64_t> attached_total_{0}, expired_total_{0}, steps_total_{0},
      validation_failures_{0};
  absl::Notification stop_;
  std::thread reaper_;
};

}  // namespace eps::service
