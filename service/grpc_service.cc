#include "service/grpc_service.h"

#include "service/convert.h"

namespace eps::service {
namespace {

using telemetry::RpcMethod;
using telemetry::Telemetry;

// Finishes a unary call and records it. `refused`: a failure is the session service's refusal.
grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, Telemetry& telemetry,
                                 const Telemetry::Call& call, const absl::Status& status,
                                 bool refused = true) {
  telemetry.EndCall(call, status, refused);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// One reply per request, in order. A failed step ends the stream with its
// status (the client falls back for that step and opens a new stream).
class SelectStream final
    : public grpc::ServerBidiReactor<v1::SelectPagesRequest, v1::SelectPagesResponse> {
 public:
  SelectStream(SessionService& sessions, Telemetry& telemetry, grpc::CallbackServerContext& context)
      : sessions_(sessions),
        telemetry_(telemetry),
        call_(telemetry.BeginCall(RpcMethod::kStreamSelectPages, context)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      End(absl::OkStatus());  // the client closed its side
      return;
    }
    telemetry_.metrics().StreamMessageReceived();
    response_.Clear();
    const Telemetry::Step step = telemetry_.BeginStep(request_);
    BackendKind backend = BackendKind::kCpu;
    const absl::Status status = sessions_.SelectPages(request_, &response_, &backend);
    telemetry_.EndStep(call_, step, request_, response_, status, backend);
    if (!status.ok()) {
      End(status);
      return;
    }
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(absl::UnavailableError("stream write failed"));
      return;
    }
    telemetry_.metrics().StreamMessageSent();
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  // The stream's own status; a failed step was already counted by EndStep.
  void End(const absl::Status& status) {
    telemetry_.EndCall(call_, status, /*refused=*/false);
    Finish(ToGrpcStatus(status));
  }

  SessionService& sessions_;
  Telemetry& telemetry_;
  const Telemetry::Call call_;
  v1::SelectPagesRequest request_;
  v1::SelectPagesResponse response_;
};

}  // namespace

grpc::ServerUnaryReactor* PageSelectorService::Attach(grpc::CallbackServerContext* context,
                                                      const v1::AttachRequest* request,
                                                      v1::AttachResponse* response) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kAttach, *context);
  const absl::Status status = sessions_.Attach(*request, response);
  return Finish(context, telemetry_, call, status);
}

grpc::ServerUnaryReactor* PageSelectorService::Detach(grpc::CallbackServerContext* context,
                                                      const v1::DetachRequest* request,
                                                      v1::DetachResponse*) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kDetach, *context);
  const absl::Status status = sessions_.Detach(*request);
  return Finish(context, telemetry_, call, status);
}

grpc::ServerUnaryReactor* PageSelectorService::SelectPages(grpc::CallbackServerContext* context,
                                                           const v1::SelectPagesRequest* request,
                                                           v1::SelectPagesResponse* response) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kSelectPages, *context);
  const Telemetry::Step step = telemetry_.BeginStep(*request);
  BackendKind backend = BackendKind::kCpu;
  const absl::Status status = sessions_.SelectPages(*request, response, &backend);
  telemetry_.EndStep(call, step, *request, *response, status, backend);
  return Finish(context, telemetry_, call, status, /*refused=*/false);  // EndStep counted it
}

grpc::ServerBidiReactor<v1::SelectPagesRequest, v1::SelectPagesResponse>*
PageSelectorService::StreamSelectPages(grpc::CallbackServerContext* context) {
  return new SelectStream(sessions_, telemetry_, *context);
}

grpc::ServerUnaryReactor* PageSelectorService::Heartbeat(grpc::CallbackServerContext* context,
                                                         const v1::HeartbeatRequest* request,
                                                         v1::HeartbeatResponse* response) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kHeartbeat, *context);
  return Finish(context, telemetry_, call, sessions_.Heartbeat(*request, response));
}

grpc::ServerUnaryReactor* PageSelectorService::Ping(grpc::CallbackServerContext* context,
                                                    const v1::PingRequest*, v1::PingResponse*) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kPing, *context);
  return Finish(context, telemetry_, call, absl::OkStatus());
}

grpc::ServerUnaryReactor* PageSelectorService::GetStats(grpc::CallbackServerContext* context,
                                                        const v1::GetStatsRequest* request,
                                                        v1::GetStatsResponse* response) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kGetStats, *context);
  return Finish(context, telemetry_, call, sessions_.GetStats(*request, response));
}

}  // namespace eps::service
