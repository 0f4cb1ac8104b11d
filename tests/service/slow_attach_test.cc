// Attaches whose session builds are slow (an engine's buffers slow to map, its CUDA IPC
// handles slow to open): the builds run on the StepExecutor, not on gRPC's few callback
// threads, so more of them than those threads run at once while other engines' calls are
// answered; and an Attach whose client gave up builds nothing, or frees what it built
// (service/session_service.h, StartAttach).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "service/cpu_backend.h"
#include "service/server.h"
#include "service/session_service.h"
#include "service/step_executor.h"
#include "tests/core/test_util.h"
#include "tests/service/long_calls.h"
#include "tests/service/loopback_server.h"
#include "tests/service/slow_builds.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;

std::chrono::system_clock::time_point In(std::chrono::milliseconds wait) {
  return std::chrono::system_clock::now() + wait;
}

// epsd on a loopback port whose "slow-*" engines' session builds wait for the test, with
// one engine ("idle") attached at once.
class SlowAttachTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A lease far past the tests' waits: a session still held after one was never freed.
    absl::StatusOr<LoopbackServer> epsd = StartLoopbackServer(
        SlowBuilds(&builds_), {"--lease-ms=60000", absl::StrCat("--max-sessions=", kSlow + 1)});
    ASSERT_TRUE(epsd.ok()) << epsd.status();
    server_ = std::move(epsd->server);
    stub_ = std::move(epsd->stub);
    engine_.Fill(0, 0, 300);
    v1::AttachResponse attached;
    const grpc::Status s = eps::testing::RawAttach(*stub_, engine_.Attach("idle"), &attached);
    ASSERT_TRUE(s.ok()) << s.error_message();
    idle_ = attached.session_id();
  }
  void TearDown() override {
    if (!builds_.release.HasBeenNotified()) builds_.release.Notify();  // nothing waits for ever
    for (std::thread& call : calls_) call.join();
  }

  // An Attach sent from a thread of its own; the fixture keeps what it wrote until the
  // thread is joined, whether or not the test body got that far.
  struct AttachCall {
    grpc::Status status;
    v1::AttachResponse response;
  };
  // Attaches `engine_id` within `deadline`.
  const AttachCall& SendAttach(const std::string& engine_id, std::chrono::milliseconds deadline) {
    AttachCall* call = &attaches_.emplace_back();
    calls_.emplace_back([this, engine_id, deadline, call] {
      grpc::ClientContext context;
      context.set_deadline(In(deadline));
      call->status = stub_->Attach(&context, engine_.Attach(engine_id), &call->response);
    });
    return *call;
  }
  void JoinCalls() {
    for (std::thread& call : calls_) call.join();
    calls_.clear();
  }

  // Twice the callback threads gRPC 1.51 starts, and more.
  const int kSlow = 2 * StepExecutor::GrpcCallbackThreads() + 2;
  held::LongCalls builds_;
  TestEngine engine_{eps::testing::SmallServiceModel(), /*max_seqs=*/1, /*max_context=*/512,
                     /*max_batch=*/1, eps::testing::TestSeed()};
  std::unique_ptr<EpsServer> server_;
  std::unique_ptr<v1::PageSelector::Stub> stub_;
  std::string idle_;
  std::deque<AttachCall> attaches_;  // written by calls_
  std::vector<std::thread> calls_;
};

// Attach built its session on the gRPC callback thread: with as many slow builds as those
// threads, further Attaches waited, and so did every other engine's calls (its Heartbeat,
// a Ping). Now the builds run on the StepExecutor: all of them at once, and the other
// engine is answered while they run.
TEST_F(SlowAttachTest, SlowBuildsOfMoreAttachesThanCallbackThreadsRunAtOnceWhileOthersAreAnswered) {
  for (int i = 0; i < kSlow; ++i) SendAttach(absl::StrCat("slow-", i), std::chrono::seconds(60));
  ASSERT_TRUE(builds_.AwaitStarted(kSlow))
      << builds_.started() << " of " << kSlow << " session builds ran at once";
  {
    grpc::ClientContext context;
    context.set_deadline(In(std::chrono::seconds(10)));
    v1::HeartbeatRequest request;
    request.set_session_id(idle_);
    v1::HeartbeatResponse response;
    const grpc::Status s = stub_->Heartbeat(&context, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  {
    grpc::ClientContext context;
    context.set_deadline(In(std::chrono::seconds(10)));
    v1::PingResponse response;
    const grpc::Status s = stub_->Ping(&context, v1::PingRequest(), &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(server_->sessions().session_count(), 1u);  // answered while every build still ran
  builds_.release.Notify();
  JoinCalls();
  for (const AttachCall& call : attaches_) {
    EXPECT_TRUE(call.status.ok()) << call.status.error_message();
    EXPECT_FALSE(call.response.session_id().empty());
  }
  EXPECT_EQ(server_->sessions().session_count(), static_cast<size_t>(kSlow) + 1);
}

// An Attach whose client's deadline passed while its session was built answered OK to no
// one, and the session it built held its memory and its charges against the server's
// budgets until its lease ran out. Now it is retired and freed before the call ends.
TEST_F(SlowAttachTest, AnAttachWhoseDeadlinePassesDuringTheBuildFreesWhatItBuilt) {
  const uint64_t idle_charged = server_->sessions().charged_bytes();
  // Long enough to reach the build on a loaded machine (a call cancelled while still queued
  // builds nothing, and the wait below would fail); the build is held past it.
  const AttachCall& call = SendAttach("slow-0", std::chrono::seconds(2));
  ASSERT_TRUE(builds_.AwaitStarted(1));
  const uint64_t charged_in_build = server_->sessions().charged_bytes();
  JoinCalls();  // the client has given up
  EXPECT_EQ(call.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << call.status.error_message();
  // The server's deadline is the client's plus the request's transit, and gRPC marks the
  // call cancelled only once it has processed that: released at once, the build could find
  // the call still alive (and rightly publish). Past both, it cannot.
  absl::SleepFor(absl::Milliseconds(200));
  builds_.release.Notify();
  EXPECT_TRUE(builds_.AwaitStopped(1)) << "the session built for a dead Attach was not freed";
  // The backend goes first; the rest of the session (its charges) right after it.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (server_->sessions().charged_bytes() > idle_charged && absl::Now() < give_up) {
    std::this_thread::yield();
  }
  EXPECT_GT(charged_in_build, idle_charged);  // what the build charged before its backend
  EXPECT_EQ(server_->sessions().charged_bytes(), idle_charged);
  EXPECT_EQ(server_->sessions().session_count(), 1u);
}

// An Attach queued for a thread while its caller gives up builds nothing: no mapping, no
// allocation, no backend. The session service alone, on an executor of one thread that
// the test holds busy.
TEST(SlowAttachServiceTest, AnAttachWhoseCallerGaveUpWhileQueuedBuildsNothing) {
  std::atomic<int> builds{0};
  StepExecutor executor(1);
  SessionService service(
      ServerConfig(), nullptr,
      [&builds](const SessionSpec& spec, const SessionBuffers&, const ServerConfig&,
                std::unique_ptr<StepBackend>*) {
        builds.fetch_add(1);
        return MakeCpuBackend(spec.model);
      },
      &executor);
  TestEngine engine(eps::testing::SmallServiceModel(), /*max_seqs=*/1, /*max_context=*/512,
                    /*max_batch=*/1, eps::testing::TestSeed());
  const Peer user{.known = true, .uid = geteuid(), .pid = getpid()};
  absl::Notification busy, free_thread, answered;
  executor.Submit([&] {
    busy.Notify();
    free_thread.WaitForNotification();
  });
  busy.WaitForNotification();
  std::atomic<bool> gave_up{false};
  const v1::AttachRequest request = engine.Attach("engine-0");
  v1::AttachResponse response;
  absl::Status status;
  service.StartAttach(request, &response, {.cancelled = [&gave_up] { return gave_up.load(); }},
                      user, [&](absl::Status s) {
                        status = std::move(s);
                        answered.Notify();
                      });
  EXPECT_FALSE(answered.HasBeenNotified());  // queued behind the busy thread, not built here
  gave_up.store(true);
  free_thread.Notify();
  answered.WaitForNotification();
  executor.Stop();
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
  EXPECT_EQ(builds.load(), 0);
  EXPECT_EQ(service.session_count(), 0u);
  EXPECT_EQ(service.charged_bytes(), 0u);
}

}  // namespace
}  // namespace eps::service
