#include "service/step_gate.h"

#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

namespace eps::service {

void StepGate::Run(uint64_t step, Turn turn, Liveness alive, Handoff handoff) {
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (running_ && parked_.has_value() && parked_->alive != nullptr) {
      if (absl::Status gave_up = parked_->alive(); !gave_up.ok()) {
        // The parked call's client is gone: answer it, and keep this one in its place.
        Parked evicted = *std::exchange(
            parked_, Parked{step, std::move(turn), std::move(alive), std::move(handoff)});
        lock.Release();
        std::move(evicted.turn)(std::move(gave_up));
        return;
      }
    }
    if (running_ && parked_.has_value()) {
      const absl::Status refused = absl::ResourceExhaustedError(absl::StrCat(
          "step ", step, " refused: step ", running_step_, " is running and step ", parked_->step,
          " waits for it; a session runs one step and holds one more (send the next step after "
          "a reply)"));
      lock.Release();
      std::move(turn)(refused);
      return;
    }
    if (running_) {
      parked_.emplace(Parked{step, std::move(turn), std::move(alive), std::move(handoff)});
      return;
    }
    running_ = true;
    running_step_ = step;
  }
  if (handoff.executor->TakeInlineTurn()) {
    // On this thread, within the executor's bound on such turns (step_executor.h); the
    // caller keeps the gate alive until Run returns. A turn parked meanwhile still goes
    // to the pool (EndTurn), so this thread returns as soon as its own turn has ended.
    // Turns must not throw; one that did (an allocation) still gives back its place in
    // the bound and the gate, else the session's next steps would wait for good.
    StepExecutor& executor = *handoff.executor;
    absl::Cleanup end = [&] {
      turn = nullptr;
      executor.ReturnInlineTurn();
      EndTurn();
    };
    std::move(turn)(absl::OkStatus());
    return;
  }
  HandOff(std::move(turn), std::move(handoff));
}

void StepGate::HandOff(Turn turn, Handoff handoff) {
  // `owner` keeps the gate alive until the task has ended.
  StepExecutor& executor = *handoff.executor;
  executor.Submit([this, turn = std::move(turn), owner = std::move(handoff.owner)]() mutable {
    absl::Cleanup end = [&] {
      turn = nullptr;  // let go of what the turn holds before the lock is taken
      EndTurn();
    };
    std::move(turn)(absl::OkStatus());
  });
}

void StepGate::EndTurn() {
  Parked next;
  {
    absl::MutexLock lock(&mu_);
    if (!parked_.has_value()) {
      running_ = false;
      return;
    }
    next = *std::move(parked_);
    parked_.reset();
    running_step_ = next.step;  // running from here on, though not yet started
  }
  // A task of its own, not a loop on this thread: the parked turn may belong to another
  // executor, and the one that just ended lets its thread go to the next queued task.
  HandOff(std::move(next.turn), std::move(next.handoff));
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
