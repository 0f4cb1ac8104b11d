// The threads that run the steps step gates hand off (service/step_gate.h): a step
// parked behind a session's running step runs here once that step has ended, so the
// running step's gRPC callback returns at once and its reply goes out (gRPC sends a
// unary reply when the callback that finished it returns). A fixed pool: each gate
// hands it at most one turn at a time, so one engine's slow session occupies at most
// one of its threads, as it occupies at most one of gRPC's.
//
// Ownership: whoever owns the SessionService that hands it turns owns it (EpsServer),
// and stops it only after the gRPC server has shut down: a call parked then is still
// answered while the server drains, and Stop() runs every turn still queued.
//
// Thread safety: all methods may be called concurrently.
#pragma once

#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace eps::service {

class StepExecutor {
 public:
  // One handed-off turn; it must not throw.
  using Task = absl::AnyInvocable<void() &&>;

  // Starts `threads` threads (at least one).
  explicit StepExecutor(int threads);
  // Stop().
  ~StepExecutor();
  StepExecutor(const StepExecutor&) = delete;
  StepExecutor& operator=(const StepExecutor&) = delete;

  // Runs `task` on one of the threads, in the order submitted; once Stop() has begun,
  // on the caller's thread before returning (a task is never dropped: a parked call
  // dropped would be a call never answered, and a server shutdown that waits for it).
  void Submit(Task task);
  // Runs every task submitted, then joins the threads. Idempotent; not to be called from
  // one of its own tasks (the thread would join itself).
  void Stop();

  // Threads for a server: as many as gRPC's callback threads (about one per core), and
  // at least two.
  static int DefaultThreads();

 private:
  void Work();
  bool HasWorkOrStops() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Mutex join_mu_;  // Stop() joins once
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace eps::service
