// client/cpp/eps_client.cc against fake epsd servers (no epsd binary): trace metadata
// gRPC cannot carry is dropped rather than aborting the process, a missed step cancels
// the stream whether the engine falls back or not, a stream reply for another step is an
// error at once, steps after Detach are refused, a re-attach that cannot start is a
// fallback, and ClientOptions are validated with deadlines that never wrap.
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

namespace eps::client {
namespace {

std::string FakeTarget(const std::string& name) {
  return "unix:///tmp/eps-fake-client-" + name + "-" + std::to_string(getpid()) + ".sock";
}

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, const std::string& target) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(target, grpc::InsecureServerCredentials());
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

// A client of a fake server: `deadline` for a step, `attach_deadline` for an Attach.
ClientOptions FakeOptions(const std::string& target, bool use_stream,
                          std::chrono::microseconds deadline = std::chrono::seconds(5),
                          std::chrono::milliseconds attach_deadline = std::chrono::seconds(5)) {
  ClientOptions options;
  options.target = target;
  options.use_stream = use_stream;
  options.deadline = deadline;
  options.attach_deadline = attach_deadline;
  return options;
}

v1::AttachRequest Attach(const std::string& engine_id) {
  v1::AttachRequest attach;
  attach.set_engine_id(engine_id);
  return attach;
}

v1::BatchRow Row() {
  v1::BatchRow row;
  row.set_context_tokens(16);
  return row;
}

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

namespace eps::client {
namespace {

// Holds every Attach until released (or 5 s), then grants "s-<n>" for the n-th call.
class HeldAttachEpsd final : public v1::PageSelector::Service {
 public:
  grpc::Status Attach(grpc::ServerContext* context, const v1::AttachRequest*,
                      v1::AttachResponse* response) override {
    std::unique_lock lock(mu_);
    const int n = ++calls_;
    released_.wait_for(lock, std::chrono::seconds(5),
                       [&] { return release_ || context->IsCancelled(); });
    response->set_session_id("s-" + std::to_string(n));
    return grpc::Status::OK;
  }
  void Release() {
    std::lock_guard lock(mu_);
    release_ = true;
    released_.notify_all();
  }
  int calls() {
    std::lock_guard lock(mu_);
    return calls_;
  }

 private:
  std::mutex mu_;
  std::condition_variable released_;
  int calls_ = 0;
  bool release_ = false;
};

// Attach() waited attach_deadline for the background re-attach, then another for its
// own call: twice what the option promises.
TEST(AttachDeadlineTest, AttachWithABackgroundReattachInFlightKeepsToOneDeadline) {
  HeldAttachEpsd epsd;
  const std::string target = FakeTarget("held");
  auto server = Serve(&epsd, target);
  ASSERT_NE(server, nullptr);
  {
    EpsClient client(
        FakeOptions(target, false, std::chrono::milliseconds(50), std::chrono::milliseconds(600)),
        Attach("e"));
    const v1::BatchRow row = Row();
    EXPECT_TRUE(client.SelectPages(1, {&row, 1}).fallback);  // starts the background Attach
    const auto start = std::chrono::steady_clock::now();
    const absl::Status s = client.Attach();
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_LT(took, std::chrono::milliseconds(600 + 450));  // two deadlines were >= 1200 ms
    epsd.Release();
  }
  server->Shutdown();
}

TEST(AttachDeadlineTest, AttachAdoptsTheSessionABackgroundReattachWasGranted) {
  HeldAttachEpsd epsd;
  const std::string target = FakeTarget("adopt");
  auto server = Serve(&epsd, target);
  ASSERT_NE(server, nullptr);
  {
    EpsClient client(FakeOptions(target, false, std::chrono::milliseconds(50)), Attach("e"));
    const v1::BatchRow row = Row();
    EXPECT_TRUE(client.SelectPages(1, {&row, 1}).fallback);  // starts the background Attach
    while (epsd.calls() == 0) std::this_thread::yield();     // the call reached the server
    epsd.Release();
    EXPECT_TRUE(client.Attach().ok());
    EXPECT_EQ(client.session_id(), "s-1");  // no second Attach replaced it
    EXPECT_EQ(epsd.calls(), 1);
  }
  server->Shutdown();
}

}  // namespace
}  // namespace eps::client

namespace eps::client {
namespace {

// Answers every Attach with `attach` (granting "s-fake" when it is OK) and every unary
// step with `step`: epsd refusing a layout it cannot serve, or draining.
class FailingEpsd final : public v1::PageSelector::Service {
 public:
  FailingEpsd(grpc::Status attach, grpc::Status step)
      : attach_(std::move(attach)), step_(std::move(step)) {}
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*,
                      v1::AttachResponse* response) override {
    if (attach_.ok()) response->set_session_id("s-fake");
    return attach_;
  }
  grpc::Status SelectPages(grpc::ServerContext*, const v1::SelectPagesRequest*,
                           v1::SelectPagesResponse*) override {
    return step_;
  }

 private:
  const grpc::Status attach_, step_;
};

// A fail-closed step while the background re-attach has failed once returned the Attach's
// own INVALID_ARGUMENT, which an engine reads as its step's; it is UNAVAILABLE naming the
// re-attach (docs/api-failures.md 5.3), as in the Python client.
TEST(ReattachStatusTest, AStepWhileNotAttachedIsUnavailableNamingTheFailedReattach) {
  FailingEpsd epsd({grpc::StatusCode::INVALID_ARGUMENT, "layout.num_layers=0 not in [1, 4096]"},
                   grpc::Status::OK);
  const std::string target = FakeTarget("refusing");
  auto server = Serve(&epsd, target);
  ASSERT_NE(server, nullptr);
  {
    ClientOptions options = FakeOptions(target, false, std::chrono::milliseconds(200));
    options.fail_open = false;
    options.reattach_backoff = std::chrono::milliseconds(0);
    EpsClient client(options, Attach("e"));
    const v1::BatchRow row = Row();
    const StepResult first = client.SelectPages(1, {&row, 1});  // starts the re-attach
    EXPECT_EQ(first.status.code(), absl::StatusCode::kUnavailable) << first.status;
    StepResult later;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (uint64_t step = 2; std::chrono::steady_clock::now() < until; ++step) {
      later = client.SelectPages(step, {&row, 1});
      if (later.status.message().find("re-attach failed") != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(later.status.code(), absl::StatusCode::kUnavailable) << later.status;
    EXPECT_NE(later.status.message().find(
                  "not attached; re-attach failed: INVALID_ARGUMENT: layout.num_layers=0"),
              std::string::npos)
        << later.status;
    EXPECT_FALSE(later.fallback);
  }
  server->Shutdown();
}

// A step epsd cancels (its SIGTERM drain) was an error fallback; it is an unavailable one,
// and the client closes its stream, as for UNAVAILABLE.
TEST(DrainStatusTest, AStepEpsdCancelsIsAnUnavailableFallback) {
  FailingEpsd epsd(grpc::Status::OK, {grpc::StatusCode::CANCELLED, "Cancelling all calls"});
  const std::string target = FakeTarget("draining");
  auto server = Serve(&epsd, target);
  ASSERT_NE(server, nullptr);
  {
    EpsClient client(FakeOptions(target, /*use_stream=*/false), Attach("e"));
    ASSERT_TRUE(client.Attach().ok());
    const v1::BatchRow row = Row();
    const StepResult r = client.SelectPages(1, {&row, 1});
    EXPECT_TRUE(r.fallback);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
    const ClientCounters c = client.counters();
    EXPECT_EQ(c.fallback_unavailable, 1u);
    EXPECT_EQ(c.fallback_error, 0u);
  }
  server->Shutdown();
}

}  // namespace
}  // namespace eps::client

namespace eps::client {
namespace {

// Grants "s-<n>" for the n-th Attach and answers every step at once, on the stream with
// `stream_offset` added to the step (a confused epsd when non-zero); records the steps each
// stream carried.
class CountingEpsd final : public v1::PageSelector::Service {
 public:
  explicit CountingEpsd(uint64_t stream_offset = 0) : stream_offset_(stream_offset) {}
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*,
                      v1::AttachResponse* response) override {
    std::lock_guard lock(mu_);
    response->set_session_id("s-" + std::to_string(++attaches_));
    return grpc::Status::OK;
  }
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest*,
                      v1::DetachResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status SelectPages(grpc::ServerContext*, const v1::SelectPagesRequest* request,
                           v1::SelectPagesResponse* response) override {
    response->set_step(request->step());
    return grpc::Status::OK;
  }
  grpc::Status StreamSelectPages(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::SelectPagesResponse, v1::SelectPagesRequest>* stream) override {
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
      v1::SelectPagesResponse response;
      response.set_step(request.step() + stream_offset_);
      if (!stream->Write(response)) break;
    }
    return grpc::Status::OK;
  }
  int attaches() {
    std::lock_guard lock(mu_);
    return attaches_;
  }
  std::vector<std::vector<uint64_t>> streams() {
    std::lock_guard lock(mu_);
    return streams_;
  }

 private:
  const uint64_t stream_offset_;
  std::mutex mu_;
  int attaches_ = 0;
  std::vector<std::vector<uint64_t>> streams_;
};

// The stream once dropped a reply for another step and waited for one that never came: the
// whole deadline, then counted as a deadline miss. It is an error fallback at once, as on
// the unary transport, and the next step goes on a fresh stream.
TEST(StreamReplyTest, AReplyForAnotherStepIsAnErrorFallbackAtOnce) {
  CountingEpsd epsd(/*stream_offset=*/1000);
  const std::string target = FakeTarget("wrong-step-stream");
  auto server = Serve(&epsd, target);
  ASSERT_NE(server, nullptr);
  {
    EpsClient client(FakeOptions(target, /*use_stream=*/true, std::chrono::seconds(20)),
                     Attach("e"));
    ASSERT_TRUE(client.Attach().ok());
    const v1::BatchRow row = Row();
    for (uint64_t step = 1; step <= 2; ++step) {
      const auto start = std::chrono::steady_clock::now();
      const StepResult r = client.SelectPages(step, {&row, 1});
      // Far less than the 20 s deadline the dropped reply made it wait.
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
      EXPECT_TRUE(r.fallback);
      EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal) << r.status;
      EXPECT_NE(r.status.message().find(
                    absl::StrCat("epsd answered step ", step + 1000, " for step ", step)),
                std::string::npos)
          << r.status;
    }
    const ClientCounters c = client.counters();
    EXPECT_EQ(c.fallback_error, 2u);
    EXPECT_EQ(c.fallback_deadline, 0u);
    EXPECT_EQ(c.selected, 0u);
  }
  server->Shutdown();
  const std::vector<std::vector<uint64_t>> streams = epsd.streams();
  ASSERT_EQ(streams.size(), 2u);  // a stream that answered another step carries no more
  EXPECT_EQ(streams[0], std::vector<uint64_t>{1});
  EXPECT_EQ(streams[1], std::vector<uint64_t>{2});
}

// A step after Detach() once started a background Attach: the session the engine had just
// ended came back behind its back (and its memory on epsd with it).
TEST(DetachTest, StepsAfterDetachAreRefusedUntilAttachIsCalledAgain) {
  CountingEpsd epsd;
  const std::string target = FakeTarget("detached");
  auto server = Serve(&epsd, target);
  ASSERT_NE(server, nullptr);
  {
    ClientOptions options = FakeOptions(target, /*use_stream=*/false);
    options.reattach_backoff = std::chrono::milliseconds(0);
    std::vector<uint64_t> fell_back;
    options.on_fallback = [&](uint64_t step) { fell_back.push_back(step); };
    EpsClient client(options, Attach("e"));
    ASSERT_TRUE(client.Attach().ok());
    const v1::BatchRow row = Row();
    ASSERT_TRUE(client.SelectPages(1, {&row, 1}).status.ok());
    ASSERT_TRUE(client.Detach().ok());
    for (uint64_t step = 2; step <= 4; ++step) {
      const StepResult r = client.SelectPages(step, {&row, 1});
      EXPECT_TRUE(r.fallback);
      EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
      EXPECT_NE(r.status.message().find("the client detached: call Attach()"), std::string::npos)
          << r.status;
    }
    EXPECT_EQ(fell_back, (std::vector<uint64_t>{2, 3, 4}));
    EXPECT_EQ(client.session_id(), "");
    ClientCounters c = client.counters();
    EXPECT_EQ(c.fallback_error, 3u);
    EXPECT_EQ(c.fallback_not_attached, 0u);
    EXPECT_EQ(epsd.attaches(), 1);  // nothing re-attached
    ASSERT_TRUE(client.Attach().ok());
    EXPECT_TRUE(client.SelectPages(5, {&row, 1}).status.ok());
    EXPECT_EQ(epsd.attaches(), 2);
    c = client.counters();
    EXPECT_EQ(c.steps, c.selected + c.fallbacks());
  }
  server->Shutdown();
}

TEST(DetachTest, AFailClosedStepAfterDetachIsAnError) {
  ClientOptions options = FakeOptions(FakeTarget("detached-closed"), /*use_stream=*/false);
  options.fail_open = false;
  EpsClient client(options, Attach("e"));
  EXPECT_TRUE(client.Detach().ok());  // nothing attached: nothing to end, still detached
  const v1::BatchRow row = Row();
  const StepResult r = client.SelectPages(1, {&row, 1});
  EXPECT_FALSE(r.fallback);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
  EXPECT_EQ(client.counters().errors, 1u);
}

// std::async throws std::system_error when no thread can be created (EAGAIN: a pids cgroup
// limit, RLIMIT_NPROC); it once left SelectPages as that exception, with no fallback
// (on_fallback not called, the engine's stream left waiting) and the step uncounted.
TEST(ReattachStartTest, AReattachThatCannotStartIsANotAttachedFallbackWithTheBackoff) {
  ClientOptions options = FakeOptions(FakeTarget("no-threads"), /*use_stream=*/false);
  options.reattach_backoff = std::chrono::hours(1);
  std::vector<uint64_t> fell_back;
  options.on_fallback = [&](uint64_t step) { fell_back.push_back(step); };
  EpsClient client(options, Attach("e"));
  int starts = 0;
  client.set_reattach_starter_for_test([&](std::function<absl::StatusOr<std::string>()>)
                                           -> std::future<absl::StatusOr<std::string>> {
    ++starts;
    throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                            "pthread_create");
  });
  const v1::BatchRow row = Row();
  const StepResult first = client.SelectPages(1, {&row, 1});
  EXPECT_TRUE(first.fallback);
  EXPECT_EQ(first.status.code(), absl::StatusCode::kUnavailable) << first.status;
  EXPECT_NE(first.status.message().find("not attached; could not start the re-attach: "
                                        "pthread_create"),
            std::string::npos)
      << first.status;
  const StepResult second = client.SelectPages(2, {&row, 1});
  EXPECT_TRUE(second.fallback);
  EXPECT_NE(second.status.message().find("backing off"), std::string::npos) << second.status;
  EXPECT_EQ(starts, 1);  // the backoff held the second try
  EXPECT_EQ(fell_back, (std::vector<uint64_t>{1, 2}));
  const ClientCounters c = client.counters();
  EXPECT_EQ(c.steps, 2u);
  EXPECT_EQ(c.fallback_not_attached, 2u);
  EXPECT_EQ(c.fallbacks(), 2u);
}

}  // namespace
}  // namespace eps::client
