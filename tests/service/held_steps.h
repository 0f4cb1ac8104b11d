// Helpers of the step-admission tests (step_gate_test.cc, step_admission_test.cc): a step
// held running on an executor of its own, and a log of what happened in which order.
#pragma once

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "service/step_executor.h"
#include "service/step_gate.h"

namespace eps::service::held {

// Spins (yielding) until `gate` holds a parked turn; false after 10 s (a gate
// that never parks one).
inline bool AwaitParked(const StepGate& gate) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!gate.parked()) {
    if (absl::Now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

// Where the gate tests' parked turns run; nothing keeps the gate alive (each test's
// gate outlives its executor, declared after it and so stopped first).
inline StepGate::Handoff On(StepExecutor& executor) {
  return {.executor = &executor, .owner = nullptr};
}

// Holds `gate` as a running step would, on an executor of its own, until Release(),
// which then lets the gate hand the turn parked behind it to that turn's executor.
class RunningStep {
 public:
  RunningStep(StepGate& gate, uint64_t step) {
    // Admitted at once (a free gate).
    gate.Run(
        step,
        [this](absl::Status admitted) {
          EXPECT_TRUE(admitted.ok()) << admitted;
          started_.Notify();
          release_.WaitForNotification();
        },
        nullptr, On(executor_));
    started_.WaitForNotification();
  }
  ~RunningStep() { Release(); }
  // Ends the step, and waits for the gate's work after it (the hand-off of a parked turn).
  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
    executor_.Stop();
  }

 private:
  absl::Notification started_, release_;
  StepExecutor executor_{1};  // stopped before the notifications go
};

// What happened, in order, across threads.
class EventLog {
 public:
  void Add(std::string event) {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(event));
  }
  // Blocks until one of `wanted` has happened.
  void AwaitAny(const std::vector<std::string>& wanted) {
    auto happened = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return absl::c_any_of(
          wanted, [&](const std::string& e) { return absl::c_linear_search(events_, e); });
    };
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&happened));
  }
  std::vector<std::string> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  // Where `event` happened (events().size() when it did not).
  size_t Position(const std::string& event) {
    const std::vector<std::string> all = events();
    return absl::c_find(all, event) - all.begin();
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::service::held
