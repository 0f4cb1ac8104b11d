// In-process tests of how a session admits and ends its steps: one step runs and
// one is parked (service/step_gate.h), further calls are refused at once; Detach and
// a replacing Attach retire the old session under its step lock, so no step of it
// writes the engine's buffers after they answer.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/server.h"
#include "service/session_service.h"
#include "service/step_executor.h"
#include "service/step_gate.h"
#include "service/telemetry/telemetry.h"
#include "tests/core/test_util.h"
#include "tests/service/forwarding_backend.h"
#include "tests/service/held_steps.h"
#include "tests/service/loopback_server.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;
using held::AwaitParked;
using held::EventLog;
using held::On;
using held::RunningStep;
using ::testing::HasSubstr;
using ::testing::Not;

// The cpu backend, but step 1 waits for release_first once started, and step 2 for
// release_second, 10 s at most (run before step 1's reply went out, the defect, it must
// not wait for good, or the test would hang instead of failing). Step 2, parked, runs on
// the StepExecutor, possibly on the thread step 1 ran on once step 1's task has ended.
struct HeldSteps {
  absl::Notification first_started, release_first, release_second;
  EventLog log;
};

class HeldBackend final : public ForwardingBackend {
 public:
  HeldBackend(std::unique_ptr<StepBackend> inner, HeldSteps* held)
      : ForwardingBackend(std::move(inner)), held_(held) {}
  absl::Status Run(const BackendStep& step, StepOutcome* outcome) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    if (step.step == 1) {
      held_->first_started.Notify();
      held_->release_first.WaitForNotification();
    }
    if (step.step == 2) {
      held_->log.Add("step 2 started");
      held_->release_second.WaitForNotificationWithTimeout(absl::Seconds(10));
    }
    const absl::Status s = RunInner(step, outcome);
    if (step.step == 2) held_->log.Add("step 2 ended");
    return s;
  }

 private:
  HeldSteps* held_;
};

// epsd on a loopback port with HeldBackend sessions, and an engine's client of it.
class HeldServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<LoopbackServer> epsd = StartLoopbackServer(WrapCpuBackend<HeldBackend>(&held_));
    ASSERT_TRUE(epsd.ok()) << epsd.status();
    server_ = std::move(epsd->server);
    stub_ = std::move(epsd->stub);
    engine_.Fill(0, 0, 300);
    v1::AttachResponse attached;
    const grpc::Status s = eps::testing::RawAttach(*stub_, engine_.Attach("engine-a"), &attached);
    ASSERT_TRUE(s.ok()) << s.error_message();
    id_ = attached.session_id();
  }
  void TearDown() override {
    // Whatever failed, nothing waits for ever.
    Release(held_.release_first);
    Release(held_.release_second);
    for (std::thread& call : calls_) call.join();
  }

  // Sends step `step` from a thread of its own; its status lands in `*status`, and
  // `event` in the log once its reply has arrived.
  void Send(uint64_t step, grpc::Status* status, std::string event) {
    calls_.emplace_back([this, step, status, event = std::move(event)] {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      v1::SelectPagesResponse reply;
      *status = stub_->SelectPages(&context, TestEngine::Step(id_, step, rows_), &reply);
      held_.log.Add(event);
    });
  }
  StepGate& gate() { return server_->sessions().session_for_test(id_)->step_gate(); }
  static void Release(absl::Notification& n) {
    if (!n.HasBeenNotified()) n.Notify();
  }

  HeldSteps held_;
  TestEngine engine_{eps::testing::SmallServiceModel(), /*max_seqs=*/1, /*max_context=*/512,
                     /*max_batch=*/1, eps::testing::TestSeed()};
  const std::vector<v1::BatchRow> rows_ = {TestEngine::Row(0, 300)};
  std::unique_ptr<EpsServer> server_;
  std::unique_ptr<v1::PageSelector::Stub> stub_;
  std::string id_;
  std::vector<std::thread> calls_;
};

// The running step's reply reaches its client while the step parked behind it still
// runs: it used to wait for that step too (docs/design.md, the parked-step cost).
TEST_F(HeldServerTest, TheRunningStepsReplyArrivesBeforeTheParkedStepEnds) {
  grpc::Status first, second;
  Send(1, &first, "step 1 reply arrived");
  held_.first_started.WaitForNotification();
  Send(2, &second, "step 2 reply arrived");
  ASSERT_TRUE(AwaitParked(gate()));
  Release(held_.release_first);
  held_.log.AwaitAny({"step 1 reply arrived", "step 2 ended"});
  Release(held_.release_second);
  for (std::thread& call : calls_) call.join();
  calls_.clear();
  EXPECT_TRUE(first.ok()) << first.error_message();
  EXPECT_TRUE(second.ok()) << second.error_message();
  SCOPED_TRACE(absl::StrJoin(held_.log.events(), ", "));
  EXPECT_LT(held_.log.Position("step 1 reply arrived"), held_.log.Position("step 2 ended"));
}

// A server shut down while a step is parked still answers it, and its shutdown ends.
TEST_F(HeldServerTest, AShutdownWithAStepParkedAnswersItAndEnds) {
  grpc::Status first, second;
  Send(1, &first, "step 1 reply arrived");
  held_.first_started.WaitForNotification();
  Send(2, &second, "step 2 reply arrived");
  ASSERT_TRUE(AwaitParked(gate()));
  std::thread shutdown([&] {
    server_.reset();  // drains, waits for every call, stops the executor
    held_.log.Add("server gone");
  });
  Release(held_.release_first);
  Release(held_.release_second);
  shutdown.join();
  for (std::thread& call : calls_) call.join();
  calls_.clear();
  // Answered by epsd (its step ran, or its cancel was seen), not left to the transport.
  EXPECT_TRUE(first.ok()) << first.error_message();
  EXPECT_NE(second.error_code(), grpc::StatusCode::UNAVAILABLE) << second.error_message();
  SCOPED_TRACE(absl::StrJoin(held_.log.events(), ", "));
  // The shutdown waited for the parked step (a server-side event: when the client thread
  // logs its reply's arrival is up to the scheduler, and it once came after "server gone").
  if (second.ok()) {
    EXPECT_LT(held_.log.Position("step 2 ended"), held_.log.Position("server gone"));
  }
}

class SessionStepAdmissionTest : public ::testing::Test {
 protected:
  SessionStepAdmissionTest()
      : seed_(eps::testing::TestSeed()),
        engine_(eps::testing::SmallServiceModel(), /*max_seqs=*/1, /*max_context=*/512,
                /*max_batch=*/1, seed_) {
    engine_.Fill(0, 0, 300);
  }

  std::string Attach(const std::string& engine_id) {
    v1::AttachResponse response;
    const absl::Status s = service_.Attach(engine_.Attach(engine_id), &response, engine_user_);
    EXPECT_TRUE(s.ok()) << s;
    return response.session_id();
  }
  absl::Status Step(const std::string& session, uint64_t step) {
    v1::SelectPagesResponse response;
    return service_.SelectPages(TestEngine::Step(session, step, rows_), &response, nullptr, {},
                                engine_user_);
  }

  uint64_t seed_;
  // The engine's user, as the Unix socket names it: its re-attach replaces its session.
  const Peer engine_user_{.known = true, .uid = geteuid(), .pid = getpid()};
  TestEngine engine_;
  ServerConfig config_;
  SessionService service_{config_};
  const std::vector<v1::BatchRow> rows_ = {TestEngine::Row(0, 300)};
};

TEST_F(SessionStepAdmissionTest, AStepBeyondTheOneWaitingIsRefusedNamingTheSessionAndItsSteps) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  const std::string id = Attach("engine-a");
  StepGate& gate = service_.session_for_test(id)->step_gate();
  RunningStep running(gate, 7);  // a step of the engine runs
  absl::Status next;
  std::thread waiting([&] { next = Step(id, 8); });
  EXPECT_TRUE(AwaitParked(gate));
  const absl::Status third = Step(id, 9);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  // Named by its label: the id is the session's capability, and this message reaches the
  // step log and the trace spans (docs/security.md), which once showed it whole.
  EXPECT_THAT(third.message(),
              HasSubstr("session '" + telemetry::SessionLabel(id) + "' of engine 'engine-a'"));
  EXPECT_THAT(third.message(), Not(HasSubstr(id)));
  EXPECT_THAT(third.message(), HasSubstr("step 9 refused: step 7 is running and step 8 waits"));
  running.Release();
  waiting.join();
  // The engine's next step, sent while the previous ran, is served.
  EXPECT_TRUE(next.ok()) << next;
  EXPECT_EQ(engine_.buffers().selection_done(), 8u);
}

// A refused call is a failed call (validation_failures_total), not a failed step of
// the session: SessionStats.errors counts only steps that reached the step lock.
TEST_F(SessionStepAdmissionTest, ARefusedStepCountsAsAFailedCallButNotAsASessionError) {
  const std::string id = Attach("engine-a");
  StepGate& gate = service_.session_for_test(id)->step_gate();
  RunningStep running(gate, 1);
  absl::Status next;
  std::thread waiting([&] { next = Step(id, 2); });
  EXPECT_TRUE(AwaitParked(gate));
  EXPECT_EQ(Step(id, 3).code(), absl::StatusCode::kResourceExhausted);
  running.Release();
  waiting.join();
  EXPECT_TRUE(next.ok()) << next;
  v1::GetStatsRequest request;
  request.set_session_id(id);
  v1::GetStatsResponse stats;
  ASSERT_TRUE(service_.GetStats(request, &stats, engine_user_).ok());
  EXPECT_EQ(stats.validation_failures_total(), 1u);
  ASSERT_EQ(stats.sessions_size(), 1);
  EXPECT_EQ(stats.sessions(0).errors(), 0u);
  EXPECT_EQ(stats.sessions(0).steps(), 1u);
}

// A call its client gave up on was not run, and is no failed call either (api.md's
// validation_failures_total, as eps_validation_failures_total).
TEST_F(SessionStepAdmissionTest, AStepPastItsDeadlineIsNotCountedAsAFailedCall) {
  const std::string id = Attach("engine-a");
  v1::SelectPagesResponse response;
  const absl::Status late = service_.SelectPages(
      TestEngine::Step(id, 1, rows_), &response, nullptr,
      {.deadline = absl::Now() - absl::Seconds(1), .cancelled = {}}, engine_user_);
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(service_.GetStats({}, &stats, engine_user_).ok());
  EXPECT_EQ(stats.validation_failures_total(), 0u);
}

// A parked call whose client gave up while it waited (and no later call took its place)
// is still answered, from the executor, once the running step has ended: not run.
TEST_F(SessionStepAdmissionTest, AParkedStepWhoseClientGaveUpIsAnsweredButNotRun) {
  const std::string id = Attach("engine-a");
  StepGate& gate = service_.session_for_test(id)->step_gate();
  RunningStep running(gate, 1);
  std::atomic<bool> gave_up{false};
  absl::Status late;
  std::thread waiting([&] {
    v1::SelectPagesResponse response;
    late = service_.SelectPages(TestEngine::Step(id, 2, rows_), &response, nullptr,
                                {.cancelled = [&] { return gave_up.load(); }}, engine_user_);
  });
  EXPECT_TRUE(AwaitParked(gate));
  gave_up = true;
  running.Release();
  waiting.join();  // answered: its `done` was called
  EXPECT_EQ(late.code(), absl::StatusCode::kCancelled) << late;
  EXPECT_EQ(engine_.buffers().selection_done(), 0u);
}

TEST_F(SessionStepAdmissionTest, AStepWaitingWhenItsSessionIsDetachedDoesNotTouchTheBuffers) {
  const std::string id = Attach("engine-a");
  std::shared_ptr<Session> session = service_.session_for_test(id);
  RunningStep running(session->step_gate(), 1);
  absl::Status late;
  std::thread waiting([&] { late = Step(id, 2); });
  EXPECT_TRUE(AwaitParked(session->step_gate()));
  v1::DetachRequest detach;
  detach.set_session_id(id);
  EXPECT_TRUE(service_.Detach(detach, engine_user_).ok());
  running.Release();
  waiting.join();
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound) << late;
  EXPECT_THAT(late.message(), HasSubstr("was detached, replaced or expired while step 2 waited"));
  EXPECT_THAT(late.message(), Not(HasSubstr(id)));  // the label, not the capability
  EXPECT_EQ(engine_.buffers().selection_done(), 0u);
}

TEST_F(SessionStepAdmissionTest, AStepWaitingWhenItsSessionIsReplacedDoesNotTouchTheBuffers) {
  const std::string old_id = Attach("engine-a");
  std::shared_ptr<Session> old = service_.session_for_test(old_id);
  RunningStep running(old->step_gate(), 1);
  absl::Status late;
  std::thread waiting([&] { late = Step(old_id, 500); });
  EXPECT_TRUE(AwaitParked(old->step_gate()));
  const std::string new_id = Attach("engine-a");  // the engine restarted, same buffers
  ASSERT_TRUE(Step(new_id, 1).ok());
  running.Release();
  waiting.join();
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound) << late;
  EXPECT_EQ(engine_.buffers().selection_done(), 1u);  // the new session's, not 500
}

// The parked step runs on the executor once the running step lets the step lock go,
// and may take it before a Detach waiting for it does (absl::Mutex is not FIFO):
// it must still answer NOT_FOUND and leave the buffers alone.
TEST_F(SessionStepAdmissionTest, AParkedStepDoesNotRunOnceItsSessionStartedRetiring) {
  const std::string id = Attach("engine-a");
  std::shared_ptr<Session> session = service_.session_for_test(id);
  absl::Notification started, release;
  StepExecutor running(1);  // where step 1 runs
  session->step_gate().Run(
      1,
      [&](absl::Status admitted) {
        EXPECT_TRUE(admitted.ok()) << admitted;
        absl::MutexLock step(&session->backend().step_mu());  // as a running step holds it
        started.Notify();
        release.WaitForNotification();
      },
      nullptr, On(running));
  started.WaitForNotification();
  absl::Status late;
  std::thread waiting([&] { late = Step(id, 2); });
  EXPECT_TRUE(AwaitParked(session->step_gate()));
  std::thread detach([&] {
    v1::DetachRequest request;
    request.set_session_id(id);
    EXPECT_TRUE(service_.Detach(request, engine_user_).ok());
  });
  while (!session->retiring()) std::this_thread::yield();  // Detach waits for the lock
  release.Notify();  // the running step ends; the executor runs step 2 next
  running.Stop();
  waiting.join();
  detach.join();
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound) << late;
  EXPECT_THAT(late.message(), HasSubstr("was detached, replaced or expired while step 2 waited"));
  EXPECT_EQ(engine_.buffers().selection_done(), 0u);
}

// Detach and a replacing Attach wait for the old session's running step on the executor:
// the thread that starts them (a gRPC callback thread, in epsd) returns at once. They used
// to wait there, so a Detach of a session with a long step held a callback thread until
// the step ended, and with the steps holding the others, SIGTERM's drain never ended.
TEST_F(SessionStepAdmissionTest,
       DetachAndAReplacingAttachWaitForTheRunningStepOffTheCallersThread) {
  const std::string detached_id = Attach("engine-a");
  const std::string replaced_id = Attach("engine-b");
  std::shared_ptr<Session> detached = service_.session_for_test(detached_id);
  std::shared_ptr<Session> replaced = service_.session_for_test(replaced_id);
  v1::DetachRequest detach;
  detach.set_session_id(detached_id);
  const v1::AttachRequest attach = engine_.Attach("engine-b");
  v1::AttachResponse attached;
  absl::Status detach_status, attach_status;
  absl::Notification started, detach_done, attach_done;
  std::thread caller;
  {
    // The test holds both sessions' step locks, as their running steps would.
    absl::MutexLock step_a(&detached->backend().step_mu());
    absl::MutexLock step_b(&replaced->backend().step_mu());
    caller = std::thread([&] {
      service_.StartDetach(detach, engine_user_, [&](absl::Status s) {
        detach_status = std::move(s);
        detach_done.Notify();
      });
      service_.StartAttach(attach, &attached, {}, engine_user_, [&](absl::Status s) {
        attach_status = std::move(s);
        attach_done.Notify();
      });
      started.Notify();
    });
    EXPECT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_FALSE(detach_done.HasBeenNotified());  // they answer once the steps have ended
    EXPECT_FALSE(attach_done.HasBeenNotified());
  }
  caller.join();
  detach_done.WaitForNotification();
  attach_done.WaitForNotification();
  EXPECT_TRUE(detach_status.ok()) << detach_status;
  ASSERT_TRUE(attach_status.ok()) << attach_status;
  EXPECT_NE(attached.session_id(), replaced_id);
  EXPECT_EQ(service_.session_count(), 1u);
  EXPECT_TRUE(Step(attached.session_id(), 1).ok());
}

TEST_F(SessionStepAdmissionTest, DetachAnswersOnlyAfterTheStepRunningNowHasEnded) {
  const std::string id = Attach("engine-a");
  std::shared_ptr<Session> session = service_.session_for_test(id);
  absl::Notification detached;
  std::thread detach;
  {
    // The test holds the step lock as a running step would.
    absl::MutexLock step(&session->backend().step_mu());
    detach = std::thread([&] {
      v1::DetachRequest request;
      request.set_session_id(id);
      EXPECT_TRUE(service_.Detach(request, engine_user_).ok());
      detached.Notify();
    });
    // A negative check: were Detach not to wait, it would answer well within this.
    EXPECT_FALSE(detached.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  }
  detach.join();
  EXPECT_TRUE(detached.HasBeenNotified());
  EXPECT_EQ(service_.session_count(), 0u);
}

}  // namespace
}  // namespace eps::service

namespace eps::service {
namespace {

// A replacing Attach waits for the old session's running step before it answers; the
// new session's lease starts once it has, so the session it returns is alive however
// long that step ran (the reaper once expired it meanwhile: an Attach answered OK after
// 2.8 s with a 2 s lease, and the engine's next call was NOT_FOUND).
TEST(SessionHandOverTest, AReplacingAttachThatWaitedPastTheLeaseReturnsALiveSession) {
  ServerConfig config;
  config.lease_ms = 300;  // the reaper looks every 30 ms
  SessionService service(config);
  TestEngine engine(eps::testing::SmallServiceModel(), /*max_seqs=*/1, /*max_context=*/512,
                    /*max_batch=*/1, eps::testing::TestSeed());
  const Peer user{.known = true, .uid = geteuid(), .pid = getpid()};
  v1::AttachResponse first, second;
  ASSERT_TRUE(service.Attach(engine.Attach("engine-a"), &first, user).ok());
  std::shared_ptr<Session> old = service.session_for_test(first.session_id());
  absl::Status replaced;
  std::thread attach;
  {
    absl::MutexLock step(&old->backend().step_mu());  // the old session's step runs on
    attach =
        std::thread([&] { replaced = service.Attach(engine.Attach("engine-a"), &second, user); });
    // Published, and waiting for that step to end.
    while (!old->retiring()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(3 * config.lease_ms));
    service.ExpireSessions();
  }
  attach.join();
  ASSERT_TRUE(replaced.ok()) << replaced;
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_session_id(second.session_id());
  v1::HeartbeatResponse renewed;
  const absl::Status s = service.Heartbeat(heartbeat, &renewed, user);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(service.session_count(), 1u);
}

}  // namespace
}  // namespace eps::service
