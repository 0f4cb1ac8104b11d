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

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/session_service.h"
#include "service/step_gate.h"
#include "service/telemetry/telemetry.h"
#include "tests/core/test_util.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;
using ::testing::HasSubstr;
using ::testing::Not;

// Spins (yielding) until `gate` holds a parked turn; false after 10 s (a gate
// that never parks one).
bool AwaitParked(const StepGate& gate) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!gate.parked()) {
    if (absl::Now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

// Holds `gate` from a thread of its own as a running step would, until Release(),
// which then lets that thread run the turn parked behind it.
class RunningStep {
 public:
  RunningStep(StepGate& gate, uint64_t step)
      : thread_([this, &gate, step] {
          gate.Run(step, [this](absl::Status admitted) {
            EXPECT_TRUE(admitted.ok()) << admitted;
            started_.Notify();
            release_.WaitForNotification();
          });
        }) {
    started_.WaitForNotification();
  }
  ~RunningStep() { Release(); }
  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
    if (thread_.joinable()) thread_.join();
  }

 private:
  absl::Notification started_, release_;
  std::thread thread_;
};

TEST(SessionStepGateTest, AThirdTurnIsRefusedAtOnceWhileOneRunsAndOneIsParked) {
  StepGate gate;
  RunningStep first(gate, 1);
  std::optional<absl::Status> second, third;
  gate.Run(2, [&](absl::Status admitted) { second = admitted; });
  // Parked: Run returned on this thread while step 1 still runs, and holds no thread.
  EXPECT_FALSE(second.has_value());
  EXPECT_TRUE(gate.parked());
  gate.Run(3, [&](absl::Status admitted) { third = admitted; });
  ASSERT_TRUE(third.has_value());  // answered before Run returned
  EXPECT_EQ(third->code(), absl::StatusCode::kResourceExhausted) << *third;
  EXPECT_THAT(third->message(), HasSubstr("step 3 refused: step 1 is running and step 2 waits"));
  first.Release();  // its thread runs the parked turn before it ends
  ASSERT_TRUE(second.has_value());
  EXPECT_TRUE(second->ok()) << *second;
  EXPECT_FALSE(gate.running());
  EXPECT_FALSE(gate.parked());
}

TEST(SessionStepGateTest, AParkedTurnWhoseCallerGaveUpGivesItsPlaceToTheNextStep) {
  StepGate gate;
  RunningStep first(gate, 1);
  std::optional<absl::Status> second, third;
  bool second_alive = true;
  gate.Run(
      2, [&](absl::Status admitted) { second = admitted; },
      [&]() -> absl::Status {
        return second_alive ? absl::OkStatus() : absl::DeadlineExceededError("step 2 expired");
      });
  second_alive = false;  // its client's deadline ran out; the engine sends step 3
  gate.Run(3, [&](absl::Status admitted) { third = admitted; });
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->code(), absl::StatusCode::kDeadlineExceeded) << *second;
  EXPECT_FALSE(third.has_value());  // parked in step 2's place, not refused
  first.Release();
  ASSERT_TRUE(third.has_value());
  EXPECT_TRUE(third->ok()) << *third;
}

TEST(SessionStepGateTest, AFreeGateRunsTheTurnOnTheCallersThread) {
  StepGate gate;
  std::thread::id ran_on;
  gate.Run(1, [&](absl::Status admitted) {
    EXPECT_TRUE(admitted.ok());
    ran_on = std::this_thread::get_id();
  });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_FALSE(gate.running());
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

// The parked step runs on the running step's thread once that step lets the step lock
// go, and may take it again before a Detach waiting for it does (absl::Mutex is not FIFO):
// it must still answer NOT_FOUND and leave the buffers alone.
TEST_F(SessionStepAdmissionTest, AParkedStepDoesNotRunOnceItsSessionStartedRetiring) {
  const std::string id = Attach("engine-a");
  std::shared_ptr<Session> session = service_.session_for_test(id);
  absl::Notification started, release;
  std::thread running([&] {
    session->step_gate().Run(1, [&](absl::Status admitted) {
      EXPECT_TRUE(admitted.ok()) << admitted;
      absl::MutexLock step(&session->backend().step_mu());  // as a running step holds it
      started.Notify();
      release.WaitForNotification();
    });
  });
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
  release.Notify();  // the running step ends; its thread runs step 2 next
  running.join();
  waiting.join();
  detach.join();
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound) << late;
  EXPECT_THAT(late.message(), HasSubstr("was detached, replaced or expired while step 2 waited"));
  EXPECT_EQ(engine_.buffers().selection_done(), 0u);
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
