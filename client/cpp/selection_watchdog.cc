#include "client/cpp/selection_watchdog.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace eps::client {

absl::StatusOr<std::unique_ptr<SelectionWatchdog>> SelectionWatchdog::Create(
    DeviceBuffers& buffers, std::chrono::microseconds timeout) {
  if (timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SelectionWatchdog timeout=", timeout.count(), "us must be > 0"));
  }
  return std::unique_ptr<SelectionWatchdog>(new SelectionWatchdog(buffers, timeout));
}

SelectionWatchdog::SelectionWatchdog(DeviceBuffers& buffers, std::chrono::microseconds timeout)
    : buffers_(buffers), timeout_(timeout), thread_([this] { Loop(); }) {}

SelectionWatchdog::~SelectionWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void SelectionWatchdog::Arm(uint64_t step) {
  absl::MutexLock lock(&mu_);
  armed_step_ = step;
  armed_at_ = std::chrono::steady_clock::now();
}

uint64_t SelectionWatchdog::releases() const {
  absl::MutexLock lock(&mu_);
  return releases_;
}

void SelectionWatchdog::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    if (armed_step_ == 0) {
      mu_.Await(absl::Condition(
          +[](SelectionWatchdog* w)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return w->stop_ || w->armed_step_ != 0; },
          this));
      continue;
    }
    const uint64_t step = armed_step_;
    const auto due = armed_at_ + timeout_;
    // Sleep until the step is due, a newer step is armed, or we stop.
    std::pair<SelectionWatchdog*, uint64_t> watched(this, step);
    mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::pair<SelectionWatchdog*, uint64_t>* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return a->first->stop_ || a->first->armed_step_ != a->second;
            },
            &watched),
        absl::FromChrono(std::max(std::chrono::steady_clock::duration::zero(),
                                  due - std::chrono::steady_clock::now())));
    if (stop_ || armed_step_ != step) continue;
    armed_step_ = 0;
    mu_.Unlock();
    // Off the lock: a device read (and maybe a release) on the buffers' side stream.
    absl::StatusOr<uint64_t> done = buffers_.ReadSelectionDone();
    bool released = false;
    if (!done.ok() || *done < step) released = buffers_.ReleaseDense(step).ok();
    mu_.Lock();
    if (released) ++releases_;
  }
}

}  // namespace eps::client
