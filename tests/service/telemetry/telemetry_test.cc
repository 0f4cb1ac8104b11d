// Telemetry around SelectPages steps, driven in process (no gRPC call: the steps'
// requests and replies are made up here): the step log's lines for async replies,
// and which failed steps count as validation failures. The cpu backend has no async
// replies, so an epsd process could not produce the `earlier` statistics tested here.
#include "service/telemetry/telemetry.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "service/telemetry/utf8.h"

namespace eps::telemetry {
namespace {

using Json = nlohmann::json;

const char* NoEnv(const char*) { return nullptr; }

// The value of one sample line of the text exposition, -1 when absent.
double Sample(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

class TelemetryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = "/tmp/eps-telemetry-test-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".jsonl";
    std::remove(path_.c_str());
    auto t = Telemetry::Create({.metrics_listen = "", .step_log = OpenLog()}, NoEnv, {});
    ASSERT_TRUE(t.ok()) << t.status();
    telemetry_ = *std::move(t);
  }
  void TearDown() override { std::remove(path_.c_str()); }

  // The step log at path_, which a Telemetry then writes (null, failing the test, if it
  // cannot be opened).
  std::unique_ptr<StepLog> OpenLog() {
    absl::StatusOr<std::unique_ptr<StepLog>> log = StepLog::Open(path_);
    EXPECT_TRUE(log.ok()) << log.status();
    return log.ok() ? *std::move(log) : nullptr;
  }

  // Ends the telemetry (its step log flushes) and returns the log's lines as JSON.
  std::vector<Json> Lines() {
    telemetry_.reset();
    std::ifstream in(path_);
    std::vector<Json> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(Json::parse(line));
    return lines;
  }

  // One async step `step` of `batch` rows; its reply carries `earlier`.
  void AsyncStep(uint64_t step, int batch, const std::vector<v1::StepStats>& earlier,
                 const absl::Status& status = absl::OkStatus()) {
    v1::SelectPagesRequest request;
    request.set_session_id(std::string("s-7-") + std::string(32, 'a'));
    request.set_step(step);
    request.set_reply_mode(v1::REPLY_MODE_ASYNC);
    for (int i = 0; i < batch; ++i) request.add_rows()->set_table_row(i);
    v1::SelectPagesResponse response;
    for (const v1::StepStats& s : earlier) *response.add_earlier() = s;
    const Telemetry::Call call{RpcMethod::kStreamSelectPages, Telemetry::Clock::now(), {}};
    const Telemetry::Step started = telemetry_->BeginStep(request);
    telemetry_->EndStep(call, started, request, response, status, service::BackendKind::kCuda);
  }

  static v1::StepStats Stats(uint64_t step, const std::string& error = "") {
    v1::StepStats s;
    s.set_step(step);
    s.set_pages_total(80);
    s.set_pages_visited(20);
    s.set_prepass_us(42.5);
    s.set_error(error);
    return s;
  }

  std::string path_;
  std::unique_ptr<Telemetry> telemetry_;
};

// The late line once borrowed the carrying call: "batch":0 (a made-up request with no
// rows) and the carrier's server_us.
TEST_F(TelemetryTest, AnEarlierStepsStatisticsGetALateStatsLineWithoutTheCarriersBatch) {
  AsyncStep(4, 3, {});
  AsyncStep(5, 3, {Stats(4)});
  const std::vector<Json> lines = Lines();
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["step"], 4);
  EXPECT_EQ(lines[0]["batch"], 3);
  EXPECT_FALSE(lines[0].contains("kind"));
  EXPECT_FALSE(lines[0].contains("pages_total"));  // not known at the reply
  EXPECT_EQ(lines[1]["step"], 5);
  EXPECT_EQ(lines[1]["batch"], 3);
  const Json& late = lines[2];
  EXPECT_EQ(late["kind"], "late_stats");
  EXPECT_EQ(late["session"], "s-7");
  EXPECT_EQ(late["step"], 4);
  EXPECT_TRUE(late["batch"].is_null()) << late;
  EXPECT_TRUE(late["server_us"].is_null()) << late;
  EXPECT_EQ(late["reported_with_step"], 5);
  EXPECT_EQ(late["reply_mode"], "async");
  EXPECT_EQ(late["status"], "OK");
  EXPECT_EQ(late["pages_total"], 80);
  EXPECT_EQ(late["pages_visited"], 20);
}

// A failed async step (StepStats.error) was attended densely: not a selected step.
TEST_F(TelemetryTest, AnEarlierStepThatFailedIsLoggedAsSuchAndNotCountedAsSelected) {
  AsyncStep(5, 1, {Stats(3), Stats(4, "the pre-pass failed")});
  const std::string metrics = telemetry_->metrics().Render();
  EXPECT_EQ(Sample(metrics, R"(eps_steps_total{backend="cuda"})"), 1) << metrics;
  const std::vector<Json> lines = Lines();
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[2]["step"], 4);
  EXPECT_EQ(lines[2]["status"], "UNKNOWN");
  EXPECT_EQ(lines[2]["error"], "the pre-pass failed");
  EXPECT_FALSE(lines[2].contains("pages_total"));
}

// eps_validation_failures_total is what the session service refused; a step the client
// gave up on was once counted there too.
TEST_F(TelemetryTest, StepsTheClientGaveUpOnAreNotValidationFailures) {
  AsyncStep(1, 1, {}, absl::DeadlineExceededError("step 1: the call's deadline passed"));
  AsyncStep(2, 1, {}, absl::CancelledError("step 2: the call was cancelled"));
  AsyncStep(3, 1, {}, absl::UnavailableError("stream write failed"));
  AsyncStep(4, 1, {}, absl::InvalidArgumentError("rows[0].table_row=9 is not below 1"));
  const std::string metrics = telemetry_->metrics().Render();
  EXPECT_LE(Sample(metrics, R"(eps_validation_failures_total{reason="deadline_exceeded"})"), 0);
  EXPECT_LE(Sample(metrics, R"(eps_validation_failures_total{reason="cancelled"})"), 0);
  EXPECT_LE(Sample(metrics, R"(eps_validation_failures_total{reason="unavailable"})"), 0);
  EXPECT_EQ(Sample(metrics, R"(eps_validation_failures_total{reason="invalid_argument"})"), 1)
      << metrics;
}

// Keeps every span it is sent.
class CapturingExporter final : public SpanExporter {
 public:
  struct Shared {
    absl::Mutex mu;
    std::vector<opentelemetry::proto::trace::v1::Span> spans ABSL_GUARDED_BY(mu);
  };
  explicit CapturingExporter(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
  ExportOutcome Export(
      const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
      std::chrono::steady_clock::time_point) override {
    absl::MutexLock lock(&shared_->mu);
    for (const auto& s : request.resource_spans(0).scope_spans(0).spans()) {
      shared_->spans.push_back(s);
    }
    return ExportOutcome::Success(CountSpans(request), 0, "");
  }
  void Cancel() override {}
  std::string Describe() const override { return "capturing"; }

 private:
  std::shared_ptr<Shared> shared_;
};

// A status message can quote the request: an 8 MB session id once went whole into the span's
// status and the step log's "error" of every refused step.
TEST_F(TelemetryTest, AFailedStepsMessageIsBoundedInItsSpanAndItsStepLogLine) {
  auto shared = std::make_shared<CapturingExporter::Shared>();
  telemetry_.reset();
  auto t = Telemetry::Create({.metrics_listen = "", .step_log = OpenLog()}, NoEnv, {},
                             std::make_unique<CapturingExporter>(shared));
  ASSERT_TRUE(t.ok()) << t.status();
  telemetry_ = *std::move(t);
  std::string message = "rows[0]: ";
  // é, 2 bytes: 64 KiB of them (a span this large still fits a batch: the cap, not the
  // batch's byte budget, must bound it).
  for (int i = 0; i < (1 << 15); ++i) message += "\xC3\xA9";
  v1::SelectPagesRequest request;
  request.set_session_id("s-3-" + std::string(32, 'c'));
  request.set_step(1);
  const Telemetry::Call call{RpcMethod::kSelectPages, Telemetry::Clock::now(), {}};
  const Telemetry::Step started = telemetry_->BeginStep(request);
  telemetry_->EndStep(call, started, request, v1::SelectPagesResponse(),
                      absl::InvalidArgumentError(message), service::BackendKind::kCpu);
  AsyncStep(2, 1, {Stats(1, message)});  // an earlier async step's error, as long
  telemetry_->Shutdown(std::chrono::milliseconds(5000));
  {
    absl::MutexLock lock(&shared->mu);
    ASSERT_EQ(shared->spans.size(), 2u);
    const std::string& status = shared->spans[0].status().message();
    EXPECT_LE(status.size(), kMaxStatusMessageBytes);
    EXPECT_TRUE(IsValidUtf8(status));
    EXPECT_EQ(status.rfind("rows[0]: \xC3\xA9", 0), 0u);
  }
  const std::vector<Json> lines = Lines();
  ASSERT_EQ(lines.size(), 3u);
  for (const Json& line : {lines[0], lines[2]}) {
    const std::string error = line["error"];
    EXPECT_LE(error.size(), kMaxStatusMessageBytes);
    EXPECT_TRUE(IsValidUtf8(error));
    EXPECT_EQ(error.rfind("rows[0]: \xC3\xA9", 0), 0u);
  }
}

TEST(IsRefusalTest, OnlyTheSessionServicesRefusalsAre) {
  EXPECT_TRUE(IsRefusal(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(IsRefusal(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(IsRefusal(absl::StatusCode::kNotFound));
  EXPECT_TRUE(IsRefusal(absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(IsRefusal(absl::StatusCode::kPermissionDenied));
  EXPECT_FALSE(IsRefusal(absl::StatusCode::kOk));
  EXPECT_FALSE(IsRefusal(absl::StatusCode::kCancelled));
  EXPECT_FALSE(IsRefusal(absl::StatusCode::kDeadlineExceeded));
  EXPECT_FALSE(IsRefusal(absl::StatusCode::kUnavailable));
  EXPECT_FALSE(IsRefusal(absl::StatusCode::kInternal));
}

}  // namespace
}  // namespace eps::telemetry
