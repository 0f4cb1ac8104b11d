#include "service/step_gate.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace eps::service {

void StepGate::Run(uint64_t step, Turn turn, Liveness alive) {
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (running_ && parked_.has_value() && parked_alive_ != nullptr) {
      if (absl::Status gave_up = parked_alive_(); !gave_up.ok()) {
        // The parked call's client is gone: answer it, and keep this one in its place.
        Turn evicted = std::move(*parked_);
        parked_.emplace(std::move(turn));
        parked_alive_ = std::move(alive);
        parked_step_ = step;
        lock.Release();
        std::move(evicted)(std::move(gave_up));
        return;
      }
    }
    if (running_ && parked_.has_value()) {
      const absl::Status refused = absl::ResourceExhaustedError(absl::StrCat(
          "step ", step, " refused: step ", running_step_, " is running and step ", parked_step_,
          " waits for it; a session runs one step and holds one more (send the next step after "
          "a reply)"));
      lock.Release();
      std::move(turn)(refused);
      return;
    }
    if (running_) {
      parked_.emplace(std::move(turn));
      parked_alive_ = std::move(alive);
      parked_step_ = step;
      return;
    }
    running_ = true;
    running_step_ = step;
  }
  // This thread runs its turn, then each turn parked meanwhile, one at a time. The
  // caller keeps the gate's owner alive meanwhile (a turn may hold its last other
  // reference); a finished turn is let go before the lock is taken.
  for (;;) {
    std::move(turn)(absl::OkStatus());
    turn = nullptr;
    absl::MutexLock lock(&mu_);
    if (!parked_.has_value()) {
      running_ = false;
      return;
    }
    turn = std::move(*parked_);
    parked_.reset();
    parked_alive_ = nullptr;
    running_step_ = parked_step_;
  }
}

bool StepGate::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

bool StepGate::parked() const {
  absl::MutexLock lock(&mu_);
  return parked_.has_value();
}

}  // namespace eps::service
