#include "service/telemetry/metrics.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <regex>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace eps::telemetry {
namespace {

// The value of one sample line of the text exposition, -1 when absent.
double Sample(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

TEST(ServerMetricsTest, RecordsRpcsUnderTheGoGrpcPrometheusNames) {
  ServerMetrics m({});
  m.RpcStarted(RpcMethod::kSelectPages);
  m.RpcHandled(RpcMethod::kSelectPages, grpc::StatusCode::OK, 30e-6);
  m.RpcStarted(RpcMethod::kSelectPages);
  m.RpcHandled(RpcMethod::kSelectPages, grpc::StatusCode::NOT_FOUND, 1e-3);
  const std::string text = m.Render();
  const std::string labels =
      R"(grpc_method="SelectPages",grpc_service="eps.v1.PageSelector",grpc_type="unary")";
  EXPECT_EQ(Sample(text, "grpc_server_started_total{" + labels + "}"), 2);
  EXPECT_EQ(Sample(text, R"(grpc_server_handled_total{grpc_code="OK",)" + labels + "}"), 1);
  EXPECT_EQ(Sample(text, R"(grpc_server_handled_total{grpc_code="NotFound",)" + labels + "}"), 1);
  EXPECT_EQ(Sample(text, "grpc_server_handling_seconds_count{" + labels + "}"), 2);
  EXPECT_EQ(Sample(text, "grpc_server_handling_seconds_bucket{" + labels + R"(,le="5e-05"})"), 1);
  EXPECT_NEAR(Sample(text, "grpc_server_handling_seconds_sum{" + labels + "}"), 1.03e-3, 1e-12);
}

TEST(ServerMetricsTest, StepCountersAddTheStepStats) {
  ServerMetrics m({});
  v1::StepStats s;
  s.set_groups_total(100);
  s.set_groups_visited(30);
  s.set_pages_total(800);
  s.set_pages_visited(240);
  s.set_bytes_kv_dense(1000);
  s.set_bytes_kv_read_est(300);
  s.set_bytes_summary_read(50);
  s.set_prepass_us(12.5);
  m.StepSelected(s, service::BackendKind::kCuda);
  m.StepSelected(s, service::BackendKind::kCuda);
  const std::string text = m.Render();
  EXPECT_EQ(Sample(text, R"(eps_steps_total{backend="cuda"})"), 2);
  EXPECT_EQ(Sample(text, "eps_groups_total"), 200);
  EXPECT_EQ(Sample(text, "eps_groups_skipped_total"), 140);
  EXPECT_EQ(Sample(text, "eps_pages_skipped_total"), 1120);
  EXPECT_EQ(Sample(text, "eps_kv_bytes_saved_estimated_total"), 1400);
  EXPECT_EQ(Sample(text, R"(eps_prepass_seconds_count{backend="cuda"})"), 2);
  EXPECT_NEAR(Sample(text, R"(eps_prepass_seconds_sum{backend="cuda"})"), 25e-6, 1e-15);
  EXPECT_EQ(Sample(text, R"(eps_prepass_seconds_count{backend="cpu"})"), 0);
}

TEST(ServerMetricsTest, FallbackReportsAndFailuresAreCountedByReason) {
  ServerMetrics m({});
  v1::ClientFallbacks f;
  f.set_deadline(3);
  f.set_error(1);
  f.set_unavailable(uint64_t{1} << 62);  // absurd: ignored
  m.ClientFallbacks(f);
  m.ValidationFailure(absl::StatusCode::kInvalidArgument);
  m.ValidationFailure(absl::StatusCode::kOk);  // not a failure
  const std::string text = m.Render();
  EXPECT_EQ(Sample(text, R"(eps_client_fallbacks_total{reason="deadline"})"), 3);
  EXPECT_EQ(Sample(text, R"(eps_client_fallbacks_total{reason="error"})"), 1);
  EXPECT_EQ(Sample(text, R"(eps_client_fallbacks_total{reason="unavailable"})"), 0);
  EXPECT_EQ(Sample(text, R"(eps_validation_failures_total{reason="invalid_argument"})"), 1);
}

TEST(ServerMetricsTest, ScrapeSourcesAreReadAtScrapeTime) {
  uint64_t active = 1;
  ScrapeSources sources;
  uint64_t charged = 4096;
  sources.sessions = [&] {
    return ScrapeSources::Sessions{
        .active = active, .attached_total = 4, .charged_bytes = charged, .ending = 2};
  };
  ServerMetrics m(sources);
  EXPECT_EQ(Sample(m.Render(), "eps_sessions"), 1);
  EXPECT_EQ(Sample(m.Render(), "eps_sessions_ending"), 2);
  EXPECT_EQ(Sample(m.Render(), "eps_session_memory_bytes"), 4096);
  active = 3;
  charged = 0;
  EXPECT_EQ(Sample(m.Render(), "eps_sessions"), 3);
  EXPECT_EQ(Sample(m.Render(), "eps_session_memory_bytes"), 0);
  EXPECT_EQ(Sample(m.Render(), "eps_sessions_attached_total"), 4);
}

TEST(ServerMetricsTest, ServesTheExpositionOverHttpOnAKernelChosenPort) {
  ServerMetrics m({});
  ASSERT_TRUE(m.Serve("127.0.0.1:0").ok());
  EXPECT_GT(m.port(), 0);
  ServerMetrics other({});
  const std::string taken = "127.0.0.1:" + std::to_string(m.port());
  const absl::Status busy = other.Serve(taken);
  EXPECT_FALSE(busy.ok());
  EXPECT_EQ(busy.message(), absl::StrCat("--metrics-listen=", taken,
                                         ": could not bind it: bind: ", std::strerror(EADDRINUSE)));
}

TEST(ServerMetricsTest, AnAddressNotOfThisHostIsNamedAsSuchNotAsAPortInUse) {
  // civetweb says only "null context"; every failure once read "is the port in use?".
  // 192.0.2.1 is TEST-NET-1 (RFC 5737), assigned to no host. A host that binds addresses
  // not its own (net.ipv4.ip_nonlocal_bind = 1) would serve it: then there is no such case.
  if (std::ifstream nonlocal("/proc/sys/net/ipv4/ip_nonlocal_bind"); nonlocal) {
    int allowed = 0;
    if (nonlocal >> allowed && allowed != 0) GTEST_SKIP() << "ip_nonlocal_bind is set here";
  }
  ServerMetrics m({});
  const absl::Status status = m.Serve("192.0.2.1:9464");
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(), absl::StrCat("--metrics-listen=192.0.2.1:9464: could not bind it: "
                                           "bind: ",
                                           std::strerror(EADDRNOTAVAIL)));
  EXPECT_EQ(m.port(), 0);
}

}  // namespace
}  // namespace eps::telemetry
