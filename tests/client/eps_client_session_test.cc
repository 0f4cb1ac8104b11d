// client/cpp/eps_client.cc's session against fake epsd servers (no epsd binary): Attach
// with a background re-attach in flight, an Attach granting no session id, a Heartbeat
// answered NOT_FOUND, a failed or unstartable re-attach, epsd's drain, a stream reply for another
// step (an error at once), and steps after Detach (refused).
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#include "client/cpp/eps_client.h"
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

// Answers every Attach OK without a session id, and counts the steps that reach it.
class EmptySessionEpsd final : public v1::PageSelector::Service {
 public:
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*,
                      v1::AttachResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status SelectPages(grpc::ServerContext*, const v1::SelectPagesRequest*,
                           v1::SelectPagesResponse*) override {
    ++steps_;
    return {grpc::StatusCode::NOT_FOUND, "session '' not found (detached or lease expired)"};
  }
  int steps() const { return steps_.load(); }

 private:
  std::atomic<int> steps_{0};
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

// An Attach epsd answers OK without a session id (a server that lost the field, or another
// service on the socket) once read as attached: Attach() returned OK with no session, and every
// step went to epsd with an empty id (NOT_FOUND), each answer counted as a re-attach. It is an
// INTERNAL error naming the missing field, and the background re-attach fails with it.
TEST(AttachReplyTest, AnAttachGrantingNoSessionIdIsAnError) {
  EmptySessionEpsd epsd;
  const std::string target = FakeTarget("no-session-id");
  auto server = Serve(&epsd, target);
  ASSERT_NE(server, nullptr);
  {
    ClientOptions options = FakeOptions(target, /*use_stream=*/false);
    options.reattach_backoff = std::chrono::milliseconds(0);
    EpsClient client(options, Attach("e"));
    const absl::Status attached = client.Attach();
    EXPECT_EQ(attached.code(), absl::StatusCode::kInternal) << attached;
    EXPECT_NE(attached.message().find("granted no session_id"), std::string::npos) << attached;
    EXPECT_EQ(client.session_id(), "");
    const v1::BatchRow row = Row();
    StepResult later;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (uint64_t step = 1; std::chrono::steady_clock::now() < until; ++step) {
      later = client.SelectPages(step, {&row, 1});
      ASSERT_TRUE(later.fallback);
      if (later.status.message().find("re-attach failed") != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(later.status.code(), absl::StatusCode::kUnavailable) << later.status;
    EXPECT_NE(later.status.message().find("re-attach failed: INTERNAL"), std::string::npos)
        << later.status;
    const ClientCounters c = client.counters();
    EXPECT_EQ(c.fallback_not_attached, c.steps);
    EXPECT_EQ(c.reattaches, 0u);
  }
  server->Shutdown();
  EXPECT_EQ(epsd.steps(), 0);  // no step went out with an empty session id
}

// Grants "s-<n>" for the n-th Attach and answers every Heartbeat NOT_FOUND, forgetting every
// session granted so far (a restarted epsd, an expired lease); a step is answered for the
// newest session granted since, NOT_FOUND for any other (counted).
class ForgettingEpsd final : public v1::PageSelector::Service {
 public:
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*,
                      v1::AttachResponse* response) override {
    response->set_session_id("s-" + std::to_string(++attaches_));
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse*) override {
    forgotten_ = attaches_.load();
    return {grpc::StatusCode::NOT_FOUND,
            absl::StrCat("session '", request->session_id(), "' not found: re-attach")};
  }
  grpc::Status SelectPages(grpc::ServerContext*, const v1::SelectPagesRequest* request,
                           v1::SelectPagesResponse* response) override {
    const int newest = attaches_.load();
    if (newest <= forgotten_.load() || request->session_id() != "s-" + std::to_string(newest)) {
      ++stale_steps_;
      return {grpc::StatusCode::NOT_FOUND, "session not found (detached or lease expired)"};
    }
    response->set_step(request->step());
    response->set_done(true);  // a sync reply: the outputs are written
    return grpc::Status::OK;
  }
  int stale_steps() const { return stale_steps_.load(); }

 private:
  std::atomic<int> attaches_{0}, forgotten_{0}, stale_steps_{0};
};

// A Heartbeat answered NOT_FOUND left the dead session in place: the next step went to epsd
// with it (one more NOT_FOUND fallback, and on the stream a stream opened for nothing) before
// the client re-attached. The session is forgotten, as the Python client's heartbeat() does:
// the next step starts the background re-attach at once.
TEST(HeartbeatTest, AHeartbeatAnsweredNotFoundForgetsTheSession) {
  ForgettingEpsd epsd;
  const std::string target = FakeTarget("heartbeat-not-found");
  auto server = Serve(&epsd, target);
  ASSERT_NE(server, nullptr);
  {
    ClientOptions options = FakeOptions(target, /*use_stream=*/false);
    options.reattach_backoff = std::chrono::milliseconds(0);
    EpsClient client(options, Attach("e"));
    ASSERT_TRUE(client.Attach().ok());
    ASSERT_EQ(client.session_id(), "s-1");
    const absl::Status beat = client.Heartbeat();
    EXPECT_EQ(beat.code(), absl::StatusCode::kNotFound) << beat;
    EXPECT_EQ(client.session_id(), "");
    const v1::BatchRow row = Row();
    StepResult r;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (uint64_t step = 1; std::chrono::steady_clock::now() < until; ++step) {
      r = client.SelectPages(step, {&row, 1});
      if (r.status.ok()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(client.session_id(), "s-2");
    EXPECT_EQ(client.counters().fallback_not_attached, client.counters().fallbacks());
  }
  server->Shutdown();
  EXPECT_EQ(epsd.stale_steps(), 0);  // no step named the session epsd had forgotten
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
// `stream_offset` added to the step and `done` as the reply's (a confused epsd when non-zero
// or false); records the steps each stream carried.
class CountingEpsd final : public v1::PageSelector::Service {
 public:
  explicit CountingEpsd(uint64_t stream_offset = 0, bool done = true)
      : stream_offset_(stream_offset), done_(done) {}
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
    response->set_done(done_);
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
      response.set_done(done_);
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
  const bool done_;
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

// A sync reply says its outputs are written (done): one that says otherwise was handed to
// the engine as a selection, whose lists epsd had not finished. An error fallback, on both
// transports; an async call's reply (done=false by design) is a selection.
TEST(StreamReplyTest, ASyncReplyThatIsNotDoneIsAnErrorFallback) {
  for (const bool use_stream : {false, true}) {
    CountingEpsd epsd(/*stream_offset=*/0, /*done=*/false);
    const std::string target = FakeTarget(use_stream ? "not-done-stream" : "not-done-unary");
    auto server = Serve(&epsd, target);
    ASSERT_NE(server, nullptr);
    {
      EpsClient client(FakeOptions(target, use_stream, std::chrono::seconds(20)), Attach("e"));
      ASSERT_TRUE(client.Attach().ok());
      const v1::BatchRow row = Row();
      const StepResult r = client.SelectPages(1, {&row, 1});
      EXPECT_TRUE(r.fallback) << use_stream;
      EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal) << r.status;
      EXPECT_NE(r.status.message().find("epsd answered step 1 with done=false"), std::string::npos)
          << r.status;
      EXPECT_EQ(client.counters().fallback_error, 1u);
      ClientOptions async_options = FakeOptions(target, use_stream, std::chrono::seconds(20));
      async_options.reply_async = true;
      EpsClient async_client(async_options, Attach("f"));
      ASSERT_TRUE(async_client.Attach().ok());
      const StepResult async = async_client.SelectPages(1, {&row, 1});
      EXPECT_TRUE(async.status.ok()) << async.status;
      EXPECT_FALSE(async.fallback);
    }
    server->Shutdown();
  }
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
