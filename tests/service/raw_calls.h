// Plain gRPC calls to a running epsd, without the client library's fail-open
// logic, for the hardening tests: each returns the server's status as is.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "eps/v1/page_selector.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace eps::testing {

inline std::unique_ptr<v1::PageSelector::Stub> RawStub(const std::string& target) {
  return v1::PageSelector::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
}

inline void SetDeadline(grpc::ClientContext& context, std::chrono::milliseconds ms) {
  context.set_deadline(std::chrono::system_clock::now() + ms);
}

inline grpc::Status RawAttach(v1::PageSelector::Stub& stub, const v1::AttachRequest& request,
                              v1::AttachResponse* response,
                              std::chrono::milliseconds deadline = std::chrono::seconds(30)) {
  grpc::ClientContext context;
  SetDeadline(context, deadline);
  return stub.Attach(&context, request, response);
}

inline v1::SelectPagesRequest StepRequest(const std::string& session, uint64_t step,
                                          const std::vector<v1::BatchRow>& rows) {
  v1::SelectPagesRequest request;
  request.set_session_id(session);
  request.set_step(step);
  for (const v1::BatchRow& r : rows) *request.add_rows() = r;
  return request;
}

inline grpc::Status RawStep(v1::PageSelector::Stub& stub, const v1::SelectPagesRequest& request,
                            v1::SelectPagesResponse* response = nullptr,
                            std::chrono::milliseconds deadline = std::chrono::seconds(10)) {
  grpc::ClientContext context;
  SetDeadline(context, deadline);
  v1::SelectPagesResponse ignored;
  return stub.SelectPages(&context, request, response != nullptr ? response : &ignored);
}

}  // namespace eps::testing
