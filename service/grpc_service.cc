#include "service/grpc_service.h"

#include "service/convert.h"

namespace eps::service {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// One reply per request, in order. A failed step ends the stream with its
// status (the client falls back for that step and opens a new stream).
class SelectStream final
    : public grpc::ServerBidiReactor<v1::SelectPagesRequest, v1::SelectPagesResponse> {
 public:
  explicit SelectStream(Selector& selector) : selector_(selector) { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);  // the client closed its side
      return;
    }
    response_.Clear();
    const absl::Status status = selector_.SelectPages(request_, &response_);
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream write failed"));
      return;
    }
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  Selector& selector_;
  v1::SelectPagesRequest request_;
  v1::SelectPagesResponse response_;
};

}  // namespace

grpc::ServerUnaryReactor* PageSelectorService::Attach(grpc::CallbackServerContext* context,
                                                      const v1::AttachRequest* request,
                                                      v1::AttachResponse* response) {
  return Finish(context, selector_.Attach(*request, response));
}

grpc::ServerUnaryReactor* PageSelectorService::Detach(grpc::CallbackServerContext* context,
                                                      const v1::DetachRequest* request,
                                                      v1::DetachResponse*) {
  return Finish(context, selector_.Detach(*request));
}

grpc::ServerUnaryReactor* PageSelectorService::SelectPages(grpc::CallbackServerContext* context,
                                                           const v1::SelectPagesRequest* request,
                                                           v1::SelectPagesResponse* response) {
  return Finish(context, selector_.SelectPages(*request, response));
}

grpc::ServerBidiReactor<v1::SelectPagesRequest, v1::SelectPagesResponse>*
PageSelectorService::StreamSelectPages(grpc::CallbackServerContext*) {
  return new SelectStream(selector_);
}

grpc::ServerUnaryReactor* PageSelectorService::Heartbeat(grpc::CallbackServerContext* context,
                                                         const v1::HeartbeatRequest* request,
                                                         v1::HeartbeatResponse* response) {
  return Finish(context, selector_.Heartbeat(*request, response));
}

grpc::ServerUnaryReactor* PageSelectorService::Ping(grpc::CallbackServerContext* context,
                                                    const v1::PingRequest*, v1::PingResponse*) {
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PageSelectorService::GetStats(grpc::CallbackServerContext* context,
                                                        const v1::GetStatsRequest* request,
                                                        v1::GetStatsResponse* response) {
  return Finish(context, selector_.GetStats(*request, response));
}

}  // namespace eps::service
