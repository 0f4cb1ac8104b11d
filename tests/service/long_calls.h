// Helper of the busy-server tests (busy_server_test.cc; slow_attach_test.cc and
// attach_races_test.cc through slow_builds.h): counts the long calls (steps, session
// builds) that a test's backend holds until their callers give up or the test releases
// them, across a server's sessions.
#pragma once

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace eps::service::held {

class LongCalls {
 public:
  void Started() { Add(&started_); }
  void Stopped() { Add(&stopped_); }
  // Waits (20 s at most, however loaded the machine) until `n` have started or stopped.
  bool AwaitStarted(int n) { return Await(&started_, n); }
  bool AwaitStopped(int n) { return Await(&stopped_, n); }
  int started() {
    absl::MutexLock lock(&mu_);
    return started_;
  }
  int stopped() {
    absl::MutexLock lock(&mu_);
    return stopped_;
  }
  absl::Notification release;  // ends every long call still running

 private:
  void Add(int* count) {
    absl::MutexLock lock(&mu_);
    ++*count;
  }
  bool Await(int* count, int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [count, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return *count >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(20));
  }

  absl::Mutex mu_;
  int started_ ABSL_GUARDED_BY(mu_) = 0;
  int stopped_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace eps::service::held
