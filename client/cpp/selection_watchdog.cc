#include "client/cpp/selection_watchdog.h"

#include <algorithm>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace eps::client {

absl::StatusOr<std::unique_ptr<SelectionWatchdog>> SelectionWatchdog::Create(
    Device device, std::chrono::microseconds timeout) {
  if (timeout.count() <= 0 || timeout > kMaxTimeout) {
    return absl::InvalidArgumentError(absl::StrCat("SelectionWatchdog timeout=", timeout.count(),
                                                   "us must be in [1, ", kMaxTimeout.count(),
                                                   "] us"));
  }
  if (!device.read_done || !device.release_dense) {
    return absl::InvalidArgumentError("SelectionWatchdog: the device lacks a function");
  }
  // The loop's thread starts in the constructor: a process out of threads (RLIMIT_NPROC, a
  // cgroup's pids limit) gets a status, not std::system_error through a caller that
  // expects none.
  try {
    return std::unique_ptr<SelectionWatchdog>(new SelectionWatchdog(std::move(device), timeout));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("SelectionWatchdog: no thread for its loop: ", e.what()));
  }
}

SelectionWatchdog::SelectionWatchdog(Device device, std::chrono::microseconds timeout)
    : device_(std::move(device)), timeout_(timeout), thread_([this] { Loop(); }) {}

SelectionWatchdog::~SelectionWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
  // Finish the armed step's watch (the header says why): poll until selection_done
  // reaches it, release it at its due time.
  uint64_t step = 0;
  std::chrono::steady_clock::time_point due;
  {
    absl::MutexLock lock(&mu_);
    step = armed_step_;
    due = armed_at_ + timeout_;
  }
  if (step == 0) return;
  while (std::chrono::steady_clock::now() < due) {
    const absl::StatusOr<uint64_t> done = device_.read_done();
    if (!done.ok()) break;  // released below
    if (*done >= step) return;
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (const absl::StatusOr<bool> released = CheckAndRelease(step); released.ok() && *released) {
    absl::MutexLock lock(&mu_);
    ++releases_;
  }
}

absl::Status SelectionWatchdog::Arm(uint64_t step) {
  if (step == 0) {
    return absl::InvalidArgumentError(
        "SelectionWatchdog::Arm(step=0): steps start at 1 (0 means nothing armed)");
  }
  absl::MutexLock lock(&mu_);
  // An older (or the same) step than the armed one changes nothing: releasing the armed
  // step releases it too, and its due time stays the earlier arm's.
  if (step <= armed_step_) return absl::OkStatus();
  armed_step_ = step;
  armed_at_ = std::chrono::steady_clock::now();
  return absl::OkStatus();
}

uint64_t SelectionWatchdog::releases() const {
  absl::MutexLock lock(&mu_);
  return releases_;
}

absl::StatusOr<bool> SelectionWatchdog::CheckAndRelease(uint64_t step) {
  const absl::StatusOr<uint64_t> done = device_.read_done();
  if (done.ok() && *done >= step) return false;
  if (absl::Status s = device_.release_dense(step); !s.ok()) return s;
  return true;
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
    const absl::StatusOr<bool> released = CheckAndRelease(step);  // off the lock: device work
    mu_.Lock();
    if (!released.ok()) {
      // The engine's stream still waits on the step: try again one timeout from now (a
      // failed release once dropped the watch, leaving that wait unbounded), unless a newer
      // step was armed meanwhile, whose release raises selection_done past this one too.
      if (armed_step_ < step) {
        armed_step_ = step;
        armed_at_ = std::chrono::steady_clock::now();
      }
    } else if (*released) {
      ++releases_;
    }
  }
}

}  // namespace eps::client
