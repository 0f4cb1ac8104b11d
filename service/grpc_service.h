// The gRPC face of the SessionService: callback API, DefaultReactor for unary calls,
// a bidirectional reactor for StreamSelectPages. Owns no logic beyond transport
// and the telemetry hooks around each call and step.
#pragma once

#include "eps/v1/page_selector.grpc.pb.h"
#include "service/peer.h"
#include "service/session_service.h"
#include "service/telemetry/telemetry.h"

namespace eps::service {

class PageSelectorService final : public v1::PageSelector::CallbackService {
 public:
  // `peers` (null over TCP): the Unix socket's connections, to bind sessions to their users.
  PageSelectorService(SessionService& sessions, telemetry::Telemetry& telemetry,
                      const PeerTable* peers = nullptr)
      : sessions_(sessions), telemetry_(telemetry), peers_(peers) {}

  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext* context,
                                   const v1::AttachRequest* request,
                                   v1::AttachResponse* response) override;
  grpc::ServerUnaryReactor* Detach(grpc::CallbackServerContext* context,
                                   const v1::DetachRequest* request,
                                   v1::DetachResponse* response) override;
  grpc::ServerUnaryReactor* SelectPages(grpc::CallbackServerContext* context,
                                        const v1::SelectPagesRequest* request,
                                        v1::SelectPagesResponse* response) override;
  grpc::ServerBidiReactor<v1::SelectPagesRequest, v1::SelectPagesResponse>* StreamSelectPages(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* context,
                                 const v1::PingRequest* request,
                                 v1::PingResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;

 private:
  Peer CallerOf(const grpc::CallbackServerContext& context) const;

  SessionService& sessions_;
  telemetry::Telemetry& telemetry_;
  const PeerTable* const peers_;
};

}  // namespace eps::service
