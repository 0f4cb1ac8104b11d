// The OTLP exporters against collectors that misbehave, on loopback: one that takes the
// request and never answers (Cancel must end the attempt; SpanExporter::Cancel).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "service/telemetry/otlp_encode.h"
#include "service/telemetry/otlp_grpc_exporter.h"
#include "service/telemetry/otlp_http_exporter.h"

namespace eps::telemetry {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
namespace otlp = opentelemetry::proto::collector::trace::v1;

// Far enough that an attempt ending by itself (not by Cancel) fails the test's checks.
constexpr auto kFarDeadline = std::chrono::seconds(30);

TraceConfig ConfigFor(int port, const std::string& path = "/v1/traces") {
  TraceConfig config;
  config.enabled = true;
  config.endpoint.host = "127.0.0.1";
  config.endpoint.port = port;
  config.endpoint.path = path;
  return config;
}

otlp::ExportTraceServiceRequest OneSpan() {
  SpanRecord span;
  span.trace_id = NewTraceId();
  span.span_id = NewSpanId();
  span.name = "eps.v1.PageSelector/SelectPages";
  return EncodeSpans({{"service.name", "epsd"}}, {span});
}

// An OTLP/gRPC collector whose Export takes the call and waits until the test ends.
class SilentGrpcCollector final : public otlp::TraceService::Service {
 public:
  SilentGrpcCollector() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~SilentGrpcCollector() override {
    release_.Notify();
    server_->Shutdown();
  }
  grpc::Status Export(grpc::ServerContext*, const otlp::ExportTraceServiceRequest*,
                      otlp::ExportTraceServiceResponse*) override {
    if (!called_.HasBeenNotified()) called_.Notify();
    release_.WaitForNotification();
    return grpc::Status::OK;
  }
  int port() const { return port_; }
  void WaitForCall() { called_.WaitForNotification(); }

 private:
  int port_ = 0;
  absl::Notification called_, release_;
  std::unique_ptr<grpc::Server> server_;
};

TEST(OtlpGrpcExporterTest, CancelEndsAnExportTheCollectorNeverAnswers) {
  SilentGrpcCollector collector;
  ASSERT_GT(collector.port(), 0);
  OtlpGrpcExporter exporter(ConfigFor(collector.port()));
  ExportResult result = ExportResult::kSuccess;
  std::string error;
  std::thread attempt(
      [&] { result = exporter.Export(OneSpan(), Clock::now() + kFarDeadline, &error); });
  collector.WaitForCall();
  exporter.Cancel();
  attempt.join();
  EXPECT_EQ(result, ExportResult::kFailed);
  EXPECT_THAT(error, HasSubstr("cancelled"));
  // And no later attempt is made.
  std::string again;
  EXPECT_EQ(exporter.Export(OneSpan(), Clock::now() + kFarDeadline, &again), ExportResult::kFailed);
  EXPECT_THAT(again, HasSubstr("cancelled"));
}

// A TCP listener on 127.0.0.1 that accepts one connection, reads what comes until the
// HTTP request's body is in, and never answers.
class SilentHttpCollector {
 public:
  SilentHttpCollector() : listener_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
        listen(listener_, 4) == 0 &&
        getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
      port_ = ntohs(address.sin_port);
    }
  }
  ~SilentHttpCollector() {
    if (connection_ >= 0) close(connection_);
    close(listener_);
  }
  int port() const { return port_; }
  // Accepts the exporter's connection and reads its request whole; false on failure.
  bool ReadOneRequest() {
    connection_ = accept(listener_, nullptr, nullptr);
    if (connection_ < 0) return false;
    std::string in;
    char chunk[4096];
    size_t need = std::string::npos;
    while (need == std::string::npos || in.size() < need) {
      const ssize_t n = recv(connection_, chunk, sizeof(chunk), 0);
      if (n <= 0) return false;
      in.append(chunk, static_cast<size_t>(n));
      const size_t head_end = in.find("\r\n\r\n");
      const size_t length_at = in.find("Content-Length: ");
      if (need == std::string::npos && head_end != std::string::npos &&
          length_at != std::string::npos) {
        need = head_end + 4 + std::stoul(in.substr(length_at + 16));
      }
    }
    return true;
  }

 private:
  int listener_;
  int port_ = 0;
  int connection_ = -1;
};

TEST(OtlpHttpExporterTest, CancelEndsAnExportTheCollectorNeverAnswers) {
  SilentHttpCollector collector;
  ASSERT_GT(collector.port(), 0);
  OtlpHttpExporter exporter(ConfigFor(collector.port()));
  ExportResult result = ExportResult::kSuccess;
  std::string error;
  std::thread attempt(
      [&] { result = exporter.Export(OneSpan(), Clock::now() + kFarDeadline, &error); });
  ASSERT_TRUE(collector.ReadOneRequest());  // the exporter now waits for the reply
  exporter.Cancel();
  attempt.join();
  EXPECT_EQ(result, ExportResult::kFailed);
  EXPECT_THAT(error, HasSubstr("cancelled"));
  std::string again;
  EXPECT_EQ(exporter.Export(OneSpan(), Clock::now() + kFarDeadline, &again), ExportResult::kFailed);
  EXPECT_THAT(again, HasSubstr("cancelled"));
}

}  // namespace
}  // namespace eps::telemetry
