// client/cpp/eps_client.cc against fake epsd servers (no epsd binary): trace metadata
// gRPC cannot carry is dropped rather than aborting the process, a missed step cancels
// the stream whether the engine falls back or not, and ClientOptions are validated with
// deadlines that never wrap. The session's life (attach, re-attach, detach, stream
// replies) is in eps_client_session_test.cc.
#include "client/cpp/eps_client.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "eps/v1/page_selector.grpc.pb.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tests/client/fake_epsd.h"

namespace eps::client {
namespace {

using fake_epsd::Attach;
using fake_epsd::FakeOptions;
using fake_epsd::FakeTarget;
using fake_epsd::Row;
using fake_epsd::Serve;

// Grants "s-fake" and answers every step at once (unary and stream), recording the
// traceparent and tracestate metadata of each call, and the steps each stream carried.
// A step in `unanswered` gets no reply (the stream stays open).
class RecordingEpsd final : public v1::PageSelector::Service {
 public:
  explicit RecordingEpsd(std::vector<uint64_t> unanswered = {})
      : unanswered_(std::move(unanswered)) {}

  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*,
                      v1::AttachResponse* response) override {
    response->set_session_id("s-fake");
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status Ping(grpc::ServerContext*, const v1::PingRequest*, v1::PingResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status SelectPages(grpc::ServerContext* context, const v1::SelectPagesRequest* request,
                           v1::SelectPagesResponse* response) override {
    Record(*context);
    response->set_step(request->step());
    response->set_done(true);  // a sync reply: the outputs are written
    return grpc::Status::OK;
  }
  grpc::Status StreamSelectPages(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::SelectPagesResponse, v1::SelectPagesRequest>* stream) override {
    Record(*context);
    size_t index = 0;
    {
      std::lock_guard lock(mu_);
      index = streams_.size();
      streams_.emplace_back();
    }
    v1::SelectPagesRequest request;
    while (stream->Read(&request)) {
      {
        std::lock_guard lock(mu_);
        streams_[index].push_back(request.step());
      }
      if (std::find(unanswered_.begin(), unanswered_.end(), request.step()) != unanswered_.end()) {
        continue;
      }
      v1::SelectPagesResponse response;
      response.set_step(request.step());
      response.set_done(true);  // a sync reply: the outputs are written
      if (!stream->Write(response)) break;
    }
    return grpc::Status::OK;
  }

  std::vector<std::string> traceparents() {
    std::lock_guard lock(mu_);
    return traceparents_;
  }
  std::vector<std::string> tracestates() {
    std::lock_guard lock(mu_);
    return tracestates_;
  }
  std::vector<std::vector<uint64_t>> streams() {
    std::lock_guard lock(mu_);
    return streams_;
  }

 private:
  void Record(const grpc::ServerContext& context) {
    const auto& metadata = context.client_metadata();
    std::lock_guard lock(mu_);
    auto tp = metadata.find("traceparent");
    traceparents_.push_back(
        tp == metadata.end() ? "" : std::string(tp->second.data(), tp->second.size()));
    auto ts = metadata.find("tracestate");
    tracestates_.push_back(
        ts == metadata.end() ? "" : std::string(ts->second.data(), ts->second.size()));
  }

  const std::vector<uint64_t> unanswered_;
  std::mutex mu_;
  std::vector<std::string> traceparents_, tracestates_;
  std::vector<std::vector<uint64_t>> streams_;
};

constexpr char kTraceparent[] = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

TEST(TraceContextTest, ValidTraceparentFollowsW3C) {
  EXPECT_TRUE(ValidTraceparent(kTraceparent));
  EXPECT_TRUE(ValidTraceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x=1"));
  EXPECT_FALSE(ValidTraceparent(""));
  EXPECT_FALSE(ValidTraceparent("00-x\r\n"));
  EXPECT_FALSE(ValidTraceparent("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01"));
  EXPECT_FALSE(ValidTraceparent("00-00000000000000000000000000000000-b7ad6b7169203331-01"));
  EXPECT_FALSE(ValidTraceparent("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"));
  EXPECT_FALSE(ValidTraceparent("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"));
  EXPECT_FALSE(ValidTraceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x"));
  EXPECT_FALSE(ValidTraceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n"));
  EXPECT_TRUE(ValidTracestate("congo=t61rcWkgMzE"));
  EXPECT_FALSE(ValidTracestate("congo=t61\r\n"));
  EXPECT_FALSE(ValidTracestate(std::string(513, 'a')));
}

class TraceMetadataTest : public ::testing::TestWithParam<bool> {};

TEST_P(TraceMetadataTest, AnInvalidTraceparentCostsTheCallsTheirTraceHeaderOnly) {
  // gRPC aborted the process (GRPC_CALL_ERROR_INVALID_METADATA) on the first step.
  RecordingEpsd fake;
  const std::string target = FakeTarget(GetParam() ? "tp-stream" : "tp-unary");
  std::unique_ptr<grpc::Server> server = Serve(&fake, target);
  ASSERT_NE(server, nullptr);
  ClientOptions options = FakeOptions(target, GetParam());
  options.traceparent = "00-x\r\n";
  options.tracestate = "a=b";
  {
    EpsClient client(options, Attach("engine-bad-trace"));
    ASSERT_TRUE(client.Attach().ok());
    const v1::BatchRow row = Row();
    for (uint64_t step = 1; step <= 3; ++step) {
      const StepResult r = client.SelectPages(step, {&row, 1});
      EXPECT_FALSE(r.fallback) << r.status;
      EXPECT_TRUE(r.status.ok()) << r.status;
    }
  }
  ASSERT_FALSE(fake.traceparents().empty());
  for (const std::string& tp : fake.traceparents()) EXPECT_EQ(tp, "");
  for (const std::string& ts : fake.tracestates()) EXPECT_EQ(ts, "");
  server->Shutdown();
}

TEST_P(TraceMetadataTest, AValidTraceparentIsSentAndAnInvalidTracestateIsNot) {
  RecordingEpsd fake;
  const std::string target = FakeTarget(GetParam() ? "ts-stream" : "ts-unary");
  std::unique_ptr<grpc::Server> server = Serve(&fake, target);
  ASSERT_NE(server, nullptr);
  ClientOptions options = FakeOptions(target, GetParam());
  options.traceparent = kTraceparent;
  options.tracestate = "congo=t61\r\n";
  {
    EpsClient client(options, Attach("engine-bad-tracestate"));
    ASSERT_TRUE(client.Attach().ok());
    const v1::BatchRow row = Row();
    const StepResult r = client.SelectPages(1, {&row, 1});
    EXPECT_TRUE(r.status.ok()) << r.status;
  }
  ASSERT_EQ(fake.traceparents().size(), 1u);
  EXPECT_EQ(fake.traceparents()[0], kTraceparent);
  EXPECT_EQ(fake.tracestates()[0], "");
  server->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(UnaryAndStream, TraceMetadataTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "Stream" : "Unary";
                         });

class StreamDeadlineTest : public ::testing::TestWithParam<bool> {};

TEST_P(StreamDeadlineTest, AMissedStepCancelsTheStreamWhetherTheEngineFallsBackOrNot) {
  // Fail-closed once returned before cancelling: the stream stayed open, and epsd ran the
  // next steps on it after the engine had given up on the first.
  const bool fail_open = GetParam();
  RecordingEpsd fake(/*unanswered=*/{1});
  const std::string target = FakeTarget(fail_open ? "miss-open" : "miss-closed");
  std::unique_ptr<grpc::Server> server = Serve(&fake, target);
  ASSERT_NE(server, nullptr);
  ClientOptions options = FakeOptions(target, /*use_stream=*/true, std::chrono::milliseconds(100));
  options.fail_open = fail_open;
  {
    EpsClient client(options, Attach("engine-stream-miss"));
    ASSERT_TRUE(client.Attach().ok());
    const v1::BatchRow row = Row();
    const StepResult missed = client.SelectPages(1, {&row, 1});
    EXPECT_EQ(missed.status.code(), absl::StatusCode::kDeadlineExceeded) << missed.status;
    EXPECT_EQ(missed.fallback, fail_open);
    // The next step goes on a fresh stream; retried a few times on a loaded machine.
    bool selected = false;
    for (uint64_t step = 2; step < 10 && !selected; ++step) {
      selected = client.SelectPages(step, {&row, 1}).status.ok();
    }
    EXPECT_TRUE(selected);
    // At least the missed step (a retry may miss too on a loaded machine), counted by mode.
    const ClientCounters c = client.counters();
    EXPECT_EQ(fail_open ? c.errors : c.fallback_deadline, 0u);
    EXPECT_GE(fail_open ? c.fallback_deadline : c.errors, 1u);
  }
  server->Shutdown();
  const std::vector<std::vector<uint64_t>> streams = fake.streams();
  ASSERT_GE(streams.size(), 2u);
  EXPECT_EQ(streams[0], std::vector<uint64_t>{1}) << "the missed step's stream carried more";
}

INSTANTIATE_TEST_SUITE_P(FailOpenAndClosed, StreamDeadlineTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "FailOpen" : "FailClosed";
                         });

TEST(ClientOptionsTest, ValidateNamesTheOffendingField) {
  ClientOptions options;
  EXPECT_TRUE(options.Validate().ok());
  options.deadline = std::chrono::microseconds(-5);
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(options.Validate().message().find("ClientOptions.deadline=-5us"), std::string::npos)
      << options.Validate();
  options = ClientOptions();
  options.attach_deadline = std::chrono::milliseconds(0);
  EXPECT_NE(options.Validate().message().find("attach_deadline=0ms"), std::string::npos);
  options = ClientOptions();
  options.reattach_backoff = std::chrono::milliseconds(-1);
  EXPECT_NE(options.Validate().message().find("reattach_backoff=-1ms"), std::string::npos);
  options = ClientOptions();
  options.target = "";
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ClientOptionsTest, CreateRefusesInvalidOptionsAndTheConstructorReportsThemPerCall) {
  ClientOptions options;
  options.target = FakeTarget("never-served");
  options.deadline = std::chrono::microseconds(0);
  absl::StatusOr<std::unique_ptr<EpsClient>> created =
      EpsClient::Create(options, Attach("engine-bad-options"));
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);

  EpsClient client(options, Attach("engine-bad-options"));
  EXPECT_EQ(client.Attach().code(), absl::StatusCode::kInvalidArgument);
  const v1::BatchRow row = Row();
  const StepResult r = client.SelectPages(1, {&row, 1});
  EXPECT_TRUE(r.fallback);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  EXPECT_EQ(client.counters().fallback_error, 1u);
}

TEST(ClientOptionsTest, HugeDeadlinesDoNotWrap) {
  // attach_deadline = milliseconds::max() once wrapped now() + d into the past: every
  // Attach failed at once with DEADLINE_EXCEEDED.
  RecordingEpsd fake;
  const std::string target = FakeTarget("huge");
  std::unique_ptr<grpc::Server> server = Serve(&fake, target);
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.target = target;
  options.attach_deadline = std::chrono::milliseconds::max();
  options.deadline = std::chrono::microseconds::max();
  options.reattach_backoff = std::chrono::milliseconds::max();
  {
    absl::StatusOr<std::unique_ptr<EpsClient>> client =
        EpsClient::Create(options, Attach("engine-huge"));
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->Attach().ok());
    const v1::BatchRow row = Row();
    const StepResult r = (*client)->SelectPages(1, {&row, 1});
    EXPECT_TRUE(r.status.ok()) << r.status;
    EXPECT_TRUE((*client)->Heartbeat().ok());
    EXPECT_TRUE((*client)->Ping(std::chrono::microseconds::max()).ok());
  }
  server->Shutdown();
}

}  // namespace
}  // namespace eps::client
