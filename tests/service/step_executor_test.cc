// The pool that runs handed-off steps (service/step_executor.h): tasks run in the order
// submitted, Stop() runs every task still queued before it returns, and a task
// submitted once Stop() has begun runs on the caller's thread rather than being dropped.
#include "service/step_executor.h"

#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eps::service {
namespace {

using ::testing::ElementsAre;

TEST(StepExecutorTest, OneThreadRunsTasksInTheOrderSubmitted) {
  StepExecutor executor(1);
  std::vector<int> ran;  // written by the executor's one thread
  absl::Notification last;
  for (int i = 0; i < 5; ++i) {
    executor.Submit([&ran, &last, i] {
      ran.push_back(i);
      if (i == 4) last.Notify();
    });
  }
  last.WaitForNotification();
  executor.Stop();
  EXPECT_THAT(ran, ElementsAre(0, 1, 2, 3, 4));
}

TEST(StepExecutorTest, StopRunsEveryTaskStillQueuedBeforeItReturns) {
  StepExecutor executor(1);
  absl::Notification started, release;
  absl::Mutex mu;
  std::vector<int> ran;
  executor.Submit([&] {
    started.Notify();
    release.WaitForNotification();
  });
  started.WaitForNotification();  // the one thread is busy: the next two queue
  for (int i = 1; i <= 2; ++i) {
    executor.Submit([&, i] {
      absl::MutexLock lock(&mu);
      ran.push_back(i);
    });
  }
  std::thread stop([&] { executor.Stop(); });
  release.Notify();
  stop.join();
  absl::MutexLock lock(&mu);
  EXPECT_THAT(ran, ElementsAre(1, 2));
}

TEST(StepExecutorTest, ATaskSubmittedAfterStopRunsOnTheCallersThread) {
  StepExecutor executor(2);
  executor.Stop();
  std::thread::id ran_on;
  executor.Submit([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  executor.Stop();  // again: nothing to do
}

}  // namespace
}  // namespace eps::service
