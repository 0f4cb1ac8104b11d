#include "service/step_executor.h"

#include <algorithm>
#include <utility>

namespace eps::service {

StepExecutor::StepExecutor(int threads) {
  absl::MutexLock lock(&join_mu_);
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Work(); });
}

StepExecutor::~StepExecutor() { Stop(); }

int StepExecutor::DefaultThreads() {
  return std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
}

void StepExecutor::Submit(Task task) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      queue_.push_back(std::move(task));
      return;
    }
  }
  std::move(task)();
}

void StepExecutor::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  absl::MutexLock lock(&join_mu_);
  for (std::thread& thread : threads_) thread.join();
  threads_.clear();
}

bool StepExecutor::HasWorkOrStops() const { return stopping_ || !queue_.empty(); }

void StepExecutor::Work() {
  for (;;) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &StepExecutor::HasWorkOrStops));
      // Stopping: the queue is drained first (a turn a task hands on joins its end).
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    // Let go of the task (and what it holds: its session) before the next wait.
    std::move(task)();
    task = nullptr;
  }
}

}  // namespace eps::service
