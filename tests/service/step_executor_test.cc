// The pool that runs every step (service/step_executor.h): tasks run in the order
// submitted, Stop() runs every task still queued before it returns, a task submitted once
// Stop() has begun runs on the caller's thread rather than being dropped, the pool
// grows, to its bound, when a task finds every thread busy, and shrinks back to its
// initial threads once idle, dropping no task.
#include "service/step_executor.h"

#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

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

// Counts the tasks that started, for the tests of growth.
class Started {
 public:
  void Add() {
    absl::MutexLock lock(&mu_);
    ++count_;
  }
  // Whether `n` tasks started within 10 s.
  bool Await(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return count_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(10));
  }

 private:
  absl::Mutex mu_;
  int count_ ABSL_GUARDED_BY(mu_) = 0;
};

// Steps past the inline bound run on the pool: a step submitted while every thread runs another
// session's long step gets a thread of its own, rather than waiting for one of them to end.
TEST(StepExecutorTest, ATaskSubmittedWhileEveryThreadIsBusyGetsAThreadOfItsOwn) {
  StepExecutor executor(1, 4);
  absl::Notification release;
  Started started;
  for (int i = 0; i < 4; ++i) {
    executor.Submit([&] {
      started.Add();
      release.WaitForNotification();
    });
  }
  EXPECT_TRUE(started.Await(4));
  EXPECT_EQ(executor.threads(), 4);
  release.Notify();
  executor.Stop();
}

// At its bound the pool starts no more threads: a further task waits for a free one.
TEST(StepExecutorTest, PastItsBoundATaskWaitsForAFreeThread) {
  StepExecutor executor(1, 2);
  absl::Notification release, third_ran;
  Started started;
  for (int i = 0; i < 2; ++i) {
    executor.Submit([&] {
      started.Add();
      release.WaitForNotification();
    });
  }
  ASSERT_TRUE(started.Await(2));
  executor.Submit([&] { third_ran.Notify(); });
  // A negative check: with a thread of its own it would run well within this.
  EXPECT_FALSE(third_ran.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  EXPECT_EQ(executor.threads(), 2);
  release.Notify();
  third_ran.WaitForNotification();
  executor.Stop();
}

// Whether `executor` runs `n` threads within 10 s (threads leave on their own time).
bool AwaitThreads(const StepExecutor& executor, int n) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (executor.threads() != n) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

// The pool kept every thread a burst started until Stop(): after many sessions stepped at
// once, epsd held hundreds of idle threads for good. A thread started for a burst now
// leaves once idle for the pool's idle_exit; the initial threads stay.
TEST(StepExecutorTest, GrowsUnderABurstAndShrinksBackToItsInitialThreadsOnceIdle) {
  absl::Notification release, again;  // outlive the executor's tasks
  StepExecutor executor(2, 8, /*inline_turns=*/0, /*idle_exit=*/absl::Milliseconds(20));
  Started started;
  for (int i = 0; i < 8; ++i) {
    executor.Submit([&] {
      started.Add();
      release.WaitForNotification();
    });
  }
  EXPECT_TRUE(started.Await(8));
  EXPECT_EQ(executor.threads(), 8);
  release.Notify();
  EXPECT_TRUE(AwaitThreads(executor, 2)) << executor.threads() << " threads";
  // A negative check: the initial threads, idle for ten times idle_exit, stay.
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(executor.threads(), 2);
  // And the pool grows again.
  Started restarted;
  for (int i = 0; i < 4; ++i) {
    executor.Submit([&] {
      restarted.Add();
      again.WaitForNotification();
    });
  }
  EXPECT_TRUE(restarted.Await(4));
  EXPECT_EQ(executor.threads(), 4);
  again.Notify();
  executor.Stop();
  EXPECT_EQ(executor.threads(), 0);
}

// A task submitted while an idle thread leaves runs: the thread counted idle when the task
// came takes it, or the task gets a new one. With the one initial thread held, a task left
// queued for a thread that had gone would never run. The gaps between tasks, around the
// idle time, land before, while and after the thread started for the last task leaves.
TEST(StepExecutorTest, EveryTaskSubmittedWhileThreadsLeaveRuns) {
  const uint64_t seed = eps::testing::TestSeed();
  SCOPED_TRACE(eps::testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> gap_us(0, 600);
  absl::Notification busy, release;  // outlive the executor's tasks
  StepExecutor executor(1, 4, /*inline_turns=*/0, /*idle_exit=*/absl::Microseconds(200));
  // However the test ends, the initial thread is let go before the executor stops.
  absl::Cleanup free_initial = [&release] {
    if (!release.HasBeenNotified()) release.Notify();
  };
  executor.Submit([&] {
    busy.Notify();
    release.WaitForNotification();
  });
  busy.WaitForNotification();
  int found_gone = 0;  // tasks submitted once the last one's thread had left
  for (int i = 0; i < 1000; ++i) {
    if (executor.threads() == 1) ++found_gone;
    auto ran = std::make_shared<absl::Notification>();  // a task left queued runs at Stop()
    executor.Submit([ran] { ran->Notify(); });
    ASSERT_TRUE(ran->WaitForNotificationWithTimeout(absl::Seconds(10)))
        << "task " << i << " was left queued with no thread to run it";
    absl::SleepFor(absl::Microseconds(gap_us(rng)));
  }
  EXPECT_GT(found_gone, 0);  // the threads did leave meanwhile
}

// A server's pool starts with about one thread per core and may grow to one per session
// (--max-sessions) and as many again for the waits of Detach and replacing Attach calls.
TEST(StepExecutorTest, AServersPoolStartsSmall) {
  std::unique_ptr<StepExecutor> executor = StepExecutor::ForSessions(64);
  EXPECT_EQ(executor->threads(), StepExecutor::DefaultThreads());
}

}  // namespace

// Threads of this process whose name is `name` (/proc/self/task/*/comm).
int ThreadsNamed(const std::string& name) {
  int count = 0;
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return -1;
  while (const dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream comm(absl::StrCat("/proc/self/task/", entry->d_name, "/comm"));
    std::string line;
    if (std::getline(comm, line) && line == name) ++count;
  }
  closedir(tasks);
  return count;
}

// The bound on steps run on gRPC's callback threads stays below the number of those
// threads gRPC really starts, counted by name in this process: with the bound at half the
// cores it was all of them on 16 cores, and cancellations and SIGTERM's drain stalled
// again (step_executor.h). Checks the formula GrpcCallbackThreads assumes of gRPC.
TEST(StepExecutorTest, InlineTurnsLeaveSomeOfGrpcsCallbackThreadsFree) {
  grpc::CallbackGenericService service;
  grpc::ServerBuilder builder;
  const std::string path = absl::StrCat("/tmp/eps-executor-test-", getpid(), ".sock");
  builder.AddListeningPort("unix://" + path, grpc::InsecureServerCredentials());
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  int nexting = 0;
  for (int i = 0; i < 100 && nexting < StepExecutor::GrpcCallbackThreads(); ++i) {
    nexting = ThreadsNamed("nexting_thread");
    if (nexting < StepExecutor::GrpcCallbackThreads()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  server->Shutdown();
  unlink(path.c_str());
  EXPECT_EQ(nexting, StepExecutor::GrpcCallbackThreads());
  EXPECT_GE(StepExecutor::DefaultInlineTurns(), 1);
  EXPECT_LT(StepExecutor::DefaultInlineTurns(), nexting);
}

}  // namespace eps::service
