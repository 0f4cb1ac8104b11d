// Admission to one session's steps: one step runs, one more may be parked behind
// it, and any further call is refused at once. A parked step holds no thread: it
// is kept as a function and run on the thread of the step before it, once that
// one has ended. A step runs inline on a gRPC callback thread, so a step that
// waited on a lock instead would hold one of the server's few threads, and an
// engine with calls queued on its own slow session would starve every other
// engine (docs/api-failures.md, "Steps in flight"). A normal engine has at most two calls
// on a session: the step running and, after a client deadline, the next one.
//
// Thread safety: all methods may be called concurrently. Turns of one gate never
// run at the same time.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace eps::service {

class StepGate {
 public:
  // One step's turn: called once with OK when the step may run, or with the
  // refusal (RESOURCE_EXHAUSTED) when it may not. It must not throw.
  using Turn = absl::AnyInvocable<void(absl::Status admitted) &&>;
  // Whether a parked turn's caller still waits: OK, or why not (its deadline passed,
  // it was cancelled).
  using Liveness = absl::AnyInvocable<absl::Status() const>;

  // Runs `turn` now when no step runs (on this thread, before returning); parks it
  // when one runs and none is parked, to run on the running step's thread after
  // it; otherwise calls it at once with RESOURCE_EXHAUSTED, unless the parked turn's
  // caller gave up (`alive` of that turn not OK): that turn is then called with
  // `alive`'s status and this one parked instead, so an engine whose own deadline
  // ran out is not refused its next step. A turn run here may be followed, on this
  // thread, by the turn that was parked behind it. The caller keeps the gate alive
  // until Run returns.
  void Run(uint64_t step, Turn turn, Liveness alive = nullptr);

  // What the gate holds now, for tests.
  bool running() const;
  bool parked() const;

 private:
  mutable absl::Mutex mu_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t running_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<Turn> parked_ ABSL_GUARDED_BY(mu_);
  Liveness parked_alive_ ABSL_GUARDED_BY(mu_);  // may be empty
  uint64_t parked_step_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace eps::service
