// The pool that runs every step (service/step_executor.h): tasks run in the order
// submitted, Stop() runs every task still queued before it returns, a task submitted once
// Stop() has begun runs on the caller's thread rather than being dropped, and the pool
// grows, to its bound, when a task finds every thread busy.
#include "service/step_executor.h"

#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
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
