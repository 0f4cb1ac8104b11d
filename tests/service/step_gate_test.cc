// The step gate alone (service/step_gate.h): one turn runs (on the caller's thread within
// the executor's inline bound, else on the executor), one is parked and handed to its
// executor when the running one ends, any further one is refused at once.
#include "service/step_gate.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/step_executor.h"
#include "tests/service/held_steps.h"

namespace eps::service {
namespace {

using held::AwaitParked;
using held::EventLog;
using held::On;
using held::RunningStep;
using ::testing::HasSubstr;

TEST(SessionStepGateTest, AThirdTurnIsRefusedAtOnceWhileOneRunsAndOneIsParked) {
  StepGate gate;
  StepExecutor executor(1);
  RunningStep first(gate, 1);
  std::optional<absl::Status> second, third;
  absl::Notification second_ran;
  gate.Run(
      2,
      [&](absl::Status admitted) {
        second = admitted;
        second_ran.Notify();
      },
      nullptr, On(executor));
  // Parked: Run returned on this thread while step 1 still runs, and holds no thread.
  EXPECT_FALSE(second_ran.HasBeenNotified());
  EXPECT_TRUE(gate.parked());
  gate.Run(
      3, [&](absl::Status admitted) { third = admitted; }, nullptr, On(executor));
  ASSERT_TRUE(third.has_value());  // answered before Run returned
  EXPECT_EQ(third->code(), absl::StatusCode::kResourceExhausted) << *third;
  EXPECT_THAT(third->message(), HasSubstr("step 3 refused: step 1 is running and step 2 waits"));
  first.Release();  // the gate hands the parked turn to the executor
  second_ran.WaitForNotification();
  EXPECT_TRUE(second->ok()) << *second;
  executor.Stop();  // the gate's work after the turn is done
  EXPECT_FALSE(gate.running());
  EXPECT_FALSE(gate.parked());
}

TEST(SessionStepGateTest, AParkedTurnWhoseCallerGaveUpGivesItsPlaceToTheNextStep) {
  StepGate gate;
  StepExecutor executor(1);
  RunningStep first(gate, 1);
  std::optional<absl::Status> second, third;
  absl::Notification third_ran;
  std::atomic<bool> second_alive{true};
  gate.Run(
      2, [&](absl::Status admitted) { second = admitted; },
      [&]() -> absl::Status {
        return second_alive ? absl::OkStatus() : absl::DeadlineExceededError("step 2 expired");
      },
      On(executor));
  second_alive = false;  // its client's deadline ran out; the engine sends step 3
  gate.Run(
      3,
      [&](absl::Status admitted) {
        third = admitted;
        third_ran.Notify();
      },
      nullptr, On(executor));
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->code(), absl::StatusCode::kDeadlineExceeded) << *second;
  EXPECT_FALSE(third_ran.HasBeenNotified());  // parked in step 2's place, not refused
  first.Release();
  third_ran.WaitForNotification();
  EXPECT_TRUE(third->ok()) << *third;
}

// The caller is a gRPC callback thread in epsd: a step run on it held off other engines'
// calls and the step's own cancellation (gRPC 1.51 sees a cancel only on a free callback
// thread), so two cancelled cpu steps on a 2-core machine ran to their end. Run returns
// before the turn has run, which runs on the executor. (Were it run inline, it would wait
// 10 s for Run's return, then fail.)
// An executor without inline turns (StepExecutor's default): every turn is handed over.
TEST(SessionStepGateTest, NoTurnRunsOnTheCallersThreadNotEvenOnAFreeGate) {
  StepGate gate;
  StepExecutor executor(1);
  absl::Notification returned, ran;
  std::thread::id ran_on;
  gate.Run(
      1,
      [&](absl::Status admitted) {
        EXPECT_TRUE(admitted.ok()) << admitted;
        ran_on = std::this_thread::get_id();
        returned.WaitForNotificationWithTimeout(absl::Seconds(10));
        ran.Notify();
      },
      nullptr, On(executor));
  const bool returned_first = !ran.HasBeenNotified();
  returned.Notify();
  ran.WaitForNotification();
  executor.Stop();  // the gate's work after the turn is done
  EXPECT_TRUE(returned_first);
  EXPECT_NE(ran_on, std::this_thread::get_id());
  EXPECT_FALSE(gate.running());
}

// Within the executor's bound a turn runs on the caller's thread (no hop to the pool and
// back); past it a turn of another gate goes to the pool, a parked turn always does, and
// the bound is given back when the inline turn ends. None once the executor stops.
TEST(SessionStepGateTest, InlineTurnsRunOnTheCallersThreadUpToTheExecutorsBound) {
  StepGate first, second;
  StepExecutor executor(1, 0, /*inline_turns=*/1);
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id first_on, second_on, parked_on;
  absl::Notification second_ran, parked_ran;
  first.Run(
      1,
      [&](absl::Status admitted) {
        EXPECT_TRUE(admitted.ok()) << admitted;
        first_on = std::this_thread::get_id();
        second.Run(
            1,
            [&](absl::Status ok) {
              EXPECT_TRUE(ok.ok()) << ok;
              second_on = std::this_thread::get_id();
              second_ran.Notify();
            },
            nullptr, On(executor));
        first.Run(
            2,
            [&](absl::Status ok) {
              EXPECT_TRUE(ok.ok()) << ok;
              parked_on = std::this_thread::get_id();
              parked_ran.Notify();
            },
            nullptr, On(executor));
        EXPECT_TRUE(first.parked());
      },
      nullptr, On(executor));
  EXPECT_EQ(first_on, caller);
  ASSERT_TRUE(second_ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(parked_ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_NE(second_on, caller);
  EXPECT_NE(parked_on, caller);
  // The bound was given back: the next turn on a free gate runs here again.
  std::thread::id again_on;
  StepGate third;
  third.Run(
      1, [&](absl::Status) { again_on = std::this_thread::get_id(); }, nullptr, On(executor));
  EXPECT_EQ(again_on, caller);
  executor.Stop();
  EXPECT_FALSE(executor.TakeInlineTurn());
}

// The defect this guards against: the parked turn ran on the running turn's thread
// right after it, so the running turn's task (in epsd: the step that finished the
// previous call) held its thread until the parked one ended too. The parked turn is a
// task of its own on its executor; the running turn's executor is free once its turn
// has ended (a task queued behind it there runs before the parked turn ends).
TEST(SessionStepGateTest, TheRunningTurnsThreadIsFreeBeforeTheParkedTurnEnds) {
  StepGate gate;
  StepExecutor first_executor(1), second_executor(1);
  EventLog log;
  absl::Notification first_started, release_first, release_second;
  std::thread::id first_thread;
  gate.Run(
      1,
      [&](absl::Status admitted) {
        EXPECT_TRUE(admitted.ok()) << admitted;
        first_thread = std::this_thread::get_id();
        first_started.Notify();
        release_first.WaitForNotification();
        log.Add("step 1 ended");
      },
      nullptr, On(first_executor));
  first_started.WaitForNotification();
  first_executor.Submit([&] { log.Add("step 1's thread is free"); });
  gate.Run(
      2,
      [&](absl::Status admitted) {
        EXPECT_TRUE(admitted.ok()) << admitted;
        log.Add("step 2 started");
        // On step 1's thread it must not wait for that thread's next task: the test would
        // hang instead of failing.
        if (std::this_thread::get_id() != first_thread) release_second.WaitForNotification();
        log.Add("step 2 ended");
      },
      nullptr, On(second_executor));
  release_first.Notify();
  log.AwaitAny({"step 1's thread is free", "step 2 ended"});
  release_second.Notify();
  first_executor.Stop();
  second_executor.Stop();
  SCOPED_TRACE(absl::StrJoin(log.events(), ", "));
  EXPECT_LT(log.Position("step 1 ended"), log.Position("step 2 started"));
  EXPECT_LT(log.Position("step 1's thread is free"), log.Position("step 2 ended"));
}

// Turns run one at a time and in the order admitted, also when each parked turn is
// handed to a pool of several threads.
TEST(SessionStepGateTest, HandedOffTurnsNeverOverlapAndKeepTheirOrder) {
  StepGate gate;
  StepExecutor executor(4);
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  std::vector<uint64_t> order;  // written by one turn at a time
  absl::Notification all_ran;
  constexpr uint64_t kSteps = 200;
  auto turn_for = [&](uint64_t step) {
    return [&, step](absl::Status admitted) {
      EXPECT_TRUE(admitted.ok()) << "step " << step << ": " << admitted;
      if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
      order.push_back(step);
      std::this_thread::yield();
      inside.fetch_sub(1);
      if (step == kSteps) all_ran.Notify();
    };
  };
  RunningStep first(gate, 0);
  gate.Run(1, turn_for(1), nullptr, On(executor));
  // Each further step is sent once the one before it left the parked place, so none is
  // refused: a turn handed off makes room for the next, which parks behind it.
  for (uint64_t step = 2; step <= kSteps; ++step) {
    if (step == 2) first.Release();
    while (gate.parked()) std::this_thread::yield();
    gate.Run(step, turn_for(step), nullptr, On(executor));
  }
  all_ran.WaitForNotification();
  executor.Stop();
  EXPECT_EQ(overlaps.load(), 0);
  ASSERT_EQ(order.size(), kSteps);
  for (uint64_t i = 0; i < kSteps; ++i) EXPECT_EQ(order[i], i + 1);
  EXPECT_FALSE(gate.running());
}

// The gate's owner, held by nothing but the handoff, lives until the handed-off turn and
// the gate's work after it are done.
TEST(SessionStepGateTest, AHandedOffTurnKeepsTheGatesOwnerAlive) {
  struct Owner {
    StepGate gate;
  };
  StepExecutor executor(1);
  auto owner = std::make_shared<Owner>();
  std::weak_ptr<Owner> watch = owner;
  absl::Notification ran;
  {
    StepGate& gate = owner->gate;
    RunningStep first(gate, 1);
    gate.Run(2, [&](absl::Status) { ran.Notify(); }, nullptr,
             {.executor = &executor, .owner = std::move(owner)});
  }  // step 1 ends; only the handoff holds the owner now
  ran.WaitForNotification();
  executor.Stop();
  EXPECT_TRUE(watch.expired());  // let go once done, not leaked
}

}  // namespace
}  // namespace eps::service
