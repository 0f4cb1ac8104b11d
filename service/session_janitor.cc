#include "service/session_janitor.h"

#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace eps::service {

SessionJanitor::SessionJanitor() : thread_([this] { Run(); }) {}

SessionJanitor::~SessionJanitor() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void SessionJanitor::Dispose(Session* session) {
  std::unique_ptr<Session> owned(session);
  if (owned == nullptr || owned->backend().kind() != BackendKind::kCuda) return;
  absl::MutexLock lock(&mu_);
  queue_.push_back({std::move(owned), std::chrono::steady_clock::now()});
}

void SessionJanitor::Run() {
  for (;;) {
    Ended next;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](SessionJanitor* j)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(j->mu_) { return j->stop_ || !j->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left
      next = std::move(queue_.front());
      queue_.pop_front();
      stopping = stop_;
    }
    const StepBackend& backend = next.session->backend();
    if (stopping) {
      // Every queued step was released before the sessions were dropped (~SessionService);
      // what still cannot be freed without waiting (an abandoned stream) is left to the
      // process's exit rather than block it.
      if (!backend.SafeToDestroy(std::chrono::steady_clock::duration::max())) {
        (void)next.session.release();  // NOLINT(bugprone-unused-return-value): intended
      }
      continue;  // `next` is destroyed here otherwise
    }
    if (!backend.SafeToDestroy(std::chrono::steady_clock::now() - next.ended)) {
      {
        absl::MutexLock lock(&mu_);
        queue_.push_back(std::move(next));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
}

}  // namespace eps::service
