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
  queue_.push_back(std::move(owned));
}

size_t SessionJanitor::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void SessionJanitor::Run() {
  for (;;) {
    std::unique_ptr<Session> next;
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
    // Another session's stream still has queued work (a wait on its engine, maybe one
    // that never comes): later, so that no thread sits in a device-wide wait that could
    // hold up the release of that wait. At shutdown every wait was released first.
    if (!stopping && !next->backend().FreesWithoutWaiting()) {
      {
        absl::MutexLock lock(&mu_);
        queue_.push_back(std::move(next));
      }
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    next.reset();
  }
}

}  // namespace eps::service
