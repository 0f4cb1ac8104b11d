#include "service/telemetry/otlp_grpc_exporter.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace eps::telemetry {

OtlpGrpcExporter::OtlpGrpcExporter(const TraceConfig& config) : config_(config) {
  grpc::ChannelArguments args;
  // Reconnect quickly once a collector comes back; the processor paces the retries.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5000);
  auto credentials = config.endpoint.tls ? grpc::SslCredentials(grpc::SslCredentialsOptions())
                                         : grpc::InsecureChannelCredentials();
  stub_ = opentelemetry::proto::collector::trace::v1::TraceService::NewStub(
      grpc::CreateCustomChannel(config.endpoint.authority(), credentials, args));
}

ExportOutcome OtlpGrpcExporter::Export(
    const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
    std::chrono::steady_clock::time_point deadline) {
  constexpr const char* kCancelled = "cancelled: epsd is stopping";
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       (deadline - std::chrono::steady_clock::now()));
  for (const auto& [key, value] : config_.headers) context.AddMetadata(key, value);
  opentelemetry::proto::collector::trace::v1::ExportTraceServiceResponse response;
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return ExportOutcome::Failure(ExportResult::kFailed, kCancelled);
    in_flight_ = &context;  // a Cancel from now on reaches this call, even before it starts
  }
  const grpc::Status status = stub_->Export(&context, request, &response);
  {
    absl::MutexLock lock(&mu_);
    in_flight_ = nullptr;
    if (cancelled_ && !status.ok())
      return ExportOutcome::Failure(ExportResult::kFailed, kCancelled);
  }
  if (status.ok()) {
    // OTLP partial success: the receiver took the request but refused some of its spans.
    return ExportOutcome::Success(CountSpans(request), response.partial_success().rejected_spans(),
                                  response.partial_success().error_message());
  }
  std::string error =
      absl::StrCat("TraceService/Export: code ", status.error_code(), ": ", status.error_message());
  // The OTLP spec's retryable codes (RESOURCE_EXHAUSTED only with RetryInfo, which we do not read).
  switch (status.error_code()) {
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DATA_LOSS:
      return ExportOutcome::Failure(ExportResult::kRetryable, std::move(error));
    default:
      return ExportOutcome::Failure(ExportResult::kFailed, std::move(error));
  }
}

void OtlpGrpcExporter::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (in_flight_ != nullptr) in_flight_->TryCancel();
}

std::string OtlpGrpcExporter::Describe() const {
  return absl::StrCat("otlp/grpc ", config_.endpoint.tls ? "https://" : "http://",
                      config_.endpoint.authority());
}

}  // namespace eps::telemetry
