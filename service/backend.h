// A session's step backend: the CPU reference over host memory, or the CUDA
// pre-pass over device memory mapped from the engine (docs/design.md §5).
//
// A backend owns the state its steps need (the cpu backend its Φ bank and
// core selector, the cuda backend its device scratch and pending step) and
// borrows nothing from its session: each call gets the step's buffers as
// values. Thread safety: Run is serialised by step_mu(); kind() and
// async_replies() are immutable.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/layout.h"
#include "core/select.h"
#include "core/step.h"
#include "service/backend_kind.h"
#include "service/memory_budget.h"

namespace eps::service {

// One step as a backend sees it: where to read, where to write, and how.
struct BackendStep {
  StepInputs inputs;  // host or device pointers, as the backend's memory kind
  StepOutputs outputs;
  uint64_t* flags = nullptr;  // [inputs_ready, selection_done]; null without a flags buffer
  uint64_t step = 0;
  SelectPolicy policy;  // the session's defaults with this call's options applied
  bool async = false;   // queue the step and return (only where async_replies())
  // The cpu backend asks it between the step's (row, layer)s and ends a step its caller
  // gave up on (core/step.h StopCheck); the cuda backend queues its step whole.
  StopCheck stop;
};

// A step that an async reply accepted and a later call found finished.
struct FinishedStep {
  uint64_t step = 0;
  absl::Status status;  // its device-side outcome (its lists are -1 when not ok)
  StepStats stats;
  double prepass_us = 0;
};

// What one Run reports.
struct StepOutcome {
  bool done = true;  // false: queued (async), statistics come with a later reply
  StepStats stats;   // this step's, when done
  double prepass_us = 0;
  std::vector<FinishedStep> earlier;  // async steps finished since the last call
};

class StepBackend {
 public:
  virtual ~StepBackend() = default;
  virtual BackendKind kind() const = 0;
  // Whether Run takes async = true (the cuda backend); the session service
  // refuses async requests for other backends before it takes the step lock.
  virtual bool async_replies() const { return false; }
  // Whether the backend frees device memory when destroyed, and whether it can now,
  // after it was put off for `deferred`, without waiting for another session's dead
  // engine (service/session_janitor.h).
  virtual bool frees_device_memory() const { return false; }
  virtual bool SafeToDestroy(std::chrono::steady_clock::duration /*deferred*/) const {
    return true;
  }
  // When the oldest work abandoned on this backend's device that may still run was
  // abandoned (any session's: the device is shared), or none. Such work keeps
  // SafeToDestroy false for every session on the device until it drains, which only its
  // engine can make it do (gpu/live_streams.h); the service gives it a bound
  // (service/session_janitor.h).
  virtual std::optional<std::chrono::steady_clock::time_point> AbandonedWorkSince() const {
    return std::nullopt;
  }

  // What the backend allocates later, sized by a step's options (the cuda backend's strict
  // array), is charged to `budget` (the session's, which outlives the backend) first.
  virtual void set_memory_budget(MemoryBudget* /*budget*/) {}

  // Serialises the steps of the session this backend serves.
  absl::Mutex& step_mu() const ABSL_LOCK_RETURNED(step_mu_) { return step_mu_; }

  // Runs one step, writes the visit lists and then publishes
  // selection_done = step when a flags buffer is given.
  virtual absl::Status Run(const BackendStep& step, StepOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) = 0;

  // The session's step order: FAILED_PRECONDITION unless `step` comes after
  // the last step that ran; StepRan records one (sync, or queued async).
  absl::Status CheckStepOrder(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  void StepRan(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);

  // Ends the session's steps (Detach, a replacing Attach, expiry): work a Run left
  // queued is finished first (FinishQueued), and every later call must find
  // retired() and not run. Taken under the step lock, so once it returns no step
  // of the session writes the engine's buffers again.
  // `release_now` (epsd's shutdown): a queued step is released without waiting for
  // its engine's inputs. Returns how the queued work ended: a device-lost status
  // (core/status.h) means the session's device is lost to this process, though the
  // session has ended all the same.
  absl::Status Retire(bool release_now = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    absl::Status finished = FinishQueued(release_now);
    retired_ = true;
    return finished;
  }
  bool retired() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) { return retired_; }

 protected:
  // Finishes, or releases, what a Run left running after it returned (the cuda
  // backend's async step), so that it no longer writes the engine's buffers.
  virtual absl::Status FinishQueued(bool /*release_now*/) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    return absl::OkStatus();
  }

  mutable absl::Mutex step_mu_;

 private:
  bool retired_ ABSL_GUARDED_BY(step_mu_) = false;
  bool has_step_ ABSL_GUARDED_BY(step_mu_) = false;
  uint64_t last_step_ ABSL_GUARDED_BY(step_mu_) = 0;
};

}  // namespace eps::service
