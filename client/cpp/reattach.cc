#include "client/cpp/reattach.h"

#include <exception>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/deadline.h"

namespace eps::client {

BackgroundAttach::BackgroundAttach(AttachCall attach, std::chrono::milliseconds backoff)
    : attach_(std::move(attach)), backoff_(backoff), start_([](std::function<Result()> call) {
        return std::async(std::launch::async, std::move(call));
      }) {}

BackgroundAttach::Result BackgroundAttach::Run() {
  grpc::ClientContext context;
  {
    std::lock_guard lock(mu_);
    if (closing_) return absl::CancelledError("the client is closing");
    if (abandoned_) return absl::CancelledError("the caller stopped waiting for it");
    context_ = &context;
  }
  Result attached = attach_(context);
  {
    std::lock_guard lock(mu_);
    context_ = nullptr;
  }
  return attached;
}

void BackgroundAttach::BackOff() { next_try_ = After(std::chrono::steady_clock::now(), backoff_); }

BackgroundAttach::Result BackgroundAttach::Poll() {
  if (pending_.valid()) {
    if (pending_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      return absl::UnavailableError("re-attach in progress");
    }
    Result attached = pending_.get();
    if (!attached.ok()) {
      BackOff();
      // The step is not attached whatever the Attach answered: UNAVAILABLE naming it (as the
      // Python client does), not the Attach's own code, which a fail-closed engine would
      // read as its step's.
      return absl::UnavailableError(
          absl::StrCat("not attached; re-attach failed: ", attached.status().ToString()));
    }
    return attached;
  }
  if (std::chrono::steady_clock::now() < next_try_) {
    return absl::UnavailableError("not attached; re-attach backing off");
  }
  {
    std::lock_guard lock(mu_);
    abandoned_ = false;
  }
  try {
    pending_ = start_([this] { return Run(); });
  } catch (const std::exception& e) {
    // No thread to run it (std::system_error EAGAIN: a pids limit, RLIMIT_NPROC, memory):
    // the step falls back like any other one not attached, and the next try waits out
    // the backoff rather than failing on every step.
    BackOff();
    return absl::UnavailableError(
        absl::StrCat("not attached; could not start the re-attach: ", e.what()));
  }
  return absl::UnavailableError("not attached; re-attach started");
}

std::optional<BackgroundAttach::Result> BackgroundAttach::Take(
    std::chrono::steady_clock::time_point deadline) {
  if (!pending_.valid()) return std::nullopt;
  if (pending_.wait_until(deadline) != std::future_status::ready) {
    std::lock_guard lock(mu_);
    // A call under way returns promptly; a thread that has not started its call yet
    // (unscheduled until now) must not start it, or get() below would wait for it whole.
    if (context_ != nullptr) context_->TryCancel();
    abandoned_ = true;
  }
  return pending_.get();
}

void BackgroundAttach::Close() {
  {
    std::lock_guard lock(mu_);
    closing_ = true;
    if (context_ != nullptr) context_->TryCancel();
  }
  if (pending_.valid()) pending_.wait();
}

}  // namespace eps::client
