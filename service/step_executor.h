// The threads that run steps and every wait for one (service/step_gate.h): a step a
// session's gate admits runs here, and so do the waits of Detach and of a replacing
// Attach for the old session's running step, and every Attach's session build (mapping,
// CUDA IPC handles, allocation). gRPC 1.51's callback API has few callback threads
// (GrpcCallbackThreads), and it sees a call's cancellation only on a free one: steps, builds
// or waits on all of those threads held off every other call (heartbeats included), the
// cancellations of the steps themselves (so a cancelled cpu step ran to its end) and
// SIGTERM's drain. A step handed here costs a thread hop each way, though (55-145 µs a
// step at p50 on the H100 host: docs/benchmarks/latency.md), so a bounded number of
// steps, half the callback threads (DefaultInlineTurns), run on the callback thread that
// admitted them (TakeInlineTurn); the rest, every parked step, every build and every wait
// run here.
//
// The pool grows: it starts a thread for a task submitted while none is idle, up to
// `max_threads`, and shrinks back: while it holds more threads than it started with, a
// thread that has waited `idle_exit` for a task leaves (a burst of many sessions stepping at
// once left hundreds of idle threads for good). Whether a task needs a new thread is decided
// under the lock a leaving thread holds while it leaves, so no task is ever left queued for
// a thread that has gone; the pool keeps at least its initial number of threads until
// Stop(). A gate hands it at most
// one turn at a time, so one session's steps occupy at most one thread, and with a thread
// per session stepping at once no session's step waits for another's. Past
// `max_threads` a task waits in order for a free thread; nothing run here waits for a
// task still queued (a step waits only for its own session's lock, a Detach for the
// step that holds it, which has its thread, and a build for nothing of the pool), so that
// delays, it never deadlocks.
//
// Ownership: whoever owns the SessionService that hands it work owns it (EpsServer),
// and stops it only after the gRPC server has shut down: a call in flight then is still
// answered while the server drains, and Stop() runs every task still queued.
//
// Thread safety: all methods may be called concurrently.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace eps::service {

class StepExecutor {
 public:
  // One step's turn, or a wait for one; it must not throw.
  using Task = absl::AnyInvocable<void() &&>;

  // How long a thread waits for a task before it leaves, while the pool holds more threads
  // than it started with.
  static constexpr absl::Duration kDefaultIdleExit = absl::Seconds(30);

  // Starts `threads` threads (at least one); grows to `max_threads` (at least `threads`;
  // 0: no growth) as tasks find no idle thread, each thread started so leaving once idle
  // for `idle_exit` (absl::InfiniteDuration(): never). `inline_turns`: how many turns at a
  // time may run on the thread that admits them instead (TakeInlineTurn; 0: none).
  explicit StepExecutor(int threads, int max_threads = 0, int inline_turns = 0,
                        absl::Duration idle_exit = kDefaultIdleExit);
  // Stop().
  ~StepExecutor();
  StepExecutor(const StepExecutor&) = delete;
  StepExecutor& operator=(const StepExecutor&) = delete;

  // The pool for a server of at most `max_sessions` sessions (--max-sessions):
  // DefaultThreads() at start, growing to one thread per session, plus DefaultThreads()
  // for the session builds of Attach calls, the waits of Detach and replacing Attach calls
  // and the steps still running of sessions that have ended. Threads are started only as
  // sessions step at once, and leave after kDefaultIdleExit idle, so an epsd of few
  // engines keeps few.
  static std::unique_ptr<StepExecutor> ForSessions(uint32_t max_sessions);
  // Threads at start: one per core, and at least two.
  static int DefaultThreads();
  // The callback threads gRPC 1.51 starts for a server of callback services: one per two
  // cores, at least 2 and at most 16 (its CallbackAlternativeCQ's "nexting" threads;
  // step_executor_test counts them in the process).
  static int GrpcCallbackThreads();
  // Turns that may run on gRPC's callback threads at once (ForSessions): half of them, at
  // least one. The other half stay free, so the calls of every engine, and the
  // cancellation of the turns running there, are still seen.
  static int DefaultInlineTurns();

  // Whether the caller (a gRPC callback thread) may run one turn itself, skipping the
  // hand-over to a pool thread and back (65-125 µs a step at p50 on the H100 host, 55-145 µs
  // for a synchronous reply: docs/benchmarks/latency.md); true at most `inline_turns` times
  // until as many ReturnInlineTurn() calls. Never once Stop() has begun.
  bool TakeInlineTurn();
  void ReturnInlineTurn();

  // Runs `task` on one of the threads, in the order submitted; once Stop() has begun,
  // on the caller's thread before returning (a task is never dropped: a step dropped
  // would be a call never answered, and a server shutdown that waits for it).
  void Submit(Task task);
  // Runs every task submitted, then joins the threads (those that left included).
  // Idempotent; not to be called from one of its own tasks (the thread would join itself).
  void Stop();

  // Threads running now, not counting those that left (none once stopped), for tests.
  int threads() const;

 private:
  void Work();
  bool HasWorkOrStops() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartThread() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the calling thread from threads_ to exited_, as it leaves.
  void LeaveThreads() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int min_threads_;  // started at once, and never leave
  const int max_threads_;
  const int inline_turns_;
  const absl::Duration idle_exit_;
  mutable absl::Mutex mu_;
  int inline_running_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int idle_ ABSL_GUARDED_BY(mu_) = 0;  // threads waiting for a task
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  // The thread that left last (none, or one), joined by the next to leave or by Stop().
  std::vector<std::thread> exited_ ABSL_GUARDED_BY(mu_);
  absl::Mutex join_mu_;  // Stop() joins once; a second Stop() waits for the first
};

}  // namespace eps::service
