#include "service/step_executor.h"

#include <algorithm>
#include <cstdio>
#include <system_error>
#include <utility>

#include "absl/algorithm/container.h"
#include "grpc/support/cpu.h"

namespace eps::service {

StepExecutor::StepExecutor(int threads, int max_threads, int inline_turns, absl::Duration idle_exit)
    : min_threads_(std::max(1, threads)),
      max_threads_(std::max({1, threads, max_threads})),
      inline_turns_(std::max(0, inline_turns)),
      idle_exit_(idle_exit) {
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < min_threads_; ++i) StartThread();
}

StepExecutor::~StepExecutor() { Stop(); }

std::unique_ptr<StepExecutor> StepExecutor::ForSessions(uint32_t max_sessions) {
  const int at_start = DefaultThreads();
  // --max-sessions is at most 100,000 (service/flags.cc): an int.
  return std::make_unique<StepExecutor>(at_start, static_cast<int>(max_sessions) + at_start,
                                        DefaultInlineTurns());
}

int StepExecutor::GrpcCallbackThreads() {
  // gRPC 1.51's callback completion queue (CallbackAlternativeCQ, src/core/lib/surface/
  // completion_queue.cc): Clamp(gpr_cpu_num_cores() / 2, 2, 16) "nexting" threads.
  return std::clamp(static_cast<int>(gpr_cpu_num_cores()) / 2, 2, 16);
}

int StepExecutor::DefaultInlineTurns() { return std::max(1, GrpcCallbackThreads() / 2); }

bool StepExecutor::TakeInlineTurn() {
  absl::MutexLock lock(&mu_);
  if (stopping_ || inline_running_ >= inline_turns_) return false;
  ++inline_running_;
  return true;
}

void StepExecutor::ReturnInlineTurn() {
  absl::MutexLock lock(&mu_);
  --inline_running_;
}

int StepExecutor::DefaultThreads() {
  return std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
}

void StepExecutor::StartThread() {
  try {
    threads_.emplace_back([this] { Work(); });
  } catch (const std::system_error& e) {
    // Out of threads (RLIMIT_NPROC, memory): the task waits for one of the running ones.
    std::fprintf(stderr, "epsd: could not start a step thread (%s); %zu run\n", e.what(),
                 threads_.size());
  }
}

void StepExecutor::Submit(Task task) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      queue_.push_back(std::move(task));
      // Each idle thread takes one queued task: a task beyond them gets a thread of its own.
      if (queue_.size() > static_cast<size_t>(idle_) &&
          threads_.size() < static_cast<size_t>(max_threads_)) {
        StartThread();
      }
      return;
    }
  }
  std::move(task)();
}

void StepExecutor::Stop() {
  absl::MutexLock join(&join_mu_);
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    threads.swap(threads_);
    for (std::thread& thread : exited_) threads.push_back(std::move(thread));
    exited_.clear();
  }
  for (std::thread& thread : threads) thread.join();
}

int StepExecutor::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(threads_.size());
}

bool StepExecutor::HasWorkOrStops() const { return stopping_ || !queue_.empty(); }

void StepExecutor::LeaveThreads() {
  const auto self = absl::c_find_if(
      threads_, [](const std::thread& t) { return t.get_id() == std::this_thread::get_id(); });
  // Always found: StartThread added it under mu_ before the thread could take the lock,
  // and only Stop() empties threads_, after which the condition holds (no timeout).
  exited_.push_back(std::move(*self));
  threads_.erase(self);
}

void StepExecutor::Work() {
  for (;;) {
    Task task;
    bool leave = false;
    std::vector<std::thread> left_before;  // joined by this thread as it leaves
    {
      absl::MutexLock lock(&mu_);
      ++idle_;
      // A thread that may not leave (the pool at its initial size) waits again without
      // letting go of the lock, so it never stops counting as idle (a Submit in such a gap
      // started a thread it did not need).
      bool woken;
      while (!(woken = mu_.AwaitWithTimeout(absl::Condition(this, &StepExecutor::HasWorkOrStops),
                                            idle_exit_)) &&
             threads_.size() <= static_cast<size_t>(min_threads_)) {
      }
      --idle_;
      if (woken) {
        // Stopping: the queue is drained first (a turn a task hands on joins its end).
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      } else {
        // Idle for idle_exit_ (the condition still false, under the lock) with the pool above
        // its initial size: this thread leaves. Submit decides under the same lock whether a task
        // needs a new thread, counting idle_, which no longer counts this one: a task submitted
        // from now on finds it gone, one submitted before woke it. The thread that left
        // before it is joined here, so at most one waits to be joined (by the next to
        // leave, or by Stop()).
        left_before.swap(exited_);
        LeaveThreads();
        leave = true;
      }
    }
    if (leave) {
      for (std::thread& thread : left_before) thread.join();
      return;
    }
    // Let go of the task (and what it holds: its session) before the next wait.
    std::move(task)();
    task = nullptr;
  }
}

}  // namespace eps::service
