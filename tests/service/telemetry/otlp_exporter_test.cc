// The OTLP exporters against collectors on loopback: one that takes the request and never
// answers (Cancel must end the attempt; SpanExporter::Cancel), and one that refuses some of
// the spans (OTLP partial success: the outcome must say how many).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
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

TraceConfig ConfigFor(int port) {
  TraceConfig config;
  config.enabled = true;
  config.endpoint.host = "127.0.0.1";
  config.endpoint.port = port;
  config.endpoint.path = "/v1/traces";
  return config;
}

otlp::ExportTraceServiceRequest Spans(int n) {
  std::vector<SpanRecord> spans(n);
  for (SpanRecord& span : spans) {
    span.trace_id = NewTraceId();
    span.span_id = NewSpanId();
    span.name = "eps.v1.PageSelector/SelectPages";
  }
  return EncodeSpans({{"service.name", "epsd"}}, spans);
}

// An OTLP/gRPC collector. Silent: its Export takes the call and waits until the test ends;
// otherwise it answers at once, refusing `rejected` spans.
class GrpcCollector final : public otlp::TraceService::Service {
 public:
  explicit GrpcCollector(bool silent, int64_t rejected = 0) : silent_(silent), rejected_(rejected) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~GrpcCollector() override {
    release_.Notify();
    server_->Shutdown();
  }
  grpc::Status Export(grpc::ServerContext*, const otlp::ExportTraceServiceRequest*,
                      otlp::ExportTraceServiceResponse* response) override {
    if (!called_.HasBeenNotified()) called_.Notify();
    if (silent_) release_.WaitForNotification();
    if (rejected_ > 0) {
      response->mutable_partial_success()->set_rejected_spans(rejected_);
      response->mutable_partial_success()->set_error_message("over quota");
    }
    return grpc::Status::OK;
  }
  int port() const { return port_; }
  void WaitForCall() { called_.WaitForNotification(); }

 private:
  const bool silent_;
  const int64_t rejected_;
  int port_ = 0;
  absl::Notification called_, release_;
  std::unique_ptr<grpc::Server> server_;
};

TEST(OtlpGrpcExporterTest, CancelEndsAnExportTheCollectorNeverAnswers) {
  GrpcCollector collector(/*silent=*/true);
  ASSERT_GT(collector.port(), 0);
  OtlpGrpcExporter exporter(ConfigFor(collector.port()));
  ExportOutcome outcome;
  std::thread attempt([&] { outcome = exporter.Export(Spans(1), Clock::now() + kFarDeadline); });
  collector.WaitForCall();
  exporter.Cancel();
  attempt.join();
  EXPECT_EQ(outcome.result, ExportResult::kFailed);
  EXPECT_THAT(outcome.message, HasSubstr("cancelled"));
  // And no later attempt is made.
  const ExportOutcome again = exporter.Export(Spans(1), Clock::now() + kFarDeadline);
  EXPECT_EQ(again.result, ExportResult::kFailed);
  EXPECT_THAT(again.message, HasSubstr("cancelled"));
}

// The receiver's partial_success went into a message, and the whole batch counted as exported.
TEST(OtlpGrpcExporterTest, APartialSuccessSaysHowManySpansTheReceiverRefused) {
  GrpcCollector collector(/*silent=*/false, /*rejected=*/2);
  ASSERT_GT(collector.port(), 0);
  OtlpGrpcExporter exporter(ConfigFor(collector.port()));
  const ExportOutcome outcome = exporter.Export(Spans(3), Clock::now() + kFarDeadline);
  EXPECT_EQ(outcome.result, ExportResult::kSuccess) << outcome.message;
  EXPECT_EQ(outcome.accepted, 1u);
  EXPECT_EQ(outcome.rejected, 2u);
  EXPECT_EQ(outcome.message, "over quota");
}

// A TCP listener on 127.0.0.1 that accepts one connection and reads what comes until the
// HTTP request's body is in; the test then answers it, or not.
class HttpCollector {
 public:
  HttpCollector() : listener_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
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
  ~HttpCollector() {
    if (connection_ >= 0) close(connection_);
    close(listener_);
  }
  HttpCollector(const HttpCollector&) = delete;
  HttpCollector& operator=(const HttpCollector&) = delete;

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
    request_ = std::move(in);
    return true;
  }
  // The request ReadOneRequest read, head and body.
  const std::string& request() const { return request_; }
  // Sends `reply` on the accepted connection and closes it.
  void Answer(const std::string& reply) {
    (void)!send(connection_, reply.data(), reply.size(), MSG_NOSIGNAL);
    close(connection_);
    connection_ = -1;
  }

 private:
  int listener_;
  int port_ = 0;
  int connection_ = -1;
  std::string request_;
};

// An IPv6 host is bracketed where it meets its port (the Host header is written the same
// way): "http://::1:4318/v1/traces" named no endpoint, and "Host: ::1:4318" no host.
TEST(OtlpHttpExporterTest, AnIpv6EndpointIsNamedWithItsHostInBrackets) {
  TraceConfig config = ConfigFor(4318);
  config.endpoint.host = "::1";
  EXPECT_EQ(OtlpHttpExporter(config).Describe(), "otlp/http http://[::1]:4318/v1/traces");
  EXPECT_EQ(OtlpHttpExporter(ConfigFor(4318)).Describe(),
            "otlp/http http://127.0.0.1:4318/v1/traces");
}

TEST(OtlpHttpExporterTest, CancelEndsAnExportTheCollectorNeverAnswers) {
  HttpCollector collector;
  ASSERT_GT(collector.port(), 0);
  OtlpHttpExporter exporter(ConfigFor(collector.port()));
  ExportOutcome outcome;
  std::thread attempt([&] { outcome = exporter.Export(Spans(1), Clock::now() + kFarDeadline); });
  ASSERT_TRUE(collector.ReadOneRequest());  // the exporter now waits for the reply
  exporter.Cancel();
  attempt.join();
  EXPECT_EQ(outcome.result, ExportResult::kFailed);
  EXPECT_THAT(outcome.message, HasSubstr("cancelled"));
  const ExportOutcome again = exporter.Export(Spans(1), Clock::now() + kFarDeadline);
  EXPECT_EQ(again.result, ExportResult::kFailed);
  EXPECT_THAT(again.message, HasSubstr("cancelled"));
}

// The body of a 2xx was never read: a receiver's partial success went unseen, and the spans
// it refused counted as exported. Both framings of a body: Content-Length and chunked.
TEST(OtlpHttpExporterTest, APartialSuccessSaysHowManySpansTheReceiverRefused) {
  otlp::ExportTraceServiceResponse refusal;
  refusal.mutable_partial_success()->set_rejected_spans(2);
  refusal.mutable_partial_success()->set_error_message("over quota");
  const std::string body = refusal.SerializeAsString();
  const std::string head = "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n";
  const std::string chunked =
      absl::StrCat(absl::Hex(3), "\r\n", body.substr(0, 3), "\r\n", absl::Hex(body.size() - 3),
                   "\r\n", body.substr(3), "\r\n0\r\n\r\n");
  for (const std::string& reply :
       {absl::StrCat(head, "Content-Length: ", body.size(), "\r\n\r\n", body),
        absl::StrCat(head, "Transfer-Encoding: chunked\r\n\r\n", chunked)}) {
    HttpCollector collector;
    ASSERT_GT(collector.port(), 0);
    OtlpHttpExporter exporter(ConfigFor(collector.port()));
    ExportOutcome outcome;
    std::thread attempt([&] { outcome = exporter.Export(Spans(3), Clock::now() + kFarDeadline); });
    ASSERT_TRUE(collector.ReadOneRequest());
    // The Host header is the endpoint's authority (an IPv6 host bracketed, as Describe shows).
    EXPECT_THAT(collector.request(),
                HasSubstr(absl::StrCat("\r\nHost: 127.0.0.1:", collector.port(), "\r\n")));
    collector.Answer(reply);
    attempt.join();
    EXPECT_EQ(outcome.result, ExportResult::kSuccess) << outcome.message;
    EXPECT_EQ(outcome.accepted, 1u) << reply;
    EXPECT_EQ(outcome.rejected, 2u) << reply;
    EXPECT_EQ(outcome.message, "over quota");
  }
}

}  // namespace
}  // namespace eps::telemetry
